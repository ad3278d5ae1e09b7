#!/usr/bin/env bash
# GPU call 1 of the shipped head: self-distil SmolLM2-135M-Instruct (the target's own responses to the training
# prompts and to reading prompts) into /tmp/head/selfdistill, and send the cache back in 15 MB parts ($OUT/sd.*).
. scripts/gpu/env.sh
. scripts/gpu/smollm2_head_args.sh
timeout 590 python3 -m specserve.cli train-mtp "${GEN_ARGS[@]}" "${ENGINE_ARGS[@]}" --generate-only 2>&1 \
  | grep -v -i "warn" | tee "$OUT/selfdistill.log" | tail -15
ls -la /tmp/head/selfdistill
cp /tmp/head/selfdistill/selfdistill.meta.json "$OUT/sd.meta.json"
split -b 15m /tmp/head/selfdistill/selfdistill.jsonl.gz "$OUT/sd.part-"
