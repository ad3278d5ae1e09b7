"""The gated-delta-net Triton kernels (kernels/triton_gdn.py) against their torch references: the causal conv and the
gated delta rule over slot-indexed states, float32 and bfloat16 inputs (views of one fused projection, as the layer
passes them), per_position on and off, a batch whose sequences have different lengths (one empty, one of a single
token) and start slots, followed by tokens of no sequence (must come out 0), Hv == Hk and Hv = 2 Hk, float32 and
bfloat16 states. Outputs and the whole state tensors are compared; slots no sequence writes must be unchanged.
On a GPU, the delta rule is also captured in a CUDA graph and replayed with new inputs and lengths.
On CPU the kernels run under Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py does the same)
pytest.importorskip("triton")

from specserve.kernels import reference as ref  # noqa: E402
from specserve.kernels.triton_gdn import causal_conv_states_triton, gated_delta_rule_states_triton  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# bfloat16 is compared against the output's scale: the float32 sums run in another order than the reference's, so a
# rounding can land an ulp off; Triton's interpreter also truncates float32 -> bfloat16 where the GPU rounds to
# nearest (triton 3.9): looser on CPU.
BF16_SCALE_TOL = 2e-2 if DEV.type == "cuda" else 4e-2
ROWS, SLOTS, TRAILING = 5, 4, 3  # pool rows and slots per row; tokens after the last sequence
# (state_rows, start_slots, lens) per case; row 2 is never used. per_position writes slots 0 .. len-1, so lens stay
# <= SLOTS there: the first sequence rewrites its start slot 2 at its last token, the last one its start slot 1 at
# token 1 of 4 (both read before any write), and the third, starting from slot 3, leaves that slot as it was.
BATCH = {True: ([3, 0, 4, 1], [2, 1, 3, 1], [3, 0, 1, 4]),
         False: ([3, 0, 4, 1], [2, 1, 0, 3], [6, 0, 1, 9])}


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    else:
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), atol=BF16_SCALE_TOL * scale, rtol=0)


def _batch(per_position: bool):
    """-> (state_rows, start_slots, starts, lens) [B] int64 on DEV, T (with TRAILING tokens), written (row, slot)."""
    rows, slots, lens = BATCH[per_position]
    starts = [sum(lens[:b]) for b in range(len(lens))]  # back to back
    written = set()
    for row, slot, n in zip(rows, slots, lens):
        if per_position:
            written |= {(row, i) for i in range(n)}
        elif n:
            written.add((row, slot))
    meta = tuple(torch.tensor(x, dtype=torch.int64, device=DEV) for x in (rows, slots, starts, lens))
    return meta, sum(lens) + TRAILING, written


def _check_states(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor, written: set) -> None:
    """The whole pool: written (row, slot)s against the reference, all others bit-identical to before."""
    for r in range(ROWS):
        for s in range(SLOTS):
            if (r, s) in written:
                _assert_close(got[r, s], want[r, s])
            else:
                assert torch.equal(got[r, s], before[r, s]), (r, s)
    # the reference's pool is the same everywhere it was not written (a check on `written` itself)
    assert all(torch.equal(want[r, s], before[r, s]) for r in range(ROWS) for s in range(SLOTS)
               if (r, s) not in written)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_position", [False, True])
def test_causal_conv_matches_reference(dtype, state_dtype, per_position):
    _check_conv(dtype, state_dtype, per_position, channels=48, k=4)


@pytest.mark.parametrize("per_position", [False, True])
@pytest.mark.parametrize("channels,k", [(300, 4), (40, 2), (40, 3)])
def test_causal_conv_shapes(per_position, channels, k):
    """300 channels: two channel blocks, the second masked; kernel widths 2 (a one-row window) and 3."""
    _check_conv(torch.bfloat16, torch.bfloat16, per_position, channels, k)


def _check_conv(dtype, state_dtype, per_position, channels, k):
    (rows, slots, starts, lens), t, written = _batch(per_position)
    g = torch.Generator().manual_seed(channels + k + 7 * per_position)
    fused = torch.randn((t, channels + 10), generator=g).to(dtype).to(DEV)
    x = fused[:, 4:4 + channels]  # [T, C] row-strided view, as the layer's slice of the projection
    weight = (torch.randn((channels, k), generator=g) / k ** 0.5).to(dtype).to(DEV)
    state = torch.randn((ROWS, SLOTS, k - 1, channels), generator=g).to(state_dtype).to(DEV)
    before, want_state = state.clone(), state.clone()
    got = causal_conv_states_triton(x, weight, state, rows, slots, starts, lens, per_position)
    want = ref.causal_conv_states(x, weight, want_state, rows, slots, starts, lens, per_position)
    assert got.shape == (t, channels) and got.dtype == dtype
    _assert_close(got, want)
    assert torch.all(got[-TRAILING:] == 0)
    _check_states(state, want_state, before, written)


def _delta_inputs(t: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, g: torch.Generator):
    """q, k [T, Hk, Dk], v [T, Hv, Dv] as views of one fused buffer; g, beta [T, Hv] float32 views of another."""
    qkv = (torch.randn((t, 2 * hk * dk + hv * dv + 8), generator=g) * 2).to(dtype).to(DEV)
    q = qkv[:, :hk * dk].view(t, hk, dk)
    k = qkv[:, hk * dk:2 * hk * dk].view(t, hk, dk)
    v = qkv[:, 2 * hk * dk:2 * hk * dk + hv * dv].view(t, hv, dv)
    ab = torch.randn((t, 2 * hv), generator=g).to(DEV)
    decay = -torch.nn.functional.softplus(ab[:, :hv]) * 0.5  # [T, Hv] log decay <= 0
    beta = ab[:, hv:].sigmoid()
    return q, k, v, decay, beta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_position", [False, True])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 2, 16, 16), (2, 4, 16, 64), (2, 4, 32, 16)])
def test_gated_delta_rule_matches_reference(dtype, per_position, hk, hv, dk, dv):
    """Dv = 64: a head's value columns split over two programs; Dk = 32 != Dv."""
    (rows, slots, starts, lens), t, written = _batch(per_position)
    g = torch.Generator().manual_seed(hv * dk + dv + per_position)
    q, k, v, decay, beta = _delta_inputs(t, hk, hv, dk, dv, dtype, g)
    state = (torch.randn((ROWS, SLOTS, hv, dk, dv), generator=g) * 0.5).to(DEV)
    before, want_state = state.clone(), state.clone()
    got = gated_delta_rule_states_triton(q, k, v, decay, beta, state, rows, slots, starts, lens, per_position)
    want = ref.gated_delta_rule_states(q, k, v, decay, beta, want_state, rows, slots, starts, lens, per_position)
    assert got.shape == (t, hv, dv) and got.dtype == dtype
    _assert_close(got, want)
    assert torch.all(got[-TRAILING:] == 0)
    _check_states(state, want_state, before, written)


@pytest.mark.parametrize("per_position", [False, True])
def test_gated_delta_rule_bf16_state(per_position):
    (rows, slots, starts, lens), t, written = _batch(per_position)
    g = torch.Generator().manual_seed(5 + per_position)
    q, k, v, decay, beta = _delta_inputs(t, 2, 4, 16, 16, torch.bfloat16, g)
    state = (torch.randn((ROWS, SLOTS, 4, 16, 16), generator=g) * 0.5).to(torch.bfloat16).to(DEV)
    before, want_state = state.clone(), state.clone()
    got = gated_delta_rule_states_triton(q, k, v, decay, beta, state, rows, slots, starts, lens, per_position)
    want = ref.gated_delta_rule_states(q, k, v, decay, beta, want_state, rows, slots, starts, lens, per_position)
    _assert_close(got, want)
    _check_states(state, want_state, before, written)


def test_empty_batch():
    """No sequence: all-zero outputs, states untouched (and no launch)."""
    none = torch.zeros(0, dtype=torch.int64, device=DEV)
    x = torch.randn((3, 8), device=DEV)
    conv = torch.randn((2, 2, 3, 8), device=DEV)
    before = conv.clone()
    assert torch.equal(causal_conv_states_triton(x, torch.randn((8, 4), device=DEV), conv, none, none, none, none,
                                                 False), torch.zeros_like(x))
    assert torch.equal(conv, before)
    q = torch.randn((3, 1, 16), device=DEV)
    v = torch.randn((3, 2, 16), device=DEV)
    gb = torch.zeros((3, 2), device=DEV)
    ssm = torch.randn((2, 2, 2, 16, 16), device=DEV)
    out = gated_delta_rule_states_triton(q, q, v, gb, gb, ssm, none, none, none, none, True)
    assert torch.equal(out, torch.zeros_like(v))


@pytest.mark.gpu
@pytest.mark.parametrize("per_position", [False, True])
def test_gated_delta_rule_cuda_graph_replay(per_position):
    """Captured once with fixed shapes; replays with new inputs, start slots and lengths (copied into the same static
    tensors) equal the reference."""
    dev = torch.device("cuda")
    hk, hv, dk, dv, t, slots_n = 2, 4, 128, 128, 12, 4
    g = torch.Generator().manual_seed(0)
    q, k, v, decay, beta = (x.clone() for x in _delta_inputs(t, hk, hv, dk, dv, torch.bfloat16, g))
    state = torch.zeros((ROWS, slots_n, hv, dk, dv), device=dev)
    rows = torch.tensor([3, 0, 4], device=dev)
    slots, starts, lens = (torch.zeros(3, dtype=torch.int64, device=dev) for _ in range(3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles) outside the capture
        gated_delta_rule_states_triton(q, k, v, decay, beta, state, rows, slots, starts, lens, per_position)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gated_delta_rule_states_triton(q, k, v, decay, beta, state, rows, slots, starts, lens, per_position)
    for seed in range(4):
        g.manual_seed(100 + seed)
        n = torch.randint(0, slots_n + 1, (3,), generator=g)  # <= the slots per row; 0 allowed
        for dst, src in zip((q, k, v, decay, beta), _delta_inputs(t, hk, hv, dk, dv, torch.bfloat16, g)):
            dst.copy_(src)
        lens.copy_(n.to(dev))
        starts.copy_((n.cumsum(0) - n).to(dev))
        slots.copy_(torch.randint(0, slots_n, (3,), generator=g).to(dev))
        state.copy_(torch.randn(state.shape, generator=g).to(dev) * 0.5)
        want_state = state.clone()
        graph.replay()
        torch.cuda.synchronize()
        want = ref.gated_delta_rule_states(q, k, v, decay, beta, want_state, rows, slots, starts, lens, per_position)
        _assert_close(out, want)
        _assert_close(state, want_state)
