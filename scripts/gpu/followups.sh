#!/usr/bin/env bash
# GPU checks written in a session that had no device time left to run them:
#   adaptive  the adaptive-speculation plain-step graphs and forced interleavings (on by default on CUDA), dense and
#             GLM-5, then the dense GPU tests for regressions;
#   tp        tensor parallelism over NCCL (needs a kind with 2+ GPUs): tests/test_gpu_tp.py.
. scripts/gpu/env.sh
case "${1:-}" in
  adaptive)
    timeout 560 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_gpu_mla.py \
      2>&1 | tee "$OUT/gpu_adaptive.log" | grep -v -i warn | tail -20
    ;;
  tp)
    timeout 560 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_tp.py 2>&1 | tee "$OUT/gpu_tp.log" \
      | grep -v -i warn | tail -20
    ;;
  *) echo "usage: $0 adaptive|tp" >&2; exit 2 ;;
esac
