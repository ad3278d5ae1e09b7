"""The float32 CPU fast path of Linear / MergedLinear / LMHead (oneDNN on a lazily prepacked weight) against F.linear.

It must match F.linear at every row count, rebuild its packed copy whenever the weight changes in place, and step
aside (F.linear) whenever autograd records, so training still gets gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from specserve.layers.cpu_linear import PACKED_MAX_ROWS
from specserve.layers.embedding import LMHead
from specserve.layers.linear import Linear, MergedLinear

TOL = dict(rtol=1e-4, atol=1e-5)
IN = 100  # odd sizes, so oneDNN's blocked layout has ragged tails


def _make(kind: str, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    if kind == "linear":
        m = Linear(IN, 130)
    elif kind == "linear_bias":
        m = Linear(IN, 130, bias=True)
    elif kind == "merged":
        m = MergedLinear(IN, {"q": 64, "k": 24, "v": 24}, bias=True)
    else:
        m = LMHead(1000, IN)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / IN ** 0.5)
    return m.requires_grad_(False)


def _ref(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, m.weight, getattr(m, "bias", None))


KINDS = ["linear", "linear_bias", "merged", "lm_head"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 300])
def test_matches_f_linear(kind, rows):
    m = _make(kind)
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        y = m(x)
    torch.testing.assert_close(y, _ref(m, x), **TOL)
    assert y.shape == (rows, m.weight.shape[0]) and y.dtype == torch.float32 and y.is_contiguous()
    # The packed path runs for small row counts (and every row count in the LM head); big ones keep F.linear.
    assert (m.packed.packed is not None) == (rows <= PACKED_MAX_ROWS or kind == "lm_head")


@pytest.mark.parametrize("kind", ["linear", "merged"])
def test_batched_and_strided_input(kind):
    m = _make(kind)
    x = torch.randn(2, 3, 2 * IN)[..., ::2]  # [2, 3, IN], not contiguous: 6 rows
    with torch.no_grad():
        torch.testing.assert_close(m(x), _ref(m, x), **TOL)
    assert m.packed.packed is not None


@pytest.mark.parametrize("kind", KINDS)
def test_pack_follows_in_place_weight_changes(kind):
    m = _make(kind)
    x = torch.randn(4, IN)
    with torch.no_grad():
        before = m(x)
        packed = m.packed.packed
        assert m(x) is not None and m.packed.packed is packed  # unchanged weight: the packed copy is reused
        m.weight.mul_(-2.0)  # what a loader's copy_ or an optimizer step does: an in-place write
        after = m(x)
    torch.testing.assert_close(after, _ref(m, x), **TOL)  # a stale pack would still give `before`
    assert not torch.allclose(after, before)
    assert m.packed.packed is not packed


def test_pack_follows_shard_load():
    m = _make("merged")
    x = torch.randn(3, IN)
    with torch.inference_mode():
        m(x)
        m.load_shard("k", torch.randn(24, IN))  # the loader's path: copy_ into a slice of the weight
        m.load_shard("v", torch.randn(24), is_bias=True)
        torch.testing.assert_close(m(x), _ref(m, x), **TOL)


def test_pack_follows_replaced_weight():
    m = _make("linear")
    x = torch.randn(2, IN)
    with torch.no_grad():
        m(x)
    m.weight = torch.nn.Parameter(torch.randn(130, IN), requires_grad=False)
    with torch.no_grad():
        torch.testing.assert_close(m(x), _ref(m, x), **TOL)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 4])
def test_gradients_flow_to_trained_weights(kind, rows):
    m = _make(kind).requires_grad_(True)
    x = torch.randn(rows, IN, requires_grad=True)
    with torch.no_grad():
        m(x)  # a pack exists; it must not be used while autograd records
    y = m(x)
    assert y.requires_grad
    y.square().sum().backward()
    ref_m = _make(kind).requires_grad_(True)
    ref_x = x.detach().clone().requires_grad_(True)
    _ref(ref_m, ref_x).square().sum().backward()
    torch.testing.assert_close(m.weight.grad, ref_m.weight.grad, **TOL)
    torch.testing.assert_close(x.grad, ref_x.grad, **TOL)


@pytest.mark.parametrize("kind", ["linear", "lm_head"])
def test_gradients_flow_through_frozen_weights(kind):
    # A frozen layer inside a trained graph (the MTP trainer freezes the draft's LM head): the input needs the grad.
    m = _make(kind)
    x = torch.randn(3, IN, requires_grad=True)
    m(x).sum().backward()
    ref_x = x.detach().clone().requires_grad_(True)
    _ref(m, ref_x).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, **TOL)


def test_not_in_state_dict_and_copyable():
    m = _make("linear_bias")
    x = torch.randn(2, IN)
    with torch.no_grad():
        m(x)
    assert set(m.state_dict()) == {"weight", "bias"}
    c = copy.deepcopy(m)  # the opaque packed tensor is not copied; the copy repacks on first use
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x), **TOL)


def test_other_dtypes_keep_f_linear():
    m = _make("linear").to(torch.float64)
    x = torch.randn(4, IN, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), _ref(m, x))
    assert m.packed.packed is None
