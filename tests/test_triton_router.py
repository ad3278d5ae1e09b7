"""The softmax router kernels (kernels/triton_router.py) against their torch reference: several expert counts and
top-k, with and without renormalisation, equal weights (the lower id first); the one-launch router GEMV + top-k
against F.linear in x's dtype + the reference, called repeatedly (its arrival counter resets itself), and the ops
dispatch to it; on a GPU, captured in a CUDA graph (with the fused-MoE kernel) and replayed with new inputs. On CPU
under Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py does the same)
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from specserve.kernels import ops, triton_router  # noqa: E402
from specserve.kernels import reference as ref  # noqa: E402
from specserve.kernels.triton_router import router_topk_triton, softmax_topk_triton  # noqa: E402

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


# ---- the router GEMV and the routing in one launch ----

HID = 80  # not a power of two: the K chunks' masks


def exact_inputs(tokens: int, cols: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, HID], w [cols, HID] of multiples of 1/8 in [-1/2, 1/2]: every partial sum of a logit is exact in float32,
    so F.linear and the kernel get the same float32 logit in any order of accumulation, and the same value once
    rounded to bfloat16. Many logits are equal (exercising ties), none near-tied."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (tokens, HID), generator=g) / 8
    w = torch.randint(-4, 5, (cols, HID), generator=g) / 8
    return x.to(dtype).to(DEV), w.to(dtype).to(DEV)


def fused_reference(x, w, top_k, renormalize, shared_gate):
    return ref.softmax_topk(F.linear(x, w).float().cpu(), top_k, renormalize, shared_gate)


def interpreter_config(x, w, shared_gate):
    """On CPU, where the interpreter runs programs one by one, fewer and larger ones than the GPU's defaults
    (which the GPU run of these tests checks) once the default grid exceeds 64 programs."""
    t, cols = x.shape[0], w.shape[0]
    cfg = triton_router.router_config(t, cols, HID, cols - int(shared_gate))
    if DEV.type == "cuda" or triton.cdiv(cols, cfg["BLOCK_E"]) * triton.cdiv(t, cfg["T_BLOCK"]) <= 64:
        return None
    return triton_router.router_config(t, cols, HID, cols - int(shared_gate),
                                       block_e=triton.next_power_of_2(max(1, cols // 16)),
                                       t_block=min(16, triton.next_power_of_2(t)))


def check_fused(x, w, top_k, renormalize, shared_gate, config=None):
    config = config or interpreter_config(x, w, shared_gate)
    got_w, got_ids = router_topk_triton(x, w, top_k, renormalize, shared_gate, config=config)
    want_w, want_ids = fused_reference(x, w, top_k, renormalize, shared_gate)
    assert got_ids.shape == want_ids.shape == (x.shape[0], top_k + int(shared_gate))
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int64
    assert torch.equal(got_ids.cpu(), want_ids)
    torch.testing.assert_close(got_w.cpu(), want_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("experts,top_k,shared_gate", [(8, 2, False), (8, 2, True), (128, 8, False), (60, 4, False),
                                                       (512, 10, True)])
def test_fused_router_matches_linear_then_reference(experts, top_k, shared_gate, tokens, dtype):
    x, w = exact_inputs(tokens, experts + int(shared_gate), dtype, seed=experts * 100 + tokens)
    for renormalize in (True, False):
        check_fused(x, w, top_k, renormalize, shared_gate)


def test_fused_router_rounds_logits_to_bfloat16():
    """Logits that need more bits than bfloat16 has: the kernel's are rounded to nearest even, as F.linear's bf16
    output (unrounded float32 logits give other weights)."""
    x = torch.zeros(2, HID, dtype=torch.bfloat16, device=DEV)
    x[:, 0] = 1.0
    x[:, 1] = 2.0 ** -8
    w = torch.zeros(6, HID, dtype=torch.bfloat16, device=DEV)
    w[:, 0] = torch.tensor([1.0, 1.0, 1.5, 0.5, 0.25, 1.0])
    w[:, 1] = torch.tensor([1.0, 3.0, 0.0, 0.0, 0.0, -1.0])  # logits 1 + 2^-8 (a tie: to even 1), 1 + 3*2^-8, ...
    check_fused(x, w, 4, False, False)
    got, _ = router_topk_triton(x, w, 4, False)
    unrounded = ref.softmax_topk(F.linear(x.float(), w.float()).cpu(), 4, False)[0]
    assert (got.cpu() - unrounded).abs().max() > 1e-4


@pytest.mark.parametrize("change", [dict(BLOCK_K=32), dict(BLOCK_E=2, T_BLOCK=4, R_BLOCK=2),
                                    dict(BLOCK_E=64, T_BLOCK=8, R_BLOCK=8)])
def test_fused_router_tiles(change):
    """Several K chunks (the last partial), token blocks (the last partial) routed in row blocks, one program of all
    columns: other launch configurations than the small tests' defaults."""
    x, w = exact_inputs(5, 61, torch.float32, seed=7)
    check_fused(x, w, 4, True, True, config=dict(triton_router.router_config(5, 61, HID, 60), **change))


def test_fused_router_equal_logits_lower_id_first():
    """float32 weight rows built to give exactly equal logits: the lower expert id first."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, HID, generator=g) * 0.1
    w[[3, 9, 17, 30]] = torch.linspace(0.5, 1.0, HID)  # the four largest logits of every row, all equal
    x = torch.rand(4, HID, generator=g) + 0.5  # positive: the shared row wins
    x, w = x.to(DEV), w.to(DEV)
    for renormalize in (True, False):
        weights, ids = router_topk_triton(x, w, 6, renormalize)
        assert ids[:, :4].tolist() == [[3, 9, 17, 30]] * 4
        assert torch.equal(weights[:, 0], weights[:, 3])
        check_fused(x, w, 6, renormalize, False)
    weights, ids = router_topk_triton(x, torch.ones(16, HID, device=DEV), 5, True)  # all equal
    assert ids.tolist() == [list(range(5))] * 4
    torch.testing.assert_close(weights.cpu(), torch.full((4, 5), 0.2), atol=1e-6, rtol=0)


def test_fused_router_repeated_calls_reset_the_counter():
    """The last program resets the device's arrival counter: back-to-back calls (other shapes too) stay right."""
    for i, (tokens, experts, top_k, shared) in enumerate([(3, 128, 8, False), (3, 128, 8, False), (1, 512, 10, True),
                                                          (16, 8, 2, False)]):
        x, w = exact_inputs(tokens, experts + int(shared), torch.bfloat16, seed=50 + i)
        check_fused(x, w, top_k, True, shared)
        assert not triton_router._counters(x.device).any()


def test_fused_router_many_tokens_and_none(monkeypatch):
    x, w = exact_inputs(40, 8, torch.float32, seed=9)  # 4 token blocks of 16, the last partial
    check_fused(x, w, 2, True, False)
    monkeypatch.setattr(triton_router, "ROUTER_MAX_TOKEN_BLOCKS", 2)  # more blocks than counters: the GEMM path
    check_fused(x, w, 2, True, False)
    weights, ids = router_topk_triton(x[:0], w, 2, True)
    assert weights.shape == ids.shape == (0, 2)
    with pytest.raises(ValueError, match="does not fit"):
        router_topk_triton(x, w.to(torch.bfloat16), 2, True)


def test_router_dispatch_on_cpu_is_linear_then_softmax_topk(monkeypatch):
    """ops.router_softmax_topk on CPU: F.linear then the reference router; SparseMoEBlock.route on CPU keeps the
    gate's own forward (prepacked oneDNN for float32) then ops.softmax_topk, bit for bit."""
    from specserve.layers.moe import SparseMoEBlock

    x, w = exact_inputs(3, 33, torch.float32, seed=11)
    x, w = x.cpu() + 0.01, w.cpu()
    got = ops.router_softmax_topk(x, w, 4, True, True)
    want = ref.softmax_topk(F.linear(x, w), 4, True, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    block = SparseMoEBlock(HID, 16, 32, 4, renormalize=True, router="softmax", shared_expert_intermediate_size=16,
                           shared_expert_gated=True)
    with torch.no_grad():
        block.gate.weight.copy_(w)
    monkeypatch.setattr(ops, "router_softmax_topk", lambda *a: pytest.fail("fused router on CPU"))
    got = block.route(x)
    want = ops.softmax_topk(block.gate(x), 4, True, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
def test_fused_router_dispatch_and_cuda_graph(monkeypatch):
    """On CUDA: ops.router_softmax_topk takes the fused kernel up to ROUTER_FUSED_MAX_TOKENS tokens, cuBLAS + the
    router kernel above; the fused kernel replays in a CUDA graph (its counter reset every replay) with new inputs."""
    from specserve.graphs.capture import capture_graph

    tk = ops.triton_kernels()
    calls = []
    real = tk.router_topk_triton
    monkeypatch.setattr(tk, "router_topk_triton", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for tokens in (1, ops.ROUTER_FUSED_MAX_TOKENS, ops.ROUTER_FUSED_MAX_TOKENS + 1):
        x, w = exact_inputs(tokens, 513, torch.bfloat16, seed=tokens)
        got_w, got_ids = ops.router_softmax_topk(x, w, 10, True, True)
        want_w, want_ids = fused_reference(x, w, 10, True, True)
        assert torch.equal(got_ids.cpu(), want_ids)
        torch.testing.assert_close(got_w.cpu(), want_w, atol=1e-6, rtol=1e-5)
    assert calls == [1, ops.ROUTER_FUSED_MAX_TOKENS]

    x, w = exact_inputs(4, 128, torch.bfloat16, seed=0)
    graph, (wts, ids), _ = capture_graph(lambda: router_topk_triton(x, w, 8, True), None)
    for seed in range(3):
        nx, nw = exact_inputs(4, 128, torch.bfloat16, seed=100 + seed)
        x.copy_(nx)
        w.copy_(nw)
        for _ in range(2):
            graph.replay()
        want_w, want_ids = fused_reference(x, w, 8, True, False)
        assert torch.equal(ids.cpu(), want_ids)
        torch.testing.assert_close(wts.cpu(), want_w, atol=1e-6, rtol=1e-5)
    assert not triton_router._counters(x.device).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("experts,top_k,shared_gate", [(8, 2, False), (12, 4, True)])
def test_norm_router_equals_norm_then_router(dtype, residual, offset, experts, top_k, shared_gate):
    """norm_router_topk_triton (the post-attention RMSNorm inside the router's launch) == reference.add_rms_norm /
    rms_norm, then the router over the normed row: the normed row and h exactly, the same experts, weights to
    float rounding. Inputs whose norms and logits are exact in float32 (tests/exact_inputs.py), so every order of
    accumulation agrees."""
    from exact_inputs import exact_norm_inputs, linear_exact

    from specserve.kernels.triton_router import norm_router_topk_triton

    eps = 2.0 ** -10
    g = torch.Generator().manual_seed(experts * 10 + residual * 4 + int(offset) * 2 + (dtype == torch.bfloat16))
    x, r, nw, w, _ = exact_norm_inputs(3, 144, experts + int(shared_gate), dtype, eps, offset, residual, False, g)
    if r is None:
        xn, h = ref.rms_norm(x, nw, eps, offset), x
    else:
        xn, h = ref.add_rms_norm(x, r, nw, eps, offset)
    logits = F.linear(xn, w) if dtype == torch.float32 else linear_exact(xn, w)
    want_w, want_ids = ref.softmax_topk(logits.float(), top_k, True, shared_gate)
    dev = [t.to(DEV) if t is not None else None for t in (x, r, nw, w)]
    got_w, got_ids, got_xn, got_h = norm_router_topk_triton(dev[0], dev[1], dev[2], eps, offset, dev[3], top_k, True,
                                                            shared_gate)
    assert torch.equal(got_h.cpu(), h) and torch.equal(got_xn.cpu(), xn)
    assert torch.equal(got_ids.cpu(), want_ids)
    torch.testing.assert_close(got_w.cpu(), want_w, atol=1e-6, rtol=1e-5)
    # and the unfused ops' dispatch gives the same on this device
    ow, oids, oxn, oh = ops.norm_router_softmax_topk(*dev[:3], eps, offset, dev[3], top_k, True, shared_gate)
    assert torch.equal(oids.cpu(), want_ids) and torch.equal(oxn.cpu(), xn)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_norm_router_rounds_the_normed_row(offset):
    """Rows whose rstd is no power of 2 (exact_inputs.ieee_rstd_rows): h * rstd needs rounding in bfloat16, and
    with offset 0 the normed row is rounded before the weight multiply as well as after; the kernel's normed row
    (the experts' input) must be the reference's exactly."""
    from exact_inputs import exact_norm_inputs, ieee_rstd_rows

    from specserve.kernels.triton_router import norm_router_topk_triton

    eps = 1e-6
    g = torch.Generator().manual_seed(21 + int(offset))
    x, r, nw, w, _ = exact_norm_inputs(3, 100, 8, torch.bfloat16, eps, offset, True, False, g,
                                       h=ieee_rstd_rows(3, 100, eps, g))
    xn, h = ref.add_rms_norm(x, r, nw, eps, offset)
    got = norm_router_topk_triton(*[t.to(DEV) for t in (x, r, nw)], eps, offset, w.to(DEV), 2, True)
    assert torch.equal(got[2].cpu(), xn) and torch.equal(got[3].cpu(), h)
    if not offset:  # one rounding only would give another normed row here
        hf = (x + r).float()
        once = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * nw.float()).to(torch.bfloat16)
        assert not torch.equal(once, xn)


@pytest.mark.parametrize("experts,n_group,topk_group,top_k", [(16, 4, 2, 3), (32, 8, 3, 6), (16, 1, 1, 4),
                                                               (64, 8, 4, 8)])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_router_matches_linear_then_reference(experts, n_group, topk_group, top_k, tokens, renormalize):
    """DeepSeek-V3 / GLM's grouped sigmoid router in one launch (gate GEMV in float32, sigmoid, correction bias,
    group rating by the two best, kept groups, top-k, weights from the unbiased scores, renormalised, scaled)
    against F.linear in float32 + kernels/reference.py grouped_sigmoid_topk: the same experts in the same order (no
    near-ties in these draws), weights to float32 rounding; without a bias too."""
    from specserve.kernels.reference import grouped_sigmoid_topk
    from specserve.kernels.triton_router import grouped_router_topk_triton

    g = torch.Generator().manual_seed(experts * 7 + tokens + top_k)
    x = torch.randn((tokens, H), generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn((experts, H), generator=g) * 0.3).to(DEV)
    for bias in (torch.randn(experts, generator=g).mul(0.2).to(DEV), None):
        want_w, want_ids = grouped_sigmoid_topk(F.linear(x.float(), w), top_k, bias, n_group, topk_group, 2.5,
                                                renormalize)
        got_w, got_ids = grouped_router_topk_triton(x, w, bias, top_k, n_group, topk_group, 2.5, renormalize)
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
        # a plain shared expert fused as expert E: one more column (id E, weight 1), the same routing before it
        sw, sids = grouped_router_topk_triton(x, w, bias, top_k, n_group, topk_group, 2.5, renormalize, shared=True)
        assert torch.equal(sids[:, :-1], want_ids) and (sids[:, -1] == experts).all() and (sw[:, -1] == 1).all()
        torch.testing.assert_close(sw[:, :-1], want_w, rtol=1e-5, atol=1e-6)
        ow, oids = ops.router_grouped_sigmoid_topk(x.cpu(), w.cpu(), None if bias is None else bias.cpu(), top_k,
                                                   n_group, topk_group, 2.5, renormalize, True)  # the torch path
        assert torch.equal(oids, sids.cpu()) and torch.allclose(ow, sw.cpu(), rtol=1e-5, atol=1e-6)


def test_grouped_router_group_limit_ties_and_bad_shapes():
    """The group limit (the best expert overall, alone in its group, is not chosen), equal scores (the lower
    expert id first), weights from the chosen sigmoid scores; shapes the kernel does not serve are a clear error."""
    from specserve.kernels.triton_router import grouped_router_fits, grouped_router_topk_triton

    logits = torch.tensor([5, -5, -5, -5, 2, 2, -5, -5, 1.5, 1.5, 1.4, -5, -1, -1, -1, -1])  # 4 groups of 4
    x = torch.zeros((1, H), dtype=torch.bfloat16)
    x[0, 0] = 1.0
    w = torch.zeros((16, H))
    w[:, 0] = logits  # logits = w[:, 0]: group ratings 1.00, 1.76, 1.64, 0.54: groups 1 and 2 kept
    got_w, got_ids = grouped_router_topk_triton(x.to(DEV), w.to(DEV), None, 3, 4, 2, 2.5, True)
    assert got_ids.tolist() == [[4, 5, 8]]
    p = torch.sigmoid(logits[[4, 5, 8]])
    torch.testing.assert_close(got_w.cpu(), (p / p.sum() * 2.5)[None], rtol=1e-5, atol=1e-6)

    g = torch.Generator().manual_seed(3)
    w = torch.randn((16, H), generator=g) * 0.3
    w[[1, 5, 9, 13]] = w[0].clone()  # expert 0 and one expert of every group of 4 score alike
    x = torch.randn((2, H), generator=g).to(DEV)
    ids = grouped_router_topk_triton(x, w.to(DEV), None, 4, 4, 4, 1.0, True)[1].cpu()
    for row in ids.tolist():
        tied = [e for e in row if e in (0, 1, 5, 9, 13)]
        assert tied == sorted(tied)  # ties taken in id order
    assert grouped_router_fits(16, 4) and grouped_router_fits(12, 1) and not grouped_router_fits(12, 4)
    with pytest.raises(ValueError, match="power of two"):
        grouped_router_topk_triton(x, torch.randn((12, H)).to(DEV), None, 2, 4, 2, 1.0, True)
    with pytest.raises(ValueError, match="float32"):
        grouped_router_topk_triton(x, w.to(DEV).bfloat16(), None, 2, 4, 2, 1.0, True)
