"""The fused-MoE Triton kernel (kernels/triton_moe.py) against its torch reference: float32 and bfloat16, T in
(1, 3, 17), routings that leave experts without tokens (their weights are NaN-poisoned, so reading them shows up),
send every pair to one expert, or repeat an expert within a token with different weights; the alignment helper
against a python reference; and, on a GPU, the kernel captured in a CUDA graph and replayed with new routings.
On CPU the kernels run under Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py does the same)
pytest.importorskip("triton")

from specserve.kernels import reference as ref  # noqa: E402
from specserve.kernels.triton_moe import fused_moe  # noqa: E402
from specserve.kernels.triton_moe_blocks import moe_align, moe_block_m  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# bfloat16 is compared against the output's scale: the kernel rounds three intermediates (gate/up, the activation,
# each expert's output) like the reference, but its float32 sums run in another order, so an intermediate can be an
# ulp off, and an ulp of an intermediate is large next to small outputs. Triton's interpreter also truncates
# float32 -> bfloat16 where the GPU rounds to nearest (triton 3.9), which biases every rounding: looser on CPU.
BF16_SCALE_TOL = 2e-2 if DEV.type == "cuda" else 4e-2
NUM_E, TOP_K, HIDDEN, INTER = 8, 2, 64, 32


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    else:
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), atol=BF16_SCALE_TOL * scale, rtol=0)


def _routing(kind: str, t: int, e: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (topk_weights [t, k] float32, topk_ids [t, k] int64)."""
    if kind == "distinct":  # k different experts per token, as a top-k router picks
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    elif kind == "some_empty":  # experts 0, 2, 3, 5, 7 get nothing
        ids = torch.tensor([1, 4, 6])[torch.randint(0, 3, (t, k), generator=g)]
    elif kind == "one_expert":  # every pair to expert 5: repeated ids within a token
        ids = torch.full((t, k), 5)
    else:  # "repeats": any expert, repeats allowed
        ids = torch.randint(0, e, (t, k), generator=g)
    w = torch.rand((t, k), generator=g) + 0.1  # different weights for repeated ids
    return w.to(DEV), ids.to(DEV)


def _weights(e: int, h: int, i: int, dtype: torch.dtype, g: torch.Generator):
    w13 = torch.randn((e, 2 * i, h), generator=g) / h ** 0.5  # [E, 2I, H]
    w2 = torch.randn((e, h, i), generator=g) / i ** 0.5  # [E, H, I]
    return w13.to(dtype).to(DEV), w2.to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("kind", ["distinct", "some_empty", "one_expert", "repeats"])
def test_fused_moe_matches_reference(dtype, t, kind):
    g = torch.Generator().manual_seed(t * 31 + len(kind))
    base = (torch.randn((t, HIDDEN + 6), generator=g) * 2).to(dtype).to(DEV)
    x = base[:, 3:3 + HIDDEN]  # [T, H] row-strided view, as a slice of a fused buffer
    w13, w2 = _weights(NUM_E, HIDDEN, INTER, dtype, g)
    topk_weights, topk_ids = _routing(kind, t, NUM_E, TOP_K, g)
    unused = torch.ones(NUM_E, dtype=torch.bool, device=DEV)
    unused[topk_ids.reshape(-1)] = False
    w13[unused], w2[unused] = float("nan"), float("nan")  # an expert without tokens must not be read
    got = fused_moe(x, w13, w2, topk_weights, topk_ids)
    want = ref.fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert got.shape == (t, HIDDEN) and got.dtype == dtype
    _assert_close(got, want)
    assert torch.equal(fused_moe(x, w13, w2, topk_weights, topk_ids), got)  # deterministic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["distinct", "one_expert", "repeats"])
def test_fused_moe_direct_equals_aligned(dtype, kind):
    """One token's pairs as blocks of their own (the default at one token: no alignment launch) give the aligned
    path's output bit for bit, repeated experts included; forced on at several tokens it still equals it."""
    g = torch.Generator().manual_seed(7 + len(kind))
    w13, w2 = _weights(NUM_E, HIDDEN, INTER, dtype, g)
    for t in (1, 3):
        x = (torch.randn((t, HIDDEN), generator=g) * 2).to(dtype).to(DEV)
        topk_weights, topk_ids = _routing(kind, t, NUM_E, TOP_K, g)
        aligned = fused_moe(x, w13, w2, topk_weights, topk_ids, direct=False)
        assert torch.equal(fused_moe(x, w13, w2, topk_weights, topk_ids, direct=True), aligned)
        if t == 1:
            assert torch.equal(fused_moe(x, w13, w2, topk_weights, topk_ids), aligned)
        _assert_close(aligned, ref.fused_moe(x, w13, w2, topk_weights, topk_ids))


@pytest.mark.parametrize("t", [1, 3])
def test_fused_moe_tiles_override(t):
    """Launch configs other than the defaults (bench_moe.py --sweep tries them): narrower and wider column blocks,
    K steps shorter and longer than the inner dims, on both paths, still give the reference's result."""
    g = torch.Generator().manual_seed(11 + t)
    w13, w2 = _weights(NUM_E, HIDDEN, INTER, torch.float32, g)
    x = (torch.randn((t, HIDDEN), generator=g) * 2).to(DEV)
    topk_weights, topk_ids = _routing("distinct", t, NUM_E, TOP_K, g)
    want = ref.fused_moe(x, w13, w2, topk_weights, topk_ids)
    for n, k in ((16, 16), (32, 128), (128, 32)):
        cfg = dict(BLOCK_N=n, BLOCK_K=k, num_warps=4, num_stages=2)
        gu, down = dict(cfg, BLOCK_N=2 * n), cfg
        _assert_close(fused_moe(x, w13, w2, topk_weights, topk_ids, tiles=(gu, down)), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_prefill_blocks(dtype):
    """A prefill-sized batch: 128-row blocks and their wider tiles."""
    t = 512
    assert moe_block_m(t * TOP_K, NUM_E) == 128
    g = torch.Generator().manual_seed(3)
    x = torch.randn((t, HIDDEN), generator=g).to(dtype).to(DEV)
    w13, w2 = _weights(NUM_E, HIDDEN, INTER, dtype, g)
    topk_weights, topk_ids = _routing("repeats", t, NUM_E, TOP_K, g)
    _assert_close(fused_moe(x, w13, w2, topk_weights, topk_ids), ref.fused_moe(x, w13, w2, topk_weights, topk_ids))


def _align_reference(ids: list[int], num_experts: int, block_m: int):
    """-> (padded runs of pair indices per expert, concatenated; the expert of each block)."""
    n = len(ids)
    rows, owners = [], []
    for e in range(num_experts):
        mine = [p for p in range(n) if ids[p] == e]
        blocks = -(-len(mine) // block_m)
        rows += mine + [n] * (blocks * block_m - len(mine))
        owners += [e] * blocks
    return rows, owners


@pytest.mark.parametrize("t,k,kind,block_m,num_e", [(1, 2, "distinct", 16, 8), (17, 2, "some_empty", 16, 8),
                                                    (9, 2, "one_expert", 16, 8), (100, 3, "repeats", 16, 8),
                                                    (70, 2, "repeats", 32, 8), (33, 2, "repeats", 16, 6),
                                                    (4200, 2, "repeats", 64, 8), (16, 8, "distinct", 16, 128),
                                                    (4, 8, "repeats", 16, 60), (2, 10, "distinct", 16, 512)])
@pytest.mark.parametrize("one_launch", [True, False])
def test_moe_align(t, k, kind, block_m, num_e, one_launch):
    """Counts, padded offsets, each (token, k) pair placed exactly once (stably, by expert), padding marked; 100 x 3
    pairs span three alignment chunks, 4200 x 2 more chunks than the offsets kernel reads in one step; 6 experts
    leave empty histogram bins. Batches of one chunk (<= 128 pairs) take one launch, or the three kernels."""
    g = torch.Generator().manual_seed(t + k)
    _, topk_ids = _routing(kind, t, num_e, k, g)
    n = t * k
    sorted_ids, block_expert, num_padded = moe_align(topk_ids, num_e, block_m, one_launch)
    rows, owners = _align_reference(topk_ids.reshape(-1).tolist(), num_e, block_m)
    bound = block_m * ((n + min(num_e, n) * (block_m - 1)) // block_m)
    assert sorted_ids.shape == (bound,) and block_expert.shape == (bound // block_m,)
    total = int(num_padded.item())
    assert total == len(rows) <= bound and total % block_m == 0
    assert sorted_ids[:total].tolist() == rows
    assert block_expert[:total // block_m].tolist() == owners
    assert torch.all(sorted_ids[total:] == n)  # past the live total: padding too
    assert torch.all(block_expert[total // block_m:] >= num_e)
    real = sorted_ids[sorted_ids < n]
    assert sorted(real.tolist()) == list(range(n))  # every pair exactly once


def test_block_m_from_shapes():
    assert moe_block_m(8, 128) == 16 and moe_block_m(512, 128) == 16 and moe_block_m(4096, 128) == 64
    assert moe_block_m(8192 * 8, 128) == 128


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5])
def test_fused_moe_cuda_graph_replay(dtype, t):
    """Captured once with fixed shapes (one token: the direct path); replays with new routings
    (different experts, counts, and empty experts) equal the reference."""
    dev = torch.device("cuda")
    e, h, i, k = 16, 256, 128, 4
    g = torch.Generator().manual_seed(0)
    w13, w2 = (w.to(dev) for w in _weights(e, h, i, dtype, g))
    x = (torch.randn((t, h), generator=g)).to(dtype).to(dev)
    topk_weights = torch.rand((t, k), generator=g).to(dev)
    topk_ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles) outside the capture
        fused_moe(x, w13, w2, topk_weights, topk_ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, topk_weights, topk_ids)
    for seed in range(4):
        g.manual_seed(100 + seed)
        ids = torch.randint(0, 3 if seed % 2 else e, (t, k), generator=g)  # odd seeds: experts 3.. get nothing
        topk_ids.copy_(ids.to(dev))
        topk_weights.copy_(torch.rand((t, k), generator=g).to(dev))
        x.copy_(torch.randn((t, h), generator=g).to(dtype).to(dev))
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out, ref.fused_moe(x, w13, w2, topk_weights, topk_ids))
