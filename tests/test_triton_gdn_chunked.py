"""The gated-delta-net prefill kernels (kernels/triton_gdn_chunked.py) against their torch references with
per_position=False: the token-parallel causal conv and the chunk-parallel gated delta rule over slot-indexed states.
float32 and bfloat16 inputs (views of one fused projection, as the layer passes them), a batch whose sequences are
two chunks plus a remainder, empty, one token, two tokens (shorter than the conv's K-1 window) and exactly one chunk
long, from nonzero start slots, followed by tokens of no sequence (must come out 0); Hv == Hk and Hv = 2 Hk; float32
and bfloat16 states. Outputs and the whole state tensors are compared; slots no sequence writes must be bit-identical.

Tolerances: the chunked delta rule sums in another order than the token-by-token reference (products over a chunk,
a triangular inverse), so float32 is compared at atol 1e-4 / rtol 1e-3 rather than the token kernels' 1e-5 / 1e-4;
bfloat16 against the output's scale as in test_triton_gdn.py. The conv computes the same sums (1e-5 / 1e-4).
On a GPU, both kernels are also captured in one CUDA graph and replayed with new lengths, and the chunked delta
rule is timed against the token-sequential kernel. On CPU the kernels run under Triton's interpreter (chunks of 16
and 32 tokens keep it fast; the default 64 is run once)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py does the same)
pytest.importorskip("triton")

from specserve.kernels import ops  # noqa: E402
from specserve.kernels import reference as ref  # noqa: E402
from specserve.kernels.triton_gdn import gated_delta_rule_states_triton  # noqa: E402
from specserve.kernels.triton_gdn_chunked import (  # noqa: E402
    causal_conv_prefill_triton,
    gated_delta_rule_prefill_triton,
)

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# as test_triton_gdn.py: float32 sums in another order can move a bfloat16 rounding an ulp; the interpreter also
# truncates float32 -> bfloat16 where the GPU rounds to nearest
BF16_SCALE_TOL = 2e-2 if DEV.type == "cuda" else 4e-2
ROWS, SLOTS, TRAILING = 6, 4, 3  # pool rows and slots per row; tokens after the last sequence
STATE_ROWS = [3, 0, 4, 1, 5]  # row 2 is never used
START_SLOTS = [2, 1, 3, 0, 1]  # nonzero start slots; the empty sequence's slot (row 0, slot 1) stays as it was


def _lens(chunk: int) -> list[int]:
    """Two chunks plus a remainder, empty, 1 and 2 tokens (shorter than K-1 = 3), exactly one chunk."""
    return [2 * chunk + 5, 0, 1, 2, chunk]


def _batch(lens: list[int]):
    """-> (state_rows, start_slots, starts, lens) [B] int64 on DEV, T (with TRAILING tokens), written (row, slot)s."""
    rows, slots = STATE_ROWS[:len(lens)], START_SLOTS[:len(lens)]
    starts = [sum(lens[:b]) for b in range(len(lens))]  # back to back
    written = {(r, s) for r, s, n in zip(rows, slots, lens) if n}
    meta = tuple(torch.tensor(x, dtype=torch.int64, device=DEV) for x in (rows, slots, starts, lens))
    return meta, sum(lens) + TRAILING, written


def _assert_close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    else:
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), atol=BF16_SCALE_TOL * scale, rtol=0)


def _check_states(got, want, before, written, atol, rtol) -> None:
    """The whole pool: written (row, slot)s against the reference, all others bit-identical to before."""
    for r in range(ROWS):
        for s in range(SLOTS):
            if (r, s) in written:
                _assert_close(got[r, s], want[r, s], atol, rtol)
            else:
                assert torch.equal(got[r, s], before[r, s]), (r, s)
                assert torch.equal(want[r, s], before[r, s]), (r, s)  # a check on `written` itself


# ---------------------------------------------------------------------------------------------------------------
# causal conv


def _check_conv(dtype, state_dtype, channels, k, block_t, bound="total"):
    (rows, slots, starts, lens), t, written = _batch(_lens(16))
    g = torch.Generator().manual_seed(channels + 10 * k + block_t)
    fused = torch.randn((t, channels + 10), generator=g).to(dtype).to(DEV)
    x = fused[:, 4:4 + channels]  # [T, C] row-strided view, as the layer's slice of the projection
    weight = (torch.randn((channels, k), generator=g) / k ** 0.5).to(dtype).to(DEV)
    state = torch.randn((ROWS, SLOTS, k - 1, channels), generator=g).to(state_dtype).to(DEV)
    before, want_state = state.clone(), state.clone()
    max_tokens = t if bound == "total" else int(lens.max())
    got = causal_conv_prefill_triton(x, weight, state, rows, slots, starts, lens, max_tokens, block_t=block_t)
    want = ref.causal_conv_states(x, weight, want_state, rows, slots, starts, lens, False)
    assert got.shape == (t, channels) and got.dtype == dtype
    _assert_close(got, want, 1e-5, 1e-4)
    assert torch.all(got[-TRAILING:] == 0)
    _check_states(state, want_state, before, written, 1e-5, 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_causal_conv_prefill_matches_reference(dtype, state_dtype):
    """Tiles of 4 tokens: the 37-token sequence spans 10 programs, only the first of which reads the window."""
    _check_conv(dtype, state_dtype, channels=48, k=4, block_t=4)


@pytest.mark.parametrize("channels,k,block_t,bound", [(300, 4, 32, "total"), (40, 2, 8, "longest"),
                                                      (40, 3, 2, "longest")])
def test_causal_conv_prefill_shapes(channels, k, block_t, bound):
    """300 channels: three channel blocks, the last masked; kernel widths 2 (a one-row window) and 3 with tiles of
    K-1 tokens; max_tokens_per_seq the batch's token count or exactly the longest sequence."""
    _check_conv(torch.bfloat16, torch.bfloat16, channels, k, block_t, bound)


# ---------------------------------------------------------------------------------------------------------------
# gated delta rule


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


def _check_delta(dtype, state_dtype, hk, hv, dk, dv, chunk, seed):
    (rows, slots, starts, lens), t, written = _batch(_lens(chunk))
    g = torch.Generator().manual_seed(seed)
    q, k, v, decay, beta = _delta_inputs(t, hk, hv, dk, dv, dtype, g)
    state = (torch.randn((ROWS, SLOTS, hv, dk, dv), generator=g) * 0.5).to(state_dtype).to(DEV)
    before, want_state = state.clone(), state.clone()
    kwargs = {} if chunk == 64 else {"chunk": chunk}
    got = gated_delta_rule_prefill_triton(q, k, v, decay, beta, state, rows, slots, starts, lens, t, **kwargs)
    want = ref.gated_delta_rule_states(q, k, v, decay, beta, want_state, rows, slots, starts, lens, False)
    assert got.shape == (t, hv, dv) and got.dtype == dtype
    _assert_close(got, want, 1e-4, 1e-3)
    assert torch.all(got[-TRAILING:] == 0)
    _check_states(state, want_state, before, written, 1e-4, 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 2, 16, 16), (2, 4, 32, 16), (1, 2, 16, 64)])
def test_gated_delta_rule_prefill_matches_reference(dtype, chunk, hk, hv, dk, dv):
    """Chunks of 32: two 16-row diagonal blocks combined by the blockwise inverse; Dv = 64: a head's value columns
    split over two programs; Dk = 32 != Dv."""
    _check_delta(dtype, torch.float32, hk, hv, dk, dv, chunk, seed=hv * dk + dv + chunk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_rule_prefill_bf16_state(dtype):
    _check_delta(dtype, torch.bfloat16, 2, 4, 16, 16, 16, seed=5)


def test_gated_delta_rule_prefill_default_chunk():
    """The default 64-token chunks (four diagonal blocks, three block-substitution steps)."""
    _check_delta(torch.float32, torch.float32, 1, 2, 16, 16, 64, seed=9)


def test_gated_delta_rule_prefill_correlated_keys():
    """All keys nearly one vector and beta ~ 1: I + A is far from the identity (the powers of A grow), which an
    unstable inverse would show."""
    (rows, slots, starts, lens), t, written = _batch(_lens(32))
    g = torch.Generator().manual_seed(11)
    q, k, v, decay, beta = _delta_inputs(t, 1, 2, 16, 16, torch.float32, g)
    k.copy_(k[:1] + 0.05 * k)
    beta.fill_(0.99)
    decay.mul_(0.02)
    state = (torch.randn((ROWS, SLOTS, 2, 16, 16), generator=g) * 0.5).to(DEV)
    before, want_state = state.clone(), state.clone()
    got = gated_delta_rule_prefill_triton(q, k, v, decay, beta, state, rows, slots, starts, lens, chunk=32)
    want = ref.gated_delta_rule_states(q, k, v, decay, beta, want_state, rows, slots, starts, lens, False)
    _assert_close(got, want, 1e-4, 1e-3)
    _check_states(state, want_state, before, written, 1e-4, 1e-3)


def test_empty_batch():
    """No sequence: all-zero outputs, states untouched (and no launch)."""
    none = torch.zeros(0, dtype=torch.int64, device=DEV)
    x = torch.randn((3, 8), device=DEV)
    conv = torch.randn((2, 2, 3, 8), device=DEV)
    before = conv.clone()
    out = causal_conv_prefill_triton(x, torch.randn((8, 4), device=DEV), conv, none, none, none, none, 3)
    assert torch.equal(out, torch.zeros_like(x)) and torch.equal(conv, before)
    q = torch.randn((3, 1, 16), device=DEV)
    v = torch.randn((3, 2, 16), device=DEV)
    gb = torch.zeros((3, 2), device=DEV)
    ssm = torch.randn((2, 2, 2, 16, 16), device=DEV)
    before = ssm.clone()
    out = gated_delta_rule_prefill_triton(q, q, v, gb, gb, ssm, none, none, none, none)
    assert torch.equal(out, torch.zeros_like(v)) and torch.equal(ssm, before)


def test_ops_dispatch_cpu():
    """kernels/ops.py: CPU tensors take the references with per_position=False."""
    (rows, slots, starts, lens), t, _ = _batch([5, 0, 3])
    g = torch.Generator().manual_seed(3)
    q, k, v, decay, beta = (x.cpu() for x in _delta_inputs(t, 1, 2, 16, 16, torch.float32, g))
    meta = [x.cpu() for x in (rows, slots, starts, lens)]
    state = torch.randn((ROWS, SLOTS, 2, 16, 16), generator=g)
    want_state = state.clone()
    got = ops.gated_delta_rule_prefill(q, k, v, decay, beta, state, *meta)
    want = ref.gated_delta_rule_states(q, k, v, decay, beta, want_state, *meta, False)
    assert torch.equal(got, want) and torch.equal(state, want_state)
    x = torch.randn((t, 8), generator=g)
    w = torch.randn((8, 4), generator=g)
    conv = torch.randn((ROWS, SLOTS, 3, 8), generator=g)
    want_conv = conv.clone()
    got = ops.causal_conv_prefill(x, w, conv, *meta, t)
    want = ref.causal_conv_states(x, w, want_conv, *meta, False)
    assert torch.equal(got, want) and torch.equal(conv, want_conv)


# ---------------------------------------------------------------------------------------------------------------
# GPU only


@pytest.mark.gpu
def test_prefill_cuda_graph_replay():
    """Both kernels captured once in one graph with fixed shapes; replays with new inputs, start slots and lengths
    (copied into the same static tensors) equal the references, the whole pools included."""
    dev = torch.device("cuda")
    hk, hv, dk, dv, t, channels, kw = 2, 4, 128, 128, 300, 256, 4
    g = torch.Generator().manual_seed(0)
    q, k, v, decay, beta = (x.clone() for x in _delta_inputs(t, hk, hv, dk, dv, torch.bfloat16, g))
    x = torch.randn((t, channels), generator=g).to(torch.bfloat16).to(dev)
    weight = (torch.randn((channels, kw), generator=g) / 2).to(torch.bfloat16).to(dev)
    ssm = torch.zeros((ROWS, SLOTS, hv, dk, dv), device=dev)
    conv = torch.zeros((ROWS, SLOTS, kw - 1, channels), dtype=torch.bfloat16, device=dev)
    rows = torch.tensor([3, 0, 4], device=dev)
    slots, starts, lens = (torch.zeros(3, dtype=torch.int64, device=dev) for _ in range(3))

    def step():
        return (causal_conv_prefill_triton(x, weight, conv, rows, slots, starts, lens, t),
                gated_delta_rule_prefill_triton(q, k, v, decay, beta, ssm, rows, slots, starts, lens, t))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles) outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        conv_out, delta_out = step()
    for seed in range(4):
        g.manual_seed(100 + seed)
        n = torch.randint(0, t // 3 + 1, (3,), generator=g)  # up to 100 tokens (two chunks), 0 allowed
        for dst, src in zip((q, k, v, decay, beta), _delta_inputs(t, hk, hv, dk, dv, torch.bfloat16, g)):
            dst.copy_(src)
        x.copy_(torch.randn(x.shape, generator=g).to(dev))
        lens.copy_(n.to(dev))
        starts.copy_((n.cumsum(0) - n).to(dev))
        slots.copy_(torch.randint(0, SLOTS, (3,), generator=g).to(dev))
        ssm.copy_(torch.randn(ssm.shape, generator=g).to(dev) * 0.5)
        conv.copy_(torch.randn(conv.shape, generator=g).to(dev))
        want_ssm, want_conv = ssm.clone(), conv.clone()
        graph.replay()
        torch.cuda.synchronize()
        want = ref.causal_conv_states(x, weight, want_conv, rows, slots, starts, lens, False)
        _assert_close(conv_out, want, 1e-5, 1e-4)
        _assert_close(conv, want_conv, 1e-5, 1e-4)
        want = ref.gated_delta_rule_states(q, k, v, decay, beta, want_ssm, rows, slots, starts, lens, False)
        _assert_close(delta_out, want, 1e-4, 1e-3)
        torch.testing.assert_close(ssm, want_ssm, atol=1e-4, rtol=1e-3)


@pytest.mark.gpu
def test_prefill_timing():
    """Prints (asserts nothing) the chunked delta rule against the token-sequential kernel for one 2048-token
    prompt, Qwen3-Next's linear-attention heads: Hk = 16, Hv = 32, Dk = Dv = 128, bfloat16 inputs, float32 state."""
    dev = torch.device("cuda")
    hk, hv, dk, dv, t = 16, 32, 128, 128, 2048
    g = torch.Generator().manual_seed(0)
    q, k, v, decay, beta = _delta_inputs(t, hk, hv, dk, dv, torch.bfloat16, g)
    meta = tuple(torch.tensor([x], dtype=torch.int64, device=dev) for x in (0, 0, 0, t))
    state = (torch.randn((1, 1, hv, dk, dv), generator=g) * 0.5).to(dev)

    def timed(fn, reps=10):
        s = state.clone()
        out = fn(s)  # compile, warm up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn(s)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps, out

    chunked_ms, chunked = timed(lambda s: gated_delta_rule_prefill_triton(q, k, v, decay, beta, s, *meta))
    token_ms, token = timed(lambda s: gated_delta_rule_states_triton(q, k, v, decay, beta, s, *meta, False))
    diff = (chunked.float() - token.float()).abs().max().item()
    print(f"\ngated delta rule prefill, T={t} Hk={hk} Hv={hv} Dk=Dv={dk}: chunked {chunked_ms:.3f} ms, "
          f"token-sequential {token_ms:.3f} ms ({token_ms / chunked_ms:.1f}x); outputs differ by at most {diff:.2e}")
