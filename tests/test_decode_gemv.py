"""--decode-gemv's layer wiring (models/decoder_layer.py PreNormDecoderLayer.set_decode_gemv): with the fused path on,
decode rows go norm + the mixer's input projection -> the mixer -> its output-projection GEMV -> norm + gate/up +
SiLU-mul -> down-proj GEMV (an MoE block with a softmax router: the norm inside the router's launch) and give the
same greedy tokens as the unfused layers, plain and speculative, for Llama, Qwen2 (qkv bias), Qwen3 (q/k norms,
MTP), Qwen3-MoE, the hybrid family (Qwen3-Next: gated delta net and gated attention layers, zero-centred norms,
MoE; Qwen3.5: dense MLP) and DeepSeek-V3 (MLA layers: only their dense MLPs). On CPU the fused ops run their
references (kernels/ops.py norm_gemv, gemv, norm_router_softmax_topk); the Triton kernels themselves are checked
against them in tests/test_triton_gemv.py and tests/test_triton_router.py, and the model runner turns the path on
only on a GPU."""

from __future__ import annotations

import pytest
import torch
from deepseek_helpers import build_tiny_deepseek
from hybrid_helpers import build_tiny_hybrid
from spec_fixtures import build_scheduler, run_greedy

from specserve.kernels import ops
from specserve.models.decoder_layer import PreNormDecoderLayer, gated_mlp_projections, norm_linear, set_decode_gemv
from specserve.models.dense import DenseDecoderLayer

KW = dict(max_total_tokens=2048, max_running_requests=4, cuda_graph_bs=[1, 2, 4], context_length=256)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in (7, 1, 12)]


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    """The hybrid family and DeepSeek-V3 (MLA layers: only their dense MLPs fuse)."""
    root = tmp_path_factory.mktemp("hybrid_gemv")
    out = {kind: build_tiny_hybrid(str(root / kind), kind, seed=5, mtp=True) for kind in ("qwen3_next", "qwen3_5")}
    out["deepseek"] = build_tiny_deepseek(str(root / "deepseek"), seed=3)
    return out


@pytest.mark.parametrize("name,spec", [("llama", False), ("qwen2", False), ("llama_mtp", True), ("qwen3_mtp", True),
                                       ("qwen3_moe", False), ("qwen3_next", False), ("qwen3_next", True),
                                       ("qwen3_5", False), ("deepseek", False)])
def test_fused_decode_layers_give_the_unfused_tokens(tiny_models, hybrids, name, spec):
    path = hybrids[name] if name in hybrids else tiny_models[name]
    kw = dict(KW, **(dict(speculative_algorithm="MTP", speculative_num_steps=3) if spec else {}))
    prompts = _prompts()[:1] if spec else _prompts()  # one request: its N + 1 = 4 verify rows are decode rows
    want_sched, _ = build_scheduler(path, **kw)
    want = [r.output_ids for r in run_greedy(want_sched, prompts, 10)]
    sched, t = build_scheduler(path, **kw)
    layers = [m for m in t.model.modules() if isinstance(m, PreNormDecoderLayer)]
    fused = set_decode_gemv(t.model, "triton")
    if spec:
        assert set_decode_gemv(sched.model_runner.draft, "triton") >= 1  # the MTP block's layer
    dense_mlps = mixers = moe_norms = preps = 0
    for layer in layers:
        projs = layer.mixer_projections()
        assert layer.fused_in == (projs is not None) and (projs is None or projs[1].decode_gemv)
        # the q/k prep inside the qkv GEMV: dense attention layers (with q/k norms or not), full rotary
        assert layer.fused_prep == (isinstance(layer, DenseDecoderLayer) and layer.fused_in)
        preps += layer.fused_prep
        mixers += projs is not None
        gate_up, down = gated_mlp_projections(layer.mlp)
        assert (gate_up is None) == hasattr(layer.mlp, "experts")  # MoE blocks keep their expert kernels
        assert layer.fused_mlp == (gate_up is not None) and (gate_up is None or down.decode_gemv)
        # softmax routers take the post-attention norm into their launch (DeepSeek's grouped sigmoid does not)
        assert layer.fused_moe == (gate_up is None and layer.mlp.router == "softmax")
        dense_mlps += gate_up is not None
        moe_norms += layer.fused_moe
    assert fused == sum(1 for m in layers if m.fused_in or m.fused_mlp or m.fused_moe) > 0
    assert moe_norms > 0 or name not in ("qwen3_moe", "qwen3_next")
    assert (preps > 0) == (name not in ("qwen3_next", "qwen3_5", "deepseek"))  # hybrid and MLA attention: no
    assert (mixers > 0) == (name != "deepseek") and dense_mlps > 0  # each tiny MoE model has a dense layer
    got = [r.output_ids for r in run_greedy(sched, prompts, 10)]
    assert got == want


def test_fused_mlp_half_equals_unfused(tiny_models):
    """One layer's post-attention half, directly, for 1 and 4 rows: norm + gate/up + SiLU-mul in one op, then the
    down-proj GEMV == the layer's unfused norm and MLP (float32 tolerance: oneDNN's and F.linear's sums differ in
    order), with the new residual exactly x + residual; the first layer's case (no residual) returns x itself."""
    _, t = build_scheduler(tiny_models["qwen2"], **KW)
    layer = next(m for m in t.model.modules() if isinstance(m, DenseDecoderLayer))
    norm, mlp = layer.post_attention_layernorm, layer.mlp
    g = torch.Generator().manual_seed(0)
    hidden = norm.weight.shape[0]
    for rows in (1, 4):
        h, residual = torch.randn((rows, hidden), generator=g), torch.randn((rows, hidden), generator=g)
        want_x, want_r = norm(h, residual)
        act, r = norm_linear(norm, mlp.gate_up_proj, h, residual, silu_mul=True)
        assert torch.equal(r, want_r)
        set_decode_gemv(layer, "triton")
        try:
            y = mlp.down_proj(act)  # the GEMV path of Linear
        finally:
            set_decode_gemv(layer, "cublas")
        torch.testing.assert_close(y, mlp(want_x), atol=1e-5, rtol=1e-5)
        qkv, r0 = norm_linear(layer.input_layernorm, layer.self_attn.qkv_proj, h, None)
        assert r0 is h
        torch.testing.assert_close(qkv, layer.self_attn.qkv_proj(layer.input_layernorm(h)), atol=1e-5, rtol=1e-5)


def test_auto_fuses_only_measured_shapes_and_cublas_nothing(tiny_models):
    from specserve.kernels.gemv_policy import FASTER, prefer_fused

    _, t = build_scheduler(tiny_models["llama"], **KW)
    assert set_decode_gemv(t.model, "cublas") == 0
    assert set_decode_gemv(t.model, "auto") == 0  # the tiny model's shapes were never measured
    assert prefer_fused(sorted(FASTER)) and not prefer_fused([]) and not prefer_fused([next(iter(FASTER)), (7, 3)])
    layers = [m for m in t.model.modules() if isinstance(m, PreNormDecoderLayer)]
    assert layers and all(m.fused_rows == 1 for m in layers)  # 'auto' was measured at one row: verify stays cuBLAS
    set_decode_gemv(t.model, "triton")
    assert all(m.fused_rows == ops.GEMV_MAX_ROWS for m in layers)
    set_decode_gemv(t.model, "cublas")
    assert all(m.fused_rows == 0 for m in layers)
    assert not any(getattr(m, "decode_gemv", False) or getattr(m, "fused_in", False)
                   or getattr(m, "fused_mlp", False) for m in t.model.modules())


def test_auto_fuses_verify_rows_per_measured_shape(tmp_path):
    """On SmolLM2-135M's shapes (gemv_policy.FASTER_ROWS) 'auto' fuses more than one row: each output projection up
    to its own measured row count, the norms fused into qkv / gate_up up to the least of the two; the q/k prep goes
    into the qkv GEMV's epilogue (gemv_policy.FASTER_PREP)."""
    from helpers import build_tiny_model

    from specserve.kernels.gemv_policy import FASTER_NORM_PREP, FASTER_ROWS
    from specserve.models.loader import ModelSource, load_target

    path = build_tiny_model(str(tmp_path / "smol"), hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                            num_key_value_heads=3, num_hidden_layers=1, head_dim=64)
    model = load_target(ModelSource.resolve(path), torch.float32, torch.device("cpu"), 64).model
    assert set_decode_gemv(model, "auto") == 1
    layer = next(m for m in model.modules() if isinstance(m, PreNormDecoderLayer))
    o, down = layer.self_attn.o_proj, layer.mlp.down_proj
    assert (o.decode_gemv, down.decode_gemv) == (FASTER_ROWS[(576, 576)], FASTER_ROWS[(576, 1536)])
    assert layer.fused_in and layer.fused_mlp and layer.fused_rows == min(FASTER_ROWS[(960, 576)],
                                                                          FASTER_ROWS[(3072, 576)])
    assert layer.fused_prep  # SmolLM2's qkv shape is in FASTER_PREP: the q/k prep rides in its epilogue
    layer.self_attn.qk_norm = True  # with q/k norms the same shape needs FASTER_NORM_PREP (a different epilogue)
    set_decode_gemv(model, "auto")
    assert layer.fused_prep == ((960, 576) in FASTER_NORM_PREP) and layer.fused_in
    set_decode_gemv(model, "cublas")
    assert o.decode_gemv == down.decode_gemv == layer.fused_rows == 0
