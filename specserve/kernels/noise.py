"""Counter-based sampling noise: the uniform for (seed, position, salt) is a hash (splitmix64), so a request's
sample does not depend on its batch, on retraction/re-prefill, or on the device. Shared by the sampler
(layers/sampler.py), the accept reference (speculative/accept.py) and the accept kernel (kernels/triton_accept.py)."""

from __future__ import annotations

import torch

SALT_SAMPLE = 0  # the token drawn at a position (plain sampling, verify's residual or bonus draw)
SALT_ACCEPT = 1  # verify's accept test at a position
SALT_DRAFT = 2  # a draft token sampled from the draft's own distribution (--speculative-draft-sampling sample)

_M1 = -4658895280553007687  # 0xbf58476d1ce4e5b9 as int64
_M2 = -7723592293110705685  # 0x94d049bb133111eb
_GOLD = -7046029254386353131  # 0x9e3779b97f4a7c15


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (multiplication wraps modulo 2^64)."""
    x = x ^ _srl(x, 30)
    x = x * _M1
    x = x ^ _srl(x, 27)
    x = x * _M2
    return x ^ _srl(x, 31)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, salt: int, width: int | None) -> torch.Tensor:
    """Uniform (0, 1) noise. seeds, positions [...] int64 -> [..., width] (or [...] when width is None)."""
    key = _mix64(seeds * _GOLD + positions * 0x632BE5AB + salt * 0x2545F491)
    if width is not None:
        cols = torch.arange(width, device=seeds.device, dtype=torch.int64)
        key = key[..., None] + cols * _GOLD
    return to_unit(_mix64(key))


def to_unit(h: torch.Tensor) -> torch.Tensor:
    """A mixed 64-bit hash -> float32 in (0, 1): its top 23 bits b as (b + 0.5) / 2^23, exact in float32 and strictly
    inside the interval. With 24 bits the largest value, 2^24 - 0.5, rounds to 2^24 and u to exactly 1.0, where the
    exponential race divides by -log(u) = 0 (the row's sample was then that token whatever its probability: ~1% of
    rows a step with a 150k vocabulary)."""
    return (_srl(h, 41).float() + 0.5) * (1.0 / (1 << 23))
