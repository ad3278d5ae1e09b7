"""--ep-size (SGLang's meaning) on CPU over gloo: MoE experts under tensor parallelism either partitioned over the
ranks (--ep-size = --tp-size, each rank its E / N experts whole) or each expert split over them by its intermediate
features (--ep-size 1, tensor-parallel MoE). Both give one rank's output: the block alone (every checkpoint layout,
fused and unfused shared experts, both routers) and a tiny Qwen3-MoE's prefill and decode logits."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from tp_helpers import rank_main, single

from specserve.distributed.tp import TP1, TPGroup, init_tp
from specserve.layers.moe import SparseMoEBlock
from specserve.server_args import ServerArgs

pytestmark = pytest.mark.usefixtures("one_thread")

H, INTER, E, K = 32, 24, 8, 2
# name -> (SparseMoEBlock keywords, fused checkpoint layout)
BLOCKS = {
    "softmax": (dict(renormalize=True), False),
    "softmax_fused_layout": (dict(renormalize=False), True),
    # Qwen3-Next: a gated shared expert as wide as a routed one (fused as expert E when the experts are not
    # partitioned)
    "gated_shared_fused": (dict(renormalize=True, shared_expert_intermediate_size=INTER, shared_expert_gated=True),
                           True),
    # DeepSeek-V3: grouped sigmoid router, a plain shared expert
    "grouped_shared": (dict(renormalize=True, router="grouped_sigmoid", n_group=4, topk_group=2,
                            routed_scaling_factor=2.5, shared_expert_intermediate_size=INTER), False),
    # Qwen2-MoE: a gated shared expert of its own width (never fused: whole on rank 0)
    "gated_shared_wide": (dict(renormalize=False, shared_expert_intermediate_size=40, shared_expert_gated=True),
                          False),
}


def _checkpoint(kw: dict, fused: bool, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors under checkpoint names (std 1/sqrt(fan_in))."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(shape, generator=g) / shape[-1] ** 0.5

    sd = {"gate.weight": rand(E, H)}
    if kw.get("router") == "grouped_sigmoid":
        sd["gate.e_score_correction_bias"] = torch.randn(E, generator=g)
    gate_up, down = rand(E, 2 * INTER, H), rand(E, H, INTER)
    if fused:
        sd.update({"experts.gate_up_proj": gate_up, "experts.down_proj": down})
    else:
        for e in range(E):
            sd.update({f"experts.{e}.gate_proj.weight": gate_up[e, :INTER], f"experts.{e}.up_proj.weight":
                       gate_up[e, INTER:], f"experts.{e}.down_proj.weight": down[e]})
    s = kw.get("shared_expert_intermediate_size", 0)
    if s:
        sd.update({"shared_expert.gate_proj.weight": rand(s, H), "shared_expert.up_proj.weight": rand(s, H),
                   "shared_expert.down_proj.weight": rand(H, s)})
    if kw.get("shared_expert_gated"):
        sd["shared_expert_gate.weight"] = rand(1, H)
    return sd


def _outputs(tp: TPGroup, expert_parallel: bool, x: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    for i, (name, (kw, fused)) in enumerate(BLOCKS.items()):
        block = SparseMoEBlock(H, INTER, E, K, tp=tp, expert_parallel=expert_parallel, **kw)
        for n, t in _checkpoint(kw, fused, seed=70 + i).items():
            assert block.load_weight(n, t), n
        assert block.loaded_param_names() == {n for n, _ in block.named_parameters()}, name
        with torch.no_grad():
            out[name] = block(x)
    return out


def _block_rank(rank: int, size: int, rendezvous: str, expert_parallel: bool, x: torch.Tensor, out: str) -> None:
    torch.set_num_threads(1)
    tp = init_tp(rank, size, rendezvous, "gloo")
    got = _outputs(tp, expert_parallel, x)
    if rank == 0:
        torch.save(got, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)  # as tp_helpers.rank_main: no interpreter teardown under gloo's threads


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["ep2", "ep1"])
def test_moe_block_two_ranks_equal_one(expert_parallel, tmp_path):
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(3))
    want = _outputs(TP1, True, x)
    out = str(tmp_path / "out.pt")
    mp.spawn(_block_rank, args=(2, f"file://{tmp_path / 'rdzv'}", expert_parallel, x, out), nprocs=2, join=True)
    got = torch.load(out)
    for name in BLOCKS:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)


def test_moe_block_split_shapes():
    """Rank 1 of 2: partitioned, its 4 experts whole; split, all 8 experts (+ the fused shared one) at half width."""
    kw = dict(renormalize=True, shared_expert_intermediate_size=INTER, shared_expert_gated=True)
    with torch.device("meta"):
        ep = SparseMoEBlock(H, INTER, E, K, tp=TPGroup(1, 2), expert_parallel=True, **kw)
        split = SparseMoEBlock(H, INTER, E, K, tp=TPGroup(1, 2), expert_parallel=False, **kw)
    assert (ep.expert_start, tuple(ep.experts.w13.shape), ep.fused_shared) == (4, (4, 2 * INTER, H), False)
    assert (split.expert_start, tuple(split.experts.w13.shape), split.fused_shared) == (0, (E + 1, INTER, H), True)
    assert tuple(split.experts.w2.shape) == (E + 1, H, INTER // 2)


@pytest.mark.parametrize("ep_size", [1, 2])
def test_qwen3_moe_tp2_logits_equal_one_rank(tiny_models, ep_size, tmp_path):
    """The model runner's prefill and decode over 2 ranks, the experts split either way (--ep-size 2 is also
    test_tp_cpu's case; here beside --ep-size 1 for the comparison)."""
    path = tiny_models["qwen3_moe"]
    prompts, steps = [[5, 17, 99, 3, 250, 8, 41], [7, 7, 120]], 3
    want = single(path, prompts, steps)
    out = str(tmp_path / "tp2.pt")
    expert_parallel = ServerArgs(model_path=path, tp_size=2, ep_size=ep_size).moe_expert_parallel
    mp.spawn(rank_main, args=(2, f"file://{tmp_path / 'rdzv'}", path, prompts, steps, out, expert_parallel),
             nprocs=2, join=True)
    got = torch.load(out)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_ep_size_values():
    assert ServerArgs(model_path="/m", tp_size=4).ep_size == 4  # default: the experts partitioned (as before)
    assert ServerArgs(model_path="/m", tp_size=4, ep_size=1).moe_expert_parallel is False
    assert ServerArgs(model_path="/m").moe_expert_parallel  # one rank: either way the same
    with pytest.raises(ValueError, match="--ep-size 2 must be 1"):
        ServerArgs(model_path="/m", tp_size=4, ep_size=2)
