#!/usr/bin/env bash
# Issue 12 on the H200, one step per call: `tests` (GPU tests + the fused-MoE benchmark), `moe` (bench-phases on
# Qwen3-30B-A3B shapes), `dense` (bench-phases on Llama-3.1-8B shapes, this tree and the previous commit's copy in
# .bench_prev/, carried, side by side in one lease). Random bf16 weights built on the GPU; nothing else carried.
. scripts/gpu/env.sh
case "${1:-}" in
  tests)
    timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_triton_moe.py \
      tests/test_triton_attention.py tests/test_triton_kernels.py tests/test_triton_accept.py \
      tests/test_triton_top1.py tests/test_triton_ngram.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
    timeout 200 python3 scripts/gpu/bench_moe.py 2>&1 | tee "$OUT/bench_moe.log" | grep -v -i warn | tail -30
    ;;
  moe)
    timeout 560 python3 -m specserve.cli bench-phases --preset qwen3-30b-a3b --batch-sizes 1,8,32,64 --iters 20 \
      --idle-steps 20 --output-file "$OUT/phases_moe.jsonl" 2>&1 | tee "$OUT/phases_moe.log" | grep -v -i warn \
      | tail -45
    ;;
  dense)
    for tree in . .bench_prev; do
      echo "=== tree: $tree ==="
      (cd "$tree" && PYTHONPATH=$PWD:/tmp/site timeout 270 python3 -m specserve.cli bench-phases \
        --preset llama-3.1-8b --batch-sizes 1,32 --iters 30 --idle-steps 20 2>&1 | grep -v -i warn | tail -22) \
        | tee -a "$OUT/phases_dense.log"
    done
    ;;
  *) echo "usage: $0 tests|moe|dense" >&2; exit 2 ;;
esac
