"""kernels/launch.py: launch sizing and when kernels launch with programmatic dependent launch (PDL)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from specserve.kernels.launch import (  # noqa: E402
    chunk_for_grid,
    one_wave_pdl,
    pdl_kwargs,
    pdl_supported,
    target_programs,
)


def test_chunk_for_grid_takes_the_largest_chunk_that_fills_the_target():
    chunks = (4096, 2048, 1024)
    assert chunk_for_grid(chunks, 40, 49152, 264) == 4096  # 40 x 12 programs >= 264
    assert chunk_for_grid(chunks, 5, 49152, 264) == 1024  # none fills: the smallest
    assert chunk_for_grid(chunks, 11, 49152, 264) == 2048  # 11 x 24 = 264
    assert chunk_for_grid(chunks, 10, 49152, 264) == 1024  # 10 x 24 = 240 < 264


def test_no_pdl_off_cuda_and_none_before_hopper():
    cpu = torch.device("cpu")
    assert target_programs(cpu, cpu=8) == 8
    assert not pdl_supported(cpu) and not one_wave_pdl(cpu, 1)
    assert pdl_kwargs(False) == {} and pdl_kwargs(True) == {"launch_pdl": True}
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert pdl_supported(dev) == hopper
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert one_wave_pdl(dev, sms) == hopper and not one_wave_pdl(dev, sms + 1)
