"""specserve/layers/moe.py against transformers' MoE blocks (Qwen3-MoE, DeepSeek-V3, Qwen2-MoE) on tiny random
weights in float32: routers on identical logits, and whole blocks with weights loaded through load_weight in the
checkpoint layout (per-expert tensors) and in transformers-5's fused in-memory layout."""

import pytest
import torch

from specserve.kernels.reference import grouped_sigmoid_topk
from specserve.layers.moe import FusedMoE, SparseMoEBlock, softmax_topk

pytestmark = pytest.mark.usefixtures("one_thread")

H, INTER, E, K = 64, 32, 8, 2
ATOL = 1e-5


def _randomize(module: torch.nn.Module, seed: int, bias_std: float = 0.0) -> None:
    """std 1/sqrt(fan_in) (the last dim of every weight, 3-D expert stacks included) so routing is decisive: HF's
    0.02 init gives logits within ~1e-3 of each other, where any summation-order difference could swap experts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in sorted(module.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * bias_std)


def _checkpoint(hf: torch.nn.Module, fused: bool) -> dict[str, torch.Tensor]:
    """The HF block's tensors under checkpoint names: per-expert gate/up/down (fused=False, the safetensors layout)
    or transformers-5's in-memory experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I] (fused=True)."""
    sd = {n: t.detach().clone() for n, t in hf.state_dict().items()}
    if fused:
        return sd
    gate_up, down = sd.pop("experts.gate_up_proj"), sd.pop("experts.down_proj")
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        sd[f"experts.{e}.gate_proj.weight"] = gate_up[e, :inter].clone()
        sd[f"experts.{e}.up_proj.weight"] = gate_up[e, inter:].clone()
        sd[f"experts.{e}.down_proj.weight"] = down[e].clone()
    return sd


def _load(block: SparseMoEBlock, sd: dict[str, torch.Tensor]) -> None:
    for name, t in sd.items():
        assert block.load_weight(name, t), name
    assert block.loaded_param_names() == {n for n, _ in block.named_parameters()}


def _x(t: int, seed: int) -> torch.Tensor:
    return torch.randn(t, H, generator=torch.Generator().manual_seed(seed))


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor):
    """HF's DeepSeek router uses topk(sorted=False): compare the chosen sets, order-free."""
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids_sorted


# ---- Qwen3-MoE: softmax router, no shared expert ----

def _qwen3(norm: bool, inter: int = INTER):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=inter, num_experts=E, num_experts_per_tok=K,
                         norm_topk_prob=norm)
    hf = Qwen3MoeSparseMoeBlock(cfg).eval()
    _randomize(hf, seed=11)
    return hf


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk_matches_qwen3_router(norm):
    hf = _qwen3(norm)
    x = _x(32, seed=1)
    with torch.no_grad():
        logits, hf_w, hf_ids = hf.gate(x)
    w, ids = softmax_topk(logits, K, norm)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (32, K)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w, atol=ATOL, rtol=0)
    if norm:
        torch.testing.assert_close(w.sum(-1), torch.ones(32), atol=ATOL, rtol=0)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("t", [1, 3, 32])
@pytest.mark.parametrize("inter", [INTER, 24])  # 24: 2I != H, so a transposed expert layout cannot pass by shape
def test_block_matches_qwen3_moe(norm, t, fused, inter):
    hf = _qwen3(norm, inter)
    block = SparseMoEBlock(H, inter, E, K, renormalize=norm, router="softmax")
    _load(block, _checkpoint(hf, fused))
    x = _x(t, seed=2)
    with torch.no_grad():
        ref = hf(x[None])[0]
        out = block(x)
    if t == 1:
        assert len(block.route(x)[1].unique()) < E  # most experts get no token
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_fused_and_per_expert_loading_agree():
    hf = _qwen3(True)
    a = SparseMoEBlock(H, INTER, E, K, renormalize=True)
    b = SparseMoEBlock(H, INTER, E, K, renormalize=True)
    _load(a, _checkpoint(hf, fused=False))
    _load(b, _checkpoint(hf, fused=True))
    assert torch.equal(a.experts.w13, b.experts.w13) and torch.equal(a.experts.w2, b.experts.w2)
    assert torch.equal(a.experts.w13, hf.experts.gate_up_proj) and torch.equal(a.experts.w2, hf.experts.down_proj)


# ---- DeepSeek-V3: grouped sigmoid router with correction bias, shared experts ----

def _deepseek(n_group: int = 4, topk_group: int = 2, top_k: int = K, n_shared: int = 1):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=INTER, n_routed_experts=E, n_group=n_group,
                           topk_group=topk_group, num_experts_per_tok=top_k, routed_scaling_factor=2.5,
                           norm_topk_prob=True, n_shared_experts=n_shared)
    hf = DeepseekV3MoE(cfg).eval()
    # Bias comparable to the spread of sigmoid scores, so it really moves choices (checked below).
    _randomize(hf, seed=21, bias_std=0.3)
    return hf


def _deepseek_block(n_shared: int = 1):
    return SparseMoEBlock(H, INTER, E, K, renormalize=True, router="grouped_sigmoid", n_group=4, topk_group=2,
                          routed_scaling_factor=2.5, shared_expert_intermediate_size=n_shared * INTER)


@pytest.mark.parametrize("n_group,topk_group,top_k", [(4, 2, 2), (2, 1, 3), (4, 3, 4), (1, 1, 2)])
def test_grouped_sigmoid_topk_matches_deepseek_router(n_group, topk_group, top_k):
    hf = _deepseek(n_group, topk_group, top_k)
    x = _x(64, seed=3)
    with torch.no_grad():
        logits, hf_w, hf_ids = hf.gate(x)
    bias = hf.gate.e_score_correction_bias
    w, ids = grouped_sigmoid_topk(logits, top_k, bias, n_group, topk_group, 2.5, True)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    w, ids = _sorted_by_id(w, ids)
    hf_w, hf_ids = _sorted_by_id(hf_w, hf_ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w, atol=ATOL, rtol=0)
    torch.testing.assert_close(w.sum(-1), torch.full((64,), 2.5), atol=ATOL, rtol=0)
    # The bias changes choices for some tokens, and weights come from the unbiased scores.
    _, ids_nobias = grouped_sigmoid_topk(logits, top_k, None, n_group, topk_group, 2.5, True)
    assert not torch.equal(ids_nobias.sort(-1).values, ids)
    torch.testing.assert_close(w, logits.sigmoid().gather(1, ids) / logits.sigmoid().gather(1, ids).sum(-1, True)
                               * 2.5, atol=ATOL, rtol=0)
    # Chosen experts lie in at most topk_group groups.
    groups = ids // (E // n_group)  # [T, top_k]
    distinct = (groups.unsqueeze(-1) == groups.unsqueeze(-2)).triu(1).any(-2).logical_not().sum(-1)  # [T]
    assert (distinct <= topk_group).all()


def test_grouped_sigmoid_no_renormalize():
    logits = torch.randn(16, E, generator=torch.Generator().manual_seed(4))
    w, ids = grouped_sigmoid_topk(logits, K, None, 1, 1, 2.0, False)
    ref_w, ref_ids = torch.topk(logits.sigmoid(), K, dim=-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w * 2.0, atol=ATOL, rtol=0)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("t", [1, 5, 32])
@pytest.mark.parametrize("n_shared", [1, 2])
def test_block_matches_deepseek_v3_moe(t, fused, n_shared):
    """n_shared 1: the shared expert as wide as a routed one runs as expert E of the grouped GEMM; 2: apart."""
    hf = _deepseek(n_shared=n_shared)
    block = _deepseek_block(n_shared)
    assert block.fused_shared == (n_shared == 1) and (block.shared_expert is None) == (n_shared == 1)
    _load(block, _checkpoint(hf, fused))
    assert torch.equal(block.e_score_correction_bias, hf.gate.e_score_correction_bias)
    x = _x(t, seed=5)
    with torch.no_grad():
        ref = hf(x[None])[0]
        out = block(x)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


# ---- Qwen2-MoE: softmax router, sigmoid-gated shared expert ----

@pytest.mark.parametrize("t", [1, 32])
def test_block_matches_qwen2_moe_gated_shared_expert(t):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=K,
                         shared_expert_intermediate_size=48, norm_topk_prob=False)
    hf = Qwen2MoeSparseMoeBlock(cfg).eval()
    _randomize(hf, seed=31)
    block = SparseMoEBlock(H, INTER, E, K, renormalize=False, shared_expert_intermediate_size=48,
                           shared_expert_gated=True)
    _load(block, _checkpoint(hf, fused=False))
    x = _x(t, seed=6)
    with torch.no_grad():
        ref = hf(x[None])[0]
        out = block(x)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


# ---- Qwen3-Next / Qwen3.5-MoE: the gated shared expert as wide as a routed one runs fused, as expert E ----

@pytest.mark.parametrize("fused_ckpt", [False, True])
@pytest.mark.parametrize("t", [1, 32])
def test_block_matches_qwen3_next_fused_shared_expert(t, fused_ckpt):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    cfg = Qwen3NextConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=K,
                          shared_expert_intermediate_size=INTER, norm_topk_prob=True)
    hf = Qwen3NextSparseMoeBlock(cfg).eval()
    _randomize(hf, seed=37)
    block = SparseMoEBlock(H, INTER, E, K, renormalize=True, shared_expert_intermediate_size=INTER,
                           shared_expert_gated=True)
    assert block.fused_shared and block.shared_expert is None and block.experts.w13.shape[0] == E + 1
    sd = _checkpoint(hf, fused=fused_ckpt)
    _load(block, sd)
    x = _x(t, seed=8)
    with torch.no_grad():
        ref = hf(x[None])[0]
        out = block(x)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    # the gate row and the expert are pieces of shared parameters: each missing piece is reported
    partial = SparseMoEBlock(H, INTER, E, K, renormalize=True, shared_expert_intermediate_size=INTER,
                             shared_expert_gated=True)
    for name, tensor in sd.items():
        if name not in ("shared_expert_gate.weight", "shared_expert.down_proj.weight"):
            assert partial.load_weight(name, tensor)
    missing = {n for n, _ in partial.named_parameters()} - partial.loaded_param_names()
    assert missing == {"gate.weight", "experts.w2"}
    with pytest.raises(ValueError, match="outside"):
        partial.load_weight(f"experts.{E}.up_proj.weight", torch.zeros(INTER, H))


# ---- loading bookkeeping and errors ----

def test_all_loaded_tracking_and_unknown_names():
    hf = _deepseek()
    sd = _checkpoint(hf, fused=False)
    block = _deepseek_block()
    for name, t in sd.items():
        if name not in ("experts.5.up_proj.weight", "shared_experts.gate_proj.weight"):
            assert block.load_weight(name, t)
    missing = {n for n, _ in block.named_parameters()} - block.loaded_param_names()
    assert block.fused_shared and missing == {"experts.w13"}  # the shared expert is expert E of w13
    only_shared = _deepseek_block()  # only the fused shared expert's gate_proj missing: w13 still incomplete
    for name, t in sd.items():
        if name != "shared_experts.gate_proj.weight":
            assert only_shared.load_weight(name, t)
    assert {n for n, _ in only_shared.named_parameters()} - only_shared.loaded_param_names() == {"experts.w13"}
    assert only_shared.load_weight("shared_experts.gate_proj.weight", sd["shared_experts.gate_proj.weight"])
    assert {n for n, _ in only_shared.named_parameters()} == only_shared.loaded_param_names()
    assert not block.load_weight("shared_expert_gate.weight", torch.zeros(1, H))  # no gated shared expert here
    assert not block.load_weight("experts.0.gate_proj.weight_scale_inv", torch.zeros(1))
    assert not block.load_weight("gate.bias", torch.zeros(E))
    qwen = SparseMoEBlock(H, INTER, E, K, renormalize=True)
    assert not qwen.load_weight("gate.e_score_correction_bias", torch.zeros(E))
    assert not qwen.load_weight("shared_expert.gate_proj.weight", torch.zeros(INTER, H))


def test_load_errors():
    experts = FusedMoE(E, H, INTER)
    with pytest.raises(ValueError, match="expected shape"):
        experts.load_expert(0, "gate_proj", torch.zeros(H, INTER))  # transposed
    with pytest.raises(ValueError, match="expected shape"):
        experts.load_expert(0, "down_proj", torch.zeros(INTER, H))
    with pytest.raises(ValueError, match="outside"):
        experts.load_expert(E, "up_proj", torch.zeros(INTER, H))
    with pytest.raises(ValueError, match="unknown expert projection"):
        experts.load_expert(0, "w1", torch.zeros(INTER, H))
    with pytest.raises(ValueError, match="expected shape"):
        FusedMoE(E, H, 24).load_fused("gate_up_proj", torch.zeros(E, H, 48))  # [E, H, 2I]: transposed
    with pytest.raises(ValueError, match="unknown fused"):
        experts.load_fused("w13", torch.zeros(E, 2 * INTER, H))
    with pytest.raises(ValueError, match="expected shape"):
        SparseMoEBlock(H, INTER, E, K, renormalize=True).load_weight("gate.weight", torch.zeros(E + 1, H))
    with pytest.raises(ValueError, match="groups"):
        SparseMoEBlock(H, INTER, E, K, renormalize=True, router="grouped_sigmoid", n_group=3, topk_group=2)
    with pytest.raises(ValueError, match="unknown router"):
        SparseMoEBlock(H, INTER, E, K, renormalize=True, router="sinkhorn")


def test_load_casts_float32_source_into_bfloat16_params():
    experts = FusedMoE(E, H, INTER).to(torch.bfloat16)
    src = torch.randn(INTER, H, generator=torch.Generator().manual_seed(7))
    experts.load_expert(2, "up_proj", src)
    assert experts.w13.dtype == torch.bfloat16
    assert torch.equal(experts.w13[2, INTER:], src.to(torch.bfloat16))
    assert experts.loaded_param_names() == set()
