#!/usr/bin/env bash
# FP8 on a GPU in one call (issue 48): the FP8 GPU tests, then the 8B decode step FP8 vs bf16 with both weight
# layouts (the batch-1 target), the linear layers at decode / verify / prefill rows and the one-row GEMV
# launch sweep. Sized for one 600 s device call on an H100 or H200; each step has its own time limit, so a slow one
# costs its own results only.
#
# Usage: bash scripts/gpu/fp8_suite.sh [-h]
# Environment: STEPS (which steps, default "tests decode gemm sweep"; "moe" adds bench_moe.py --fp8 with and without
#   --per-channel).
# Output: $OUT/fp8_tests.log, decode_{block,channel}.{txt,jsonl}, gemm.txt, sweep.txt, moe*.txt; a summary on stdout.
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0; fi
. scripts/gpu/env.sh
export PYTHONPATH=$PWD/tests:$PYTHONPATH
STEPS=${STEPS:-tests decode gemm sweep}
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if has tests; then
  timeout 200 python3 -m pytest -q --no-header -p no:cacheprovider --tb=short tests/test_fp8_gemm.py \
    tests/test_triton_moe_fp8.py tests/test_gpu_fp8_kv.py "tests/test_gpu_mla.py" -k "not gpu_mla or fp8_latent" \
    > "$OUT/fp8_tests.log" 2>&1
  grep -E "passed|failed|FAILED" "$OUT/fp8_tests.log" | tail -12
fi
if has decode; then
  for scheme in block channel; do
    timeout 90 python3 scripts/gpu/bench_fp8_decode.py --preset llama-3.1-8b --scheme "$scheme" --batch-sizes 1,32 \
      --output-file "$OUT/decode_$scheme.jsonl" > "$OUT/decode_$scheme.txt" 2>&1
    echo "== decode, $scheme"; grep "bs=" "$OUT/decode_$scheme.txt"
  done
fi
if has gemm; then
  timeout 60 python3 scripts/gpu/bench_fp8_gemm.py --rows 1 4 16 64 256 4096 > "$OUT/gemm.txt" 2>&1
  echo "== linear layers"; grep -v -i warn "$OUT/gemm.txt" | tail -26
fi
if has sweep; then
  timeout 150 python3 scripts/gpu/sweep_fp8_gemv.py --rows 1 4 --iters 10 --top 2 --output-file "$OUT/sweep.txt" \
    > /dev/null 2>&1
  echo "== GEMV sweep"; grep -v -i warn "$OUT/sweep.txt" | tail -30
fi
if has moe; then
  timeout 60 python3 scripts/gpu/bench_moe.py --fp8 --output-file "$OUT/moe.txt" > /dev/null 2>&1
  timeout 60 python3 scripts/gpu/bench_moe.py --fp8 --per-channel --output-file "$OUT/moe_channel.txt" > /dev/null 2>&1
  echo "== FP8 MoE"; tail -8 "$OUT/moe.txt" "$OUT/moe_channel.txt"
fi
