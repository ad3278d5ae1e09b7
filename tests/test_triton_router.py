"""The softmax router kernel (kernels/triton_router.py) against its torch reference: several expert counts and
top-k, with and without renormalisation, equal weights (the lower id first); on a GPU, captured in a CUDA graph with
the fused-MoE kernel and replayed with new inputs. On CPU under Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py does the same)
pytest.importorskip("triton")

from specserve.kernels import reference as ref  # noqa: E402
from specserve.kernels.triton_router import softmax_topk_triton  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E, K, H, INTER = 8, 2, 64, 40


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (128, 8), (60, 4), (512, 10)])
def test_router_kernel_matches_reference(experts, top_k, renormalize):
    g = torch.Generator().manual_seed(experts + top_k)
    logits = torch.randn(6, experts, generator=g)
    logits[0] = -1.0
    logits[0, :5] = 2.0  # equal weights: the lower expert id first, in both
    logits[1] = 0.0  # all equal
    w, ids = softmax_topk_triton(logits.to(DEV), top_k, renormalize)
    rw, rids = ref.softmax_topk(logits, top_k, renormalize)
    assert torch.equal(ids.cpu(), rids)
    assert ids[0].tolist()[:min(top_k, 5)] == list(range(min(top_k, 5)))
    torch.testing.assert_close(w.cpu(), rw, atol=1e-6, rtol=1e-5)
    if renormalize:
        torch.testing.assert_close(w.sum(-1).cpu(), torch.ones(6), atol=1e-5, rtol=0)


@pytest.mark.parametrize("experts,top_k", [(8, 2), (512, 10)])
def test_router_kernel_with_fused_shared_expert_gate(experts, top_k):
    """The last logit column gates the shared expert: routed as expert E after the K routed ones, weight sigmoid."""
    g = torch.Generator().manual_seed(experts)
    logits = torch.randn(5, experts + 1, generator=g)
    w, ids = softmax_topk_triton(logits.to(DEV), top_k, True, shared_gate=True)
    rw, rids = ref.softmax_topk(logits, top_k, True, shared_gate=True)
    assert ids.shape == (5, top_k + 1) and torch.equal(ids.cpu(), rids)
    assert torch.all(ids[:, -1] == experts) and torch.all(ids[:, :-1] < experts)
    torch.testing.assert_close(w.cpu(), rw, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w[:, -1].cpu(), logits[:, -1].sigmoid(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w[:, :-1].sum(-1).cpu(), torch.ones(5), atol=1e-5, rtol=0)  # routed: renormalised


@pytest.mark.gpu
def test_decode_kernels_in_a_cuda_graph():
    from specserve.kernels.triton_moe import fused_moe

    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * INTER, H, generator=g) / H ** 0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(E, H, INTER, generator=g) / INTER ** 0.5).to(torch.bfloat16).cuda()
    x = torch.randn(4, H, generator=g).to(torch.bfloat16).cuda()
    logits = torch.randn(4, E, generator=g).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            wts, ids = softmax_topk_triton(logits, K, True)
            fused_moe(x, w13, w2, wts, ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wts, ids = softmax_topk_triton(logits, K, True)
        out = fused_moe(x, w13, w2, wts, ids)
    for seed in range(3):
        gg = torch.Generator().manual_seed(100 + seed)
        x.copy_(torch.randn(4, H, generator=gg).to(torch.bfloat16))
        logits.copy_(torch.randn(4, E, generator=gg))
        graph.replay()
        rw, rids = ref.softmax_topk(logits, K, True)
        assert torch.equal(ids, rids)
        want = ref.fused_moe(x, w13, w2, rw, rids).float()
        torch.testing.assert_close(out.float(), want, atol=2e-2 * want.abs().max().item(), rtol=0)
