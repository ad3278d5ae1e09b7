#!/usr/bin/env bash
# Issue 14 (and 17's sampled one-graph step) on the H200, one step per call:
#   tests    the MLA / DSA GPU tests, the Triton MLA and indexer kernels on the GPU, the sampled one-graph spec step
#            (chi-square on CUDA), then the attention / MoE kernels again (they share kernels/triton_dot.py);
#   kernels  scripts/gpu/bench_mla.py (MLA dense and sparse, indexer; GLM-5 shapes, one layer);
#   phases   bench-phases on GLM-5 shapes (4 layers + MTP) at a 4k prefix, Triton backends, then the torch reference;
#   32k      sparse (GLM-5, DSA top 2048) against dense MLA (same shapes, no indexer) at a 32k prefix, Triton;
#   round2   32k, then GLM-5 at full depth (78 layers, 8 routed experts) at 4k, the torch reference at batch 1 and a
#            kernel profile of decode / verify at batch 1.
# Random bf16 weights built on the GPU; nothing carried.
. scripts/gpu/env.sh
phases() {  # preset backend prefix context batch-sizes iters tag
  timeout "${TLIM:-290}" python3 -m specserve.cli bench-phases --preset "$1" --attention-backend "$2" --batch-sizes "$5" \
    --prefix-len "$3" --context-length "$4" --iters "$6" --idle-steps 0 --prefill-tokens 0 \
    --project-accept-lengths 2.5,3.0 --output-file "$OUT/phases_$7.jsonl" 2>&1 | tee "$OUT/phases_$7.log" \
    | grep -v -i warn | tail -34
}
case "${1:-}" in
  tests)
    timeout 560 python3 -m pytest -q -p no:cacheprovider -rs --durations=8 tests/test_gpu_mla.py \
      tests/test_triton_mla.py tests/test_triton_indexer.py tests/test_sampling_lossless.py \
      tests/test_triton_attention.py tests/test_triton_moe.py tests/test_triton_kernels.py \
      2>&1 | tee "$OUT/gpu_mla_tests.log" | grep -v -i warn | tail -30
    ;;
  kernels)
    timeout 420 python3 scripts/gpu/bench_mla.py 2>&1 | tee "$OUT/bench_mla.log" | grep -v -i warn | tail -70
    ;;
  phases)
    phases glm-5 triton 4096 8192 1,8,32,64 10 glm5_triton_4k
    phases glm-5 torch 4096 8192 1,8 6 glm5_torch_4k
    ;;
  32k)
    phases glm-5 triton 32000 32768 1,8,32 6 glm5_triton_32k
    phases glm-5-dense-mla triton 32000 32768 1,8,32 6 glm5dense_triton_32k
    ;;
  round2)
    TLIM=150 phases glm-5 triton 32000 32768 1,8,32 6 glm5_triton_32k
    TLIM=150 phases glm-5-dense-mla triton 32000 32768 1,8,32 6 glm5dense_triton_32k
    TLIM=170 phases glm-5-78l-e8 triton 4096 8192 1,8 8 glm5full_4k
    TLIM=60 phases glm-5 torch 4096 8192 1 6 glm5_torch_4k
    timeout 60 python3 scripts/gpu/profile_phase.py --preset glm-5 --phases decode,target_verify,draft_decode \
      --bs 1 --top 14 2>&1 | tee "$OUT/profile_glm5.log" | grep -v -i warn | tail -50
    ;;
  round3)  # after the Triton top-k: its tests, the kernels, GLM-5 phases at 4k and 32k, full depth at batch 1
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_triton_topk.py tests/test_triton_mla.py \
      tests/test_gpu_mla.py 2>&1 | tee "$OUT/gpu_tests3.log" | grep -v -i warn | tail -8
    timeout 150 python3 scripts/gpu/bench_mla.py 2>&1 | tee "$OUT/bench_mla3.log" | grep -v -i warn | tail -60
    TLIM=70 phases glm-5 triton 4096 8192 1,8,32,64 10 glm5_triton_4k_r3
    TLIM=70 phases glm-5 triton 32000 32768 1,8,32 6 glm5_triton_32k_r3
    TLIM=120 phases glm-5-78l-e8 triton 4096 8192 1,8 8 glm5full_4k_r3
    ;;
  *) echo "usage: $0 tests|kernels|phases|32k|round2|round3" >&2; exit 2 ;;
esac
