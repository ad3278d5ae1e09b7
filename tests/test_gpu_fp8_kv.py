"""The FP8 KV cache's kernels on a GPU (skipped elsewhere; CI runs them under the interpreter in
tests/test_fp8_kv_cache.py): the hardware casts must store what the torch reference stores, and the attention over
an FP8 cache must equal the same kernel over a cache of the dequantized rows (the read adds nothing but the
dequantization).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

from specserve.kernels import reference as ref  # noqa: E402
from specserve.kernels.reference_kv_fp8 import dequantize_kv, quantize_kv  # noqa: E402
from specserve.kernels.triton_attention import fixed_width_attention, varlen_attention  # noqa: E402
from specserve.kernels.triton_kv import store_kv  # noqa: E402
from specserve.kernels.triton_qk_prep import qk_norm_rope_store_triton  # noqa: E402

DEV = torch.device("cuda")
FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def _rows(shape, g, dtype):
    return (torch.randn(shape, generator=g) * 2.0 ** torch.randint(-4, 4, shape[:-1] + (1,), generator=g)).to(
        dtype).to(DEV)


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_stores_equal_reference(fp8, dtype):
    g = torch.Generator().manual_seed(0)
    t, hq, h, d, s = 64, 32, 8, 128, 512
    q, k, v = _rows((t, hq, d), g, dtype), _rows((t, h, d), g, dtype), _rows((t, h, d), g, dtype)
    loc = (torch.randperm(s - 1, generator=g)[:t] + 1).to(DEV)
    c = [torch.zeros(s, h, d, dtype=fp8, device=DEV) for _ in range(4)]
    sc = [torch.ones(s, h, device=DEV) for _ in range(4)]
    store_kv(c[0], c[1], loc, k, v, sc[0], sc[1])
    ref.store_kv(c[2], c[3], loc, k, v, sc[2], sc[3])
    for i in (0, 1):
        assert torch.equal(c[i].view(torch.uint8), c[i + 2].view(torch.uint8)) and torch.equal(sc[i], sc[i + 2])
    # the prep kernel (rotary; no norms): the rotation may contract to FMAs on the GPU, one code step at most
    cs, pos = torch.randn(600, d, generator=g).to(DEV), torch.randint(0, 600, (t,), generator=g).to(DEV)
    for x in c + sc:
        x.zero_()
    qk_norm_rope_store_triton(q.clone(), k.clone(), v, c[0], c[1], loc, cs, pos, None, k_scale=sc[0], v_scale=sc[1])
    ref.qk_norm_rope_store(q.clone(), k.clone(), v, c[2], c[3], loc, cs, pos, None, k_scale=sc[2], v_scale=sc[3])
    assert torch.equal(c[1].view(torch.uint8), c[3].view(torch.uint8)) and torch.equal(sc[1], sc[3])
    steps = (c[0].view(torch.uint8).int() - c[2].view(torch.uint8).int()).abs()
    assert steps.max() <= 1
    torch.testing.assert_close(sc[0], sc[2], rtol=1e-6, atol=0)


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_equals_dequantized_cache(fp8, dtype):
    g = torch.Generator().manual_seed(1)
    h, d, bs, length = 8, 128, 4, 700
    kc, ks = quantize_kv(torch.randn(4096, h, d, generator=g), fp8)
    vc, vs = quantize_kv(torch.randn(4096, h, d, generator=g), fp8)
    kc, ks, vc, vs = (x.to(DEV) for x in (kc, ks, vc, vs))
    kd, vd = dequantize_kv(kc, ks, dtype), dequantize_kv(vc, vs, dtype)
    table = (torch.randperm(4095, generator=g)[:bs * 1000].view(bs, 1000) + 1).to(DEV)  # distinct slots, 1..4095
    rows, lens = torch.arange(bs, device=DEV), torch.full((bs,), length, device=DEV)
    for width, splits in ((1, 8), (4, 8), (1, 1)):
        q = torch.randn(bs * width, 32, d, generator=g).to(dtype).to(DEV)
        got = fixed_width_attention(q, kc, vc, table, rows, lens, width, splits, d ** -0.5, k_scale=ks, v_scale=vs)
        assert torch.equal(got, fixed_width_attention(q, kd, vd, table, rows, lens, width, splits, d ** -0.5))
    q = torch.randn(100, 32, d, generator=g).to(dtype).to(DEV)
    args = (table[:1], rows[:1], lens[:1], torch.zeros(1, dtype=torch.int64, device=DEV),
            torch.full((1,), 100, device=DEV), 100, d ** -0.5)
    got = varlen_attention(q, kc, vc, *args, k_scale=ks, v_scale=vs)
    assert torch.equal(got, varlen_attention(q, kd, vd, *args))
