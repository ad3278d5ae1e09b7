"""The GDN gating and gated-RMSNorm Triton kernels (kernels/triton_gdn_gates.py) against their torch references, on
strided views of one projection output as the layer passes them; float32 and bfloat16. On CPU under the
interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from specserve.kernels import reference as ref  # noqa: E402
from specserve.kernels.triton_gdn_gates import gated_rms_norm_triton, gdn_gating_triton  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,heads", [(1, 32), (7, 4), (70, 6)])
def test_gating_matches_reference(dtype, t, heads):
    g = torch.Generator().manual_seed(t)
    proj = (4 * torch.randn(t, 3 * heads + 5, generator=g)).to(dtype).to(DEV)  # a, b inside a wider row
    a, b = proj[:, 5:5 + heads], proj[:, 5 + heads:5 + 2 * heads]
    a[0, 0] = 30.0  # softplus's linear branch
    a_log = torch.randn(heads, generator=g).to(dtype).to(DEV)
    dt = torch.randn(heads, generator=g).to(dtype).to(DEV)
    got, want = gdn_gating_triton(a, b, a_log, dt), ref.gdn_gating(a, b, a_log, dt)
    for x, y in zip(got, want):
        assert x.dtype == torch.float32
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,dim", [(1, 128), (9, 16), (130, 32)])
def test_gated_norm_matches_reference(dtype, n, dim):
    g = torch.Generator().manual_seed(n + dim)
    x = torch.randn(n, dim, generator=g).to(dtype).to(DEV)
    z = torch.randn(n, 2 * dim, generator=g).to(dtype).to(DEV)[:, dim:]  # a strided view, as the layer's gate
    w = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype).to(DEV)
    got, want = gated_rms_norm_triton(x, z, w, 1e-6), ref.gated_rms_norm(x, z, w, 1e-6)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: an ulp of the rounded normed row
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
