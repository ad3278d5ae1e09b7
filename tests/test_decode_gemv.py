"""--decode-gemv's layer wiring (models/dense.py DenseDecoderLayer.set_decode_gemv): with the fused path on, decode
rows go norm + qkv -> attention -> o-proj GEMV -> norm + gate/up + SiLU-mul -> down-proj GEMV (an MoE MLP keeps its
own kernels) and give the same greedy tokens as the unfused layers, plain and speculative, for Llama, Qwen2 (qkv
bias), Qwen3 (q/k norms, MTP) and Qwen3-MoE. On CPU the fused ops run their references (kernels/ops.py norm_gemv,
gemv); the Triton kernels themselves are checked against them in tests/test_triton_gemv.py, and the model runner
turns the path on only on a GPU."""

from __future__ import annotations

import pytest
import torch
from spec_fixtures import build_scheduler, run_greedy

from specserve.models.dense import DenseDecoderLayer, _norm_linear, set_decode_gemv

KW = dict(max_total_tokens=2048, max_running_requests=4, cuda_graph_bs=[1, 2, 4], context_length=256)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in (7, 1, 12)]


@pytest.mark.parametrize("name,spec", [("llama", False), ("qwen2", False), ("qwen3_mtp", True),
                                       ("qwen3_moe", False)])
def test_fused_decode_layers_give_the_unfused_tokens(tiny_models, name, spec):
    kw = dict(KW, **(dict(speculative_algorithm="MTP", speculative_num_steps=3) if spec else {}))
    want_sched, _ = build_scheduler(tiny_models[name], **kw)
    want = [r.output_ids for r in run_greedy(want_sched, _prompts(), 10)]
    sched, t = build_scheduler(tiny_models[name], **kw)
    layers = [m for m in t.model.modules() if isinstance(m, DenseDecoderLayer)]
    assert set_decode_gemv(t.model, "triton") == len(layers) > 0
    if spec:
        assert set_decode_gemv(sched.mr.draft, "triton") >= 1  # the MTP block's layer
    moe = name == "qwen3_moe"
    for layer in layers:
        assert layer.fused_decode and layer.self_attn.o_proj.decode_gemv
        dense_mlp = type(layer.mlp).__name__ == "DenseMLP"
        assert dense_mlp or moe
        assert not dense_mlp or layer.mlp.down_proj.decode_gemv
    got = [r.output_ids for r in run_greedy(sched, _prompts(), 10)]
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
        act, r = _norm_linear(norm, mlp.gate_up_proj, h, residual, silu_mul=True)
        assert torch.equal(r, want_r)
        set_decode_gemv(layer, "triton")
        try:
            y = mlp.down_proj(act)  # the GEMV path of Linear
        finally:
            set_decode_gemv(layer, "cublas")
        torch.testing.assert_close(y, mlp(want_x), atol=1e-5, rtol=1e-5)
        qkv, r0 = _norm_linear(layer.input_layernorm, layer.self_attn.qkv_proj, h, None)
        assert r0 is h
        torch.testing.assert_close(qkv, layer.self_attn.qkv_proj(layer.input_layernorm(h)), atol=1e-5, rtol=1e-5)


def test_auto_and_cublas_fuse_nothing_until_measured(tiny_models):
    _, t = build_scheduler(tiny_models["llama"], **KW)
    assert set_decode_gemv(t.model, "cublas") == 0
    assert set_decode_gemv(t.model, "auto") == 0  # kernels/gemv_policy.py lists no measured shape yet
    assert not any(getattr(m, "decode_gemv", False) for m in t.model.modules())
