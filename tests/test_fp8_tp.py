"""FP8 weights under tensor parallelism (layers/parallel.py, FusedMoE with an intermediate slice per rank): each
rank keeps its slice of a block-scaled or per-channel FP8 weight with the matching slice of its scales, which
dequantizes to the same slice of the full dequantized weight (every rank of 2 and 4, simulated in one process: the
loading path needs no collective); a slice off the blocks is dequantized for that layer only; and, over gloo in one
process launch, FP8 checkpoints (a Llama, a Qwen3-MoE with its experts split) and online FP8 at 2 ranks give one
rank's logits while every rank holds the same layers in FP8."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from test_fp8_checkpoint import _fp8_copies, _quantize, _quantize_rows, fp8_modules
from tp_helpers import fp8_rank_main, load_rank_model, run_loaded

from specserve.distributed.tp import TP1, TPGroup
from specserve.kernels import ops
from specserve.kernels.reference_fp8 import dequantize_weight
from specserve.kernels.reference_moe_fp8 import dequantize_experts
from specserve.layers.moe import FusedMoE
from specserve.layers.parallel import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from specserve.weights.fp8 import Fp8Format, Fp8Weight, paired

pytestmark = pytest.mark.usefixtures("one_thread")


def _fp8(shape: tuple[int, int], block: tuple[int, int] | None, seed: int) -> Fp8Weight:
    """A random checkpoint weight [O, I] in FP8: block scales, or one per row (block None)."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.5, 4, shape[1])
    return paired(*(_quantize(w, block) if block else _quantize_rows(w)), Fp8Format(block))


def _held(layer) -> torch.Tensor:
    """What a linear layer computes with, float32: its FP8 weight dequantized, or its plain weight."""
    return dequantize_weight(layer.weight, layer.weight_scale, layer.fp8_block) if layer.is_fp8 else layer.weight


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("block", [(16, 16), None])
def test_each_rank_keeps_its_fp8_slice(size, block):
    """Column (rows and their scale rows), row (columns: their block columns, or all the row scales) and merged
    q|k|v (4 ranks: the 2 KV heads replicated, a unit's rows and scale rows) layers: FP8 on every rank, their
    slices dequantizing to the full weight's; a row-parallel FP8 GEMM's partial sums add up to the full layer's
    (the input quantised per token per 16 columns: the same groups on a slice that starts on a block)."""
    col, row = _fp8((128, 64), block, 1), _fp8((64, 128), block, 2)
    q, k, v = (_fp8((rows, 64), block, 3 + i) for i, rows in enumerate((64, 32, 32)))
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(9))
    partial = []
    for r in range(size):
        tp = TPGroup(r, size)
        c, rw = ColumnParallelLinear(64, 128, tp), RowParallelLinear(128, 64, tp)
        qkv = MergedColumnParallelLinear(64, {"q": (64, 16), "k": (32, 16), "v": (32, 16)}, tp)
        c.load_full(col)
        rw.load_full(row)
        for name, w in zip("qkv", (q, k, v)):
            qkv.load_shard(name, w)
        assert c.is_fp8 and rw.is_fp8 and qkv.is_fp8 and c.fp8_block == block
        n = 128 // size
        assert torch.equal(_held(c), col.dequantize(torch.float32)[r * n:(r + 1) * n])
        kcols = 128 // size
        assert torch.equal(_held(rw), row.dequantize(torch.float32)[:, r * kcols:(r + 1) * kcols])
        kv = (r * 2 // size * 16, 16) if size > 2 else (r * 16, 16)  # (first row, rows) of this rank's KV head
        want = torch.cat([q.dequantize(torch.float32)[r * 64 // size:(r + 1) * 64 // size]]
                         + [t.dequantize(torch.float32)[kv[0]:kv[0] + kv[1]] for t in (k, v)])
        assert torch.equal(_held(qkv), want)
        xs = x[:, r * kcols:(r + 1) * kcols]
        partial.append(ops.fp8_linear(xs, rw.weight, rw.weight_scale, rw.fp8_block))
    if block is not None:  # per-channel: each rank quantises its input slice per token (parallel.py says why)
        want = ops.fp8_linear(x, row.q, row.scale, block)
        torch.testing.assert_close(sum(partial), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def test_misaligned_slice_dequantized_for_that_layer_only():
    """32 x 32 blocks at 4 ranks: the column layer's 32 rows and the row layer's 32 columns fall on the blocks
    (kept in FP8), the merged layer's 16 rows of a KV head do not (dequantized: the slice of the dequantized
    weight, bit for bit); the meta-device conversion asks the same question (fp8_blocks_fit)."""
    block = (32, 32)
    col, row = _fp8((128, 64), block, 1), _fp8((64, 128), block, 2)
    q, k, v = (_fp8((rows, 64), block, 3 + i) for i, rows in enumerate((64, 32, 32)))
    for r in range(4):
        tp = TPGroup(r, 4)
        c, rw = ColumnParallelLinear(64, 128, tp), RowParallelLinear(128, 64, tp)
        qkv = MergedColumnParallelLinear(64, {"q": (64, 16), "k": (32, 16), "v": (32, 16)}, tp)
        assert c.fp8_blocks_fit(block) and rw.fp8_blocks_fit(block) and not qkv.fp8_blocks_fit(block)
        c.load_full(col)
        rw.load_full(row)
        for name, w in zip("qkv", (q, k, v)):
            qkv.load_shard(name, w)
        assert c.is_fp8 and rw.is_fp8 and not qkv.is_fp8
        kv = r // 2 * 16
        want = torch.cat([q.dequantize(torch.float32)[r * 16:(r + 1) * 16]]
                         + [t.dequantize(torch.float32)[kv:kv + 16] for t in (k, v)])
        assert torch.equal(qkv.weight, want)
    assert not ColumnParallelLinear(64, 64, TPGroup(1, 4)).fp8_blocks_fit(block)  # 16 rows a rank


@pytest.mark.parametrize("block", [(16, 16), None])
def test_split_experts_keep_their_fp8_slice(block):
    """FusedMoE with an intermediate slice per rank (--ep-size 1): w13's gate and up rows (and their scale rows),
    w2's columns (their block columns, or all of its row scales), each dequantizing to the full expert's slice;
    32-row blocks on a 16-row slice: dequantized."""
    e, h, inter = 2, 32, 64
    pieces = {(j, p): _fp8((h, inter) if p == "down_proj" else (inter, h), block, 10 * j + len(p))
              for j in range(e) for p in ("gate_proj", "up_proj", "down_proj")}
    for r in range(2):
        moe = FusedMoE(e, h, inter, TPGroup(r, 2))
        for (j, p), w in pieces.items():
            assert moe.load_expert_fp8(j, p, w)
        assert moe.loaded_param_names() == {"w13", "w2"} and moe.fp8_block == block
        i = inter // 2
        w13, w2 = dequantize_experts(moe.w13, moe.w13_scale, block), dequantize_experts(moe.w2, moe.w2_scale, block)
        for j in range(e):
            full = {p: pieces[j, p].dequantize(torch.float32) for p in ("gate_proj", "up_proj", "down_proj")}
            assert torch.equal(w13[j], torch.cat([full["gate_proj"][r * i:(r + 1) * i],
                                                  full["up_proj"][r * i:(r + 1) * i]]))
            assert torch.equal(w2[j], full["down_proj"][:, r * i:(r + 1) * i])
    moe = FusedMoE(e, h, 32, TPGroup(1, 2))
    assert not moe.load_expert_fp8(0, "gate_proj", _fp8((32, h), (32, 16), 0)) and not moe.is_fp8


# ------------------------------------------------------------------ end to end: 2 ranks over gloo, one launch
PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [7, 7, 120], [200, 1, 64, 33, 90, 12, 5, 77, 18, 140, 2]]
STEPS = 3


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    """(a float Llama, its 16 x 16 block-scaled FP8 copy, a Qwen3-MoE's FP8 copy)."""
    from helpers import build_tiny_model

    root = tmp_path_factory.mktemp("fp8_tp")
    llama = build_tiny_model(str(root / "llama"), "llama", seed=21, num_hidden_layers=3)
    moe = build_tiny_model(str(root / "moe"), "qwen3_moe", seed=22)
    return llama, _fp8_copies(llama, str(root / "llama8"), (16, 16))[0], _fp8_copies(moe, str(root / "moe8"),
                                                                                     (16, 16))[0]


@pytest.mark.timeout(300)
def test_fp8_tp2_equals_one_rank(fp8_checkpoints, tmp_path):
    """At 2 ranks: the FP8 Llama (every linear layer FP8 on each rank) and the FP8 Qwen3-MoE with each expert's
    intermediate features split (its expert stacks FP8 too) give one rank's logits within summation-order noise
    (row-parallel partial sums; where such a difference moves an activation across an FP8 rounding boundary, one
    e4m3 step of one value). Online FP8 of the float Llama: a row-parallel layer's input and weight rows are
    quantised over this rank's columns only (layers/parallel.py), finer scales than one rank's, so its logits are
    not one rank's but as close to the float model's as one rank's are, and apart from one rank's by a fraction of
    FP8's own error."""
    llama, llama8, moe8 = fp8_checkpoints
    jobs = [(llama8, True, False), (moe8, False, False), (llama, True, True)]
    out = str(tmp_path / "fp8tp")
    mp.spawn(fp8_rank_main, args=(2, f"file://{tmp_path / 'rdzv'}", jobs, PROMPTS, STEPS, out), nprocs=2,
             join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    for j, (path, _, online) in enumerate(jobs):
        t = load_rank_model(path, TP1, online_fp8=online)
        want, want_fp8 = run_loaded(t, path, PROMPTS, STEPS), fp8_modules(t.model)
        assert want_fp8[0] > 0 and (want_fp8[1] > 0 or j != 1), want_fp8
        assert [rank[j][1] for rank in ranks] == [want_fp8] * 2, path  # the same layers FP8 on each rank
        got = ranks[0][j][0]
        assert len(got) == len(want)
        if not online:
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-3)
            continue
        exact = run_loaded(load_rank_model(path, TP1), path, PROMPTS, STEPS)  # the float model
        err_tp2 = max((g - f).abs().max().item() for g, f in zip(got, exact))
        err_tp1 = max((w - f).abs().max().item() for w, f in zip(want, exact))
        apart = max((g - w).abs().max().item() for g, w in zip(got, want))
        assert 0 < err_tp2 <= 1.5 * err_tp1 and apart <= 0.25 * err_tp1, (err_tp2, err_tp1, apart)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])
def test_fp8_checkpoint_rank_slices_load_as_the_dequantized_copy(tmp_path, family):
    """Each rank of 2 (loading needs no collective: built in this process) of an FP8 DeepSeek-V3 (MLA heads, its
    absorbed kv_b_proj dequantized, experts partitioned) and Qwen3-Next (de-interleaved fused projections, the
    gated shared expert fused into the split experts: --ep-size 1) holds FP8 layers whose values dequantize to the
    same rank's parameters of the checkpoint saved dequantized, bit for bit."""
    from deepseek_helpers import build_tiny_deepseek
    from hybrid_helpers import build_tiny_hybrid
    from test_fp8_checkpoint import plain_state

    from specserve.models.loader import ModelSource, load_target

    if family == "deepseek_v3":
        src = build_tiny_deepseek(str(tmp_path / "m"), seed=3)
    else:
        src = build_tiny_hybrid(str(tmp_path / "m"), "qwen3_next", seed=3)
    fp8_dir, ref_dir = _fp8_copies(src, str(tmp_path), (16, 16))
    for r in range(2):
        got, want = (load_target(ModelSource.resolve(d), torch.float32, torch.device("cpu"), 64, tp=TPGroup(r, 2),
                                 expert_parallel=family == "deepseek_v3").model for d in (fp8_dir, ref_dir))
        a_sd, b_sd = plain_state(got), want.state_dict()
        assert sorted(a_sd) == sorted(b_sd)
        for name, b in b_sd.items():
            assert torch.equal(a_sd[name], b), name
        linears, experts = fp8_modules(got)
        assert linears >= 4 and experts >= 1, (linears, experts)
