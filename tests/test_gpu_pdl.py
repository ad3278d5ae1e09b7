"""Programmatic dependent launch (PDL) under CUDA graphs on a GPU that has it (compute capability 9.0+): chains of
decode kernels where each reads what the one before wrote, replayed many times over fresh inputs, must give
exactly the outputs of the same chain launched without PDL (kernels/triton_gemv.py, triton_norm.py, triton_act.py,
triton_qk_prep.py, triton_attention.py launch with it by default, and at decode sizes the indexer, top-k and MLA
kernels: launch.grid_pdl; a kernel that read its input before the grid-dependency wait would read the previous
replay's values here; the router and MoE kernels, which launch without it, run here beside the kernels that do).
Skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels.launch import pdl_supported

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not pdl_supported(torch.device("cuda")),
                                reason="needs a CUDA GPU of compute capability 9.0+")

DEV = torch.device("cuda")
BF16 = torch.bfloat16
LAYERS, HIDDEN, QKV, INTER = 12, 576, 960, 1536  # SmolLM2-135M's projection shapes (all under 8 MB: PDL on)


def _chain(ws, x, res, pdl: bool, sync: bool = False):
    """LAYERS of the four fused decode projections, each consuming the last one's output (and the residual).
    sync: a device synchronisation after every launch (eager ground truth: no launch can overlap another)."""
    from specserve.kernels.triton_gemv import gemv, gemv_config, norm_gemv

    def cfg(w, silu=False):
        return None if pdl else dict(gemv_config(x.shape[0], w.shape[0], w.shape[1], BF16, silu), PDL=0)

    def done(t):
        if sync:
            torch.cuda.synchronize()
        return t

    h = res
    out = x
    for qkv, o, gate_up, down, n1, n2 in ws:
        y, h = done(norm_gemv(out, h, n1, 1e-6, 0.0, qkv, config=cfg(qkv)))
        out = done(gemv(y, o, config=cfg(o)))  # o [HIDDEN, QKV]: straight from the qkv output
        act, h = done(norm_gemv(out, h, n2, 1e-6, 0.0, gate_up, silu_mul=True, config=cfg(gate_up, True)))
        out = done(gemv(act, down, config=cfg(down)))
    return out, h


@pytest.mark.parametrize("rows", [1, 5])
def test_pdl_gemv_chain_equals_plain_over_replays(rows):
    from specserve.graphs.capture import capture_graph

    g = torch.Generator(device=DEV).manual_seed(rows)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEV) * scale).to(BF16)

    ws = [(rand(QKV, HIDDEN, scale=HIDDEN ** -0.5), rand(HIDDEN, QKV, scale=QKV ** -0.5),
           rand(2 * INTER, HIDDEN, scale=HIDDEN ** -0.5), rand(HIDDEN, INTER, scale=INTER ** -0.5),
           1 + rand(HIDDEN, scale=0.1), 1 + rand(HIDDEN, scale=0.1)) for _ in range(LAYERS)]
    x, res = rand(rows, HIDDEN), rand(rows, HIDDEN)  # the graphs' static inputs
    graphs = {}
    pool = None
    for pdl in (True, False):
        graph, out, pool = capture_graph(lambda pdl=pdl: _chain(ws, x, res, pdl), pool)
        graphs[pdl] = (graph, out)
    for _ in range(40):
        x.copy_(rand(rows, HIDDEN))
        res.copy_(rand(rows, HIDDEN))
        got = []
        for pdl in (True, False):
            graph, out = graphs[pdl]
            graph.replay()
            got.append([t.clone() for t in out])
        eager = _chain(ws, x, res, pdl=False, sync=True)
        for a, b, c in zip(*got, eager):
            assert torch.equal(a, b) and torch.equal(a, c)


def test_pdl_attention_chain_equals_eager_over_replays():
    """q/k prep -> fixed-width attention -> o projection in a graph (each launched with PDL at batch 1), replayed
    over fresh q, k, v and a growing sequence: equal to the same ops run eagerly, launch by launch."""
    from specserve.graphs.capture import capture_graph
    from specserve.kernels.triton_attention import fixed_width_attention
    from specserve.kernels.triton_gemv import gemv
    from specserve.kernels.triton_qk_prep import qk_norm_rope_store_triton

    g = torch.Generator(device=DEV).manual_seed(3)
    heads, kv_heads, d, slots = 9, 3, 64, 512
    k_cache = torch.zeros((slots, kv_heads, d), dtype=BF16, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    table = torch.arange(slots, device=DEV, dtype=torch.int64)[None]  # [1, slots]: request 0's slots in order
    rows = torch.zeros(1, dtype=torch.int64, device=DEV)
    seq_lens = torch.ones(1, dtype=torch.int64, device=DEV)
    loc = torch.zeros(1, dtype=torch.int64, device=DEV)
    pos = torch.zeros(1, dtype=torch.int64, device=DEV)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEV, dtype=torch.float32) / d))
    angles = torch.arange(slots, device=DEV, dtype=torch.float32)[:, None] * inv[None]
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)  # [slots, d]
    q = torch.zeros((1, heads, d), dtype=BF16, device=DEV)
    k = torch.zeros((1, kv_heads, d), dtype=BF16, device=DEV)
    v = torch.zeros_like(k)
    w_o = (torch.randn(heads * d, heads * d, generator=g, device=DEV) * (heads * d) ** -0.5).to(BF16)

    def step(sync: bool = False):
        qq, _ = qk_norm_rope_store_triton(q, k, v, k_cache, v_cache, loc, cos_sin, pos, None)
        if sync:
            torch.cuda.synchronize()
        att = fixed_width_attention(qq, k_cache, v_cache, table, rows, seq_lens, 1, 4, d ** -0.5)
        if sync:
            torch.cuda.synchronize()
        return gemv(att.reshape(1, heads * d), w_o)

    graph, out, _ = capture_graph(step, None)
    snapshot = (k_cache.clone(), v_cache.clone())
    for t in range(64):  # fresh inputs, one more key each step
        fresh = [torch.randn(tuple(b.shape), generator=g, device=DEV).to(BF16) for b in (q, k, v)]
        for buf, val in zip((q, k, v), fresh):
            buf.copy_(val)
        loc.fill_(t)
        pos.fill_(t)
        seq_lens.fill_(t + 1)
        graph.replay()
        got = out.clone()
        k_cache.copy_(snapshot[0])
        v_cache.copy_(snapshot[1])
        for buf, val in zip((q, k, v), fresh):
            buf.copy_(val)
        want = step(sync=True)  # eager, one launch at a time: the same kernels, the same cache before the step
        assert torch.equal(got, want), t
        snapshot = (k_cache.clone(), v_cache.clone())


@pytest.mark.parametrize("tokens,router_pdl", [(1, False), (4, False), (1, True), (4, True)])
def test_pdl_moe_chain_equals_eager_over_replays(tokens, router_pdl):
    """Layers of the fused norm + router + top-k and the fused MoE (one token: the direct path with its in-kernel
    sum, arrival counters shared across layers), each layer consuming the last one's output and residual, in one
    graph replayed over fresh inputs: equal to the same kernels launched one at a time with a synchronisation after
    each; the router also launched with PDL (its launch config's PDL key)."""
    from specserve.graphs.capture import capture_graph
    from specserve.kernels.triton_moe import fused_moe
    from specserve.kernels.triton_router import norm_router_topk_triton, router_config

    g = torch.Generator(device=DEV).manual_seed(11 + tokens)
    layers, e, k, h, i = 6, 32, 4, 256, 128

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEV) * scale).to(BF16)

    ws = [(rand(e, h, scale=h ** -0.5), 1 + rand(h, scale=0.1), rand(e, 2 * i, h, scale=h ** -0.5),
           rand(e, h, i, scale=i ** -0.5)) for _ in range(layers)]
    x, res = rand(tokens, h), rand(tokens, h)

    def chain(sync: bool = False):
        out, r = x, res
        for router_w, norm_w, w13, w2 in ws:
            cfg = dict(router_config(tokens, e, h, e), PDL=router_pdl)
            wts, ids, xn, r = norm_router_topk_triton(out, r, norm_w, 1e-6, 0.0, router_w, k, True, config=cfg)
            if sync:
                torch.cuda.synchronize()
            out = fused_moe(xn, w13, w2, wts, ids)
            if sync:
                torch.cuda.synchronize()
        return out, r

    graph, outs, _ = capture_graph(chain, None)
    for _ in range(40):
        x.copy_(rand(tokens, h))
        res.copy_(rand(tokens, h))
        graph.replay()
        got = [t.clone() for t in outs]
        for a, b in zip(got, chain(sync=True)):
            assert torch.equal(a, b)


def test_pdl_dsa_chain_equals_eager_over_replays():
    """Indexer scores -> the top-k's passes -> sparse MLA and its split merge (all launched with PDL at one query),
    three layers deep (each next index query a slice of the last attention output), in one graph replayed over
    fresh queries, keys and latent rows: equal to the kernels run eagerly with a synchronisation after each."""
    from specserve.graphs.capture import capture_graph
    from specserve.kernels.triton_indexer import index_scores_triton
    from specserve.kernels.triton_mla import mla_decode_triton
    from specserve.kernels.triton_topk import index_topk_triton, topk_workspace

    g = torch.Generator(device=DEV).manual_seed(5)
    kv, di, hi, heads, c, r, topk, layers = 4096, 64, 16, 32, 256, 64, 512, 3
    rows = torch.zeros((kv + 16, di), device=DEV, dtype=BF16)
    lat = torch.zeros((kv + 16, c + r), device=DEV, dtype=BF16)
    kv_slots = (torch.randperm(kv, device=DEV, generator=g) + 16).view(1, kv)
    lens = torch.full((1,), kv, dtype=torch.int64, device=DEV)
    q = torch.zeros((1, hi, di), device=DEV, dtype=BF16)
    wts = torch.zeros((1, hi), device=DEV)
    qm = torch.zeros((1, heads, c + r), device=DEV, dtype=BF16)

    def chain(sync: bool = False):
        def done(t):
            if sync:
                torch.cuda.synchronize()
            return t

        qi, outs = q, []
        for _ in range(layers):
            hist = topk_workspace(1, DEV)  # the scores kernel does the top-k's first pass, as the backend has it
            s = done(index_scores_triton(qi, wts, rows, None, kv_slots, lens, 1, hist=hist, k=topk))
            sel, cnt = done(index_topk_triton(s, lens, kv_slots, 1, topk, hist=hist))
            o = done(mla_decode_triton(qm, lat, sel, cnt, 1, 0.07, c))
            outs.append(o)
            qi = o[:, :hi, :di].contiguous()
        return outs

    graph, outs, _ = capture_graph(chain, None)
    for step in range(24):
        for buf in (rows, lat, q, qm):
            buf.copy_(torch.randn(tuple(buf.shape), generator=g, device=DEV).to(BF16))
        wts.copy_(torch.randn(tuple(wts.shape), generator=g, device=DEV))
        if step % 3 == 0:  # exact ties (ReLU zeros) every third step
            rows[16:16 + kv // 2].zero_()
        graph.replay()
        got = [t.clone() for t in outs]
        for a, b in zip(got, chain(sync=True)):
            assert torch.equal(a, b), step


def test_pdl_mode_by_size_and_measured_shapes():
    """PDL on the GEMVs of at most GEMV_PDL_MAX_BYTES and on the larger shapes of GEMV_PDL_SHAPES (8B's o), not on
    8B's qkv."""
    from specserve.kernels.triton_gemv import pdl_mode
    from specserve.kernels.tuned_h200 import GEMV_PDL_MAX_BYTES as PDL_MAX_BYTES
    from specserve.kernels.tuned_h200 import GEMV_PDL_SHAPES as PDL_SHAPES

    def w(rows, k):
        return torch.empty(rows, k, dtype=BF16, device=DEV)

    assert (4096, 4096) in PDL_SHAPES and PDL_MAX_BYTES < 4096 * 4096 * 2
    assert pdl_mode(DEV, 1024, w(4096, 4096)) == 2  # more programs than one wave: after the main loop
    assert pdl_mode(DEV, 1024, w(6144, 4096)) == 0  # 50 MB, not listed
    assert pdl_mode(DEV, 8, w(QKV, HIDDEN)) == 1 and pdl_mode(DEV, 10 ** 5, w(QKV, HIDDEN)) == 2
