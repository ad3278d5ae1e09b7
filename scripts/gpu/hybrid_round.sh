#!/usr/bin/env bash
# Issue 13 on the H200, one step per call: `tests` (hybrid-family and GDN-kernel GPU tests, then the dense GPU
# tests for regressions), `phases` (bench-phases on Qwen3-Next-80B-A3B shapes, 24 layers, 1k context),
# `phases32k` (the same at a 32k-token prefix), `kernels` (GDN kernel times against their bandwidth floor).
# `profile` (kernel breakdown of decode and verify at batch 1), `mla` (issue 14: the MLA GPU tests, GLM-5 phases). Random bf16 weights built on the GPU; nothing carried.
. scripts/gpu/env.sh
case "${1:-}" in
  tests)
    files=$(ls tests/test_triton_gdn*.py tests/test_gpu_hybrid.py tests/test_gpu.py tests/test_triton_kernels.py)
    timeout 420 python3 -m pytest -q -p no:cacheprovider -rs $files 2>&1 | tee "$OUT/gpu_tests.log" \
      | grep -v -i warn | tail -25
    ;;
  phases)
    timeout 580 python3 -m specserve.cli bench-phases --preset qwen3-next-80b-a3b --batch-sizes 1,8,32,64 \
      --prefix-len 1024 --context-length 2048 --iters 20 --idle-steps 20 --project-accept-lengths 3.0,3.7 \
      --output-file "$OUT/phases_next.jsonl" 2>&1 | tee "$OUT/phases_next.log" | grep -v -i warn | tail -50
    ;;
  phases32k)
    timeout 580 python3 -m specserve.cli bench-phases --preset qwen3-next-80b-a3b --batch-sizes 1,8,32 \
      --prefix-len 32000 --context-length 32768 --iters 10 --idle-steps 0 --project-accept-lengths 3.0,3.7 \
      --output-file "$OUT/phases_next32k.jsonl" 2>&1 | tee "$OUT/phases_next32k.log" | grep -v -i warn | tail -40
    ;;
  kernels)
    timeout 300 python3 scripts/gpu/bench_gdn.py 2>&1 | tee "$OUT/bench_gdn.log" | grep -v -i warn | tail -40
    ;;
  mla)
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_mla.py 2>&1 | tee "$OUT/gpu_mla.log" \
      | grep -v -i warn | tail -15
    timeout 280 python3 -m specserve.cli bench-phases --preset glm-5 --batch-sizes 1,8,32 --prefix-len 4096 \
      --context-length 8192 --iters 10 --idle-steps 0 --prefill-tokens 0 2>&1 | grep -v -i warn | tail -30
    ;;
  profile)
    timeout 300 python3 scripts/gpu/profile_phase.py --preset qwen3-next-80b-a3b --phases decode,target_verify \
      --bs 1 2>&1 | tee "$OUT/profile.log" | grep -v -i warn | tail -45
    ;;
  *) echo "usage: $0 tests|phases|phases32k|kernels|profile|mla" >&2; exit 2 ;;
esac
