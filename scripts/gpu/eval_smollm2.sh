#!/usr/bin/env bash
# The trained SmolLM2 head end to end on a GPU: acceptance per draft step count on held-out prompt sets, and
# tokens/s speculative against plain (`specserve bench-spec`); with WITH_8B=1 also the phase benchmark on
# Llama-3.1-8B shapes (`specserve bench-phases`, random bf16 weights built on the GPU).
#
# Usage: bash scripts/gpu/eval_smollm2.sh [-h]
# Environment: DATA (prompt files, default .gpu-data), HEAD (the head's folder, default /tmp/head),
#   ACCEPT_STEPS (default 1,2,3,4,5), WITH_8B (1: also the 8B phases).
# Output: $OUT/bench_spec.jsonl and .log; with WITH_8B=1 $OUT/phases.jsonl and phases_8b.log.
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0; fi
. scripts/gpu/env.sh
D=${DATA:-.gpu-data}
HEAD=${HEAD:-/tmp/head}
timeout 560 python3 -m specserve.cli bench-spec --model-path /tmp/smollm2.gguf --speculative-draft-model-path "$HEAD" \
  --prompts $D/gsm8k_test.jsonl $D/qa_question.jsonl $D/sum_question.jsonl $D/humaneval_question.jsonl \
  --prompts-per-file 40 --max-new-tokens 256 --accept-steps "${ACCEPT_STEPS-1,2,3,4,5}" --speed-steps 2,3,4 --concurrency 1,8 \
  --speed-prompts 16 --context-length 4096 --output-file "$OUT/bench_spec.jsonl" 2>&1 | grep -v -i warn \
  | tee "$OUT/bench_spec.log" | tail -30
if [ "${WITH_8B:-0}" = 1 ]; then
  timeout 280 python3 -m specserve.cli bench-phases --preset llama-3.1-8b --batch-sizes 1,8,32,64 \
    --output-file "$OUT/phases.jsonl" 2>&1 | tee "$OUT/phases_8b.log" | grep -v -i warn | tail -40
fi
