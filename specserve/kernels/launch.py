"""Launch sizing shared by the kernels: how many programs fill a device (shapes and the device only, so every
choice made from it is fixed under a CUDA graph)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _sm_count(index: int) -> int:  # asked once per device, not per layer per eager forward
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    return _sm_count(_index(device))


def target_programs(device: torch.device, cpu: int) -> int:
    """About two programs per SM on a CUDA device; `cpu` under Triton's interpreter (a CPU tensor)."""
    if device.type != "cuda":
        return cpu
    return 2 * sm_count(device)


def chunk_for_grid(chunks: tuple[int, ...], rows: int, width: int, target: int) -> int:
    """Elements of a row per program: the largest of `chunks` (largest first) whose grid (rows, chunks of the
    row's `width`) still has `target` programs; the smallest when none has. At a few rows a pass is one program's
    serial walk over its chunk, so shorter chunks fill the device. Shapes only."""
    for chunk in chunks:
        if rows * triton.cdiv(width, chunk) >= target:
            return chunk
    return chunks[-1]


@functools.cache
def _has_pdl(index: int) -> bool:  # griddepcontrol (Triton's gdc_wait / gdc_launch_dependents) needs sm_90 or newer
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` may launch with programmatic dependent launch: a CUDA device of compute
    capability 9.0 or newer (Hopper on); never under Triton's interpreter."""
    if device.type != "cuda":
        return False
    return _has_pdl(_index(device))


def one_wave_pdl(device: torch.device, programs: int) -> bool:
    """Whether a latency-bound kernel of `programs` programs launches with programmatic dependent launch: where
    supported (pdl_supported), when its grid fits in one wave (one program per SM or fewer). Such a kernel lets the
    next one launch at once and waits for the previous one's outputs before its first read (`gdc_wait`;
    kernels/triton_gemv.py has the rules), so the next kernel's launch, and a GEMV's first weight tile, overlap
    it. Shapes and the device only."""
    return pdl_supported(device) and programs <= sm_count(device)


PDL_MAX_ROWS = 128  # rows (tokens, pairs, queries) up to which a launch is decode-sized: latency-bound


def grid_pdl(device: torch.device, programs: int, rows: int) -> int:
    """How a kernel of `programs` programs over `rows` rows launches (its PDL constexpr): 0 without programmatic
    dependent launch (unsupported: pdl_supported, or more than PDL_MAX_ROWS rows: prefill-sized launches, which
    latency does not bound); 1 when its grid fits in one wave (one_wave_pdl): the next kernel may launch at once
    (`pdl_wait`); 2 for a grid of more waves: launched with PDL (it waits for its inputs), but the next kernel may
    launch only once this one is done, so that kernel's waiting programs never hold SMs this grid's later waves
    need. Shapes and the device only."""
    if not pdl_supported(device) or rows > PDL_MAX_ROWS:
        return 0
    return 1 if programs <= sm_count(device) else 2


def pdl_kwargs(on: bool) -> dict:
    """The Triton launch option for programmatic dependent launch (none when off)."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def pdl_enter(GDC: tl.constexpr):
    """In a kernel launched with PDL (GDC; one_wave_pdl): let the next kernel launch at once, then wait until the
    previous one's outputs are complete and visible. Call it before the first read of anything another kernel
    writes (reads of weights may come before it) and before any store."""
    if GDC:
        pdl_wait(1)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """In a kernel launched with PDL mode PDL (grid_pdl; 0: nothing): mode 1 lets the next kernel launch at once;
    both wait until the previous kernel's outputs are complete and visible. Call it before the first read of
    anything another kernel writes and before any store."""
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL != 0:
        tl.extra.cuda.gdc_wait()
