#!/usr/bin/env bash
# The phase benchmark on Llama-3.1-8B shapes (random bf16 weights built on the GPU; nothing carried).
. scripts/gpu/env.sh
timeout 280 python3 -m specserve.cli bench-phases --preset llama-3.1-8b --batch-sizes 1,8,32,64 \
  --output-file "$OUT/phases.jsonl" 2>&1 | tee "$OUT/phases_8b.log" | grep -v -i warn | tail -40
