#!/usr/bin/env bash
# GPU: the trained head end to end (acceptance per N on held-out sets; tokens/s spec vs plain), then the phase
# benchmark on Llama-3.1-8B shapes.
. scripts/gpu/env.sh
D=${DATA:-.gpu-data}
HEAD=${HEAD:-/tmp/head}
timeout 560 python3 -m specserve.cli bench-spec --model-path /tmp/smollm2.gguf --speculative-draft-model-path "$HEAD" \
  --prompts $D/gsm8k_test.jsonl $D/qa_question.jsonl $D/sum_question.jsonl $D/humaneval_question.jsonl \
  --prompts-per-file 40 --max-new-tokens 256 --accept-steps "${ACCEPT_STEPS-1,2,3,4,5}" --speed-steps 2,3,4 --concurrency 1,8 \
  --speed-prompts 16 --context-length 4096 --output-file "$OUT/bench_spec.jsonl" 2>&1 | grep -v -i warn \
  | tee "$OUT/bench_spec.log" | tail -30
[ "${WITH_8B:-0}" = 1 ] && bash scripts/gpu/phases_8b.sh
