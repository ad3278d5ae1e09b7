"""The Triton kernels that CI runs only under the interpreter also compile for the GPU (sm_90): see
tests/compile_for_gpu.py. A kernel the interpreter runs but the GPU compiler rejects would otherwise pass every CPU
test and break every GPU run (it happened: a tl.static_range bound that was not a constexpr)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(__file__)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when it is unset; 1 is its default
    proc = subprocess.run([sys.executable, os.path.join(here, "compile_for_gpu.py")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert len(lines) >= 32 and all("chars of PTX" in line for line in lines), proc.stdout[-2000:]
