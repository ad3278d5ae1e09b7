#!/usr/bin/env bash
# GPU call 2 of the shipped head: train it from the self-distilled data of call 1 (selfdistill_smollm2.sh), found
# in /tmp/head/selfdistill on the same warm machine, or rebuilt from parts carried in .gpu-sd/ (call 1's $OUT).
# INIT=folder continues from a head trained before (its draft vocabulary is kept). AUX=auto (or layer ids) trains an
# EAGLE-3 style head that reads those target layers too. Output: /tmp/head (+ copies in $OUT).
. scripts/gpu/env.sh
. scripts/gpu/smollm2_head_args.sh
if [ ! -f /tmp/head/selfdistill/selfdistill.meta.json ] && [ -d .gpu-sd ]; then
  mkdir -p /tmp/head/selfdistill
  cat .gpu-sd/sd.part-* > /tmp/head/selfdistill/selfdistill.jsonl.gz
  cp .gpu-sd/sd.meta.json /tmp/head/selfdistill/selfdistill.meta.json
fi
timeout 590 python3 -m specserve.cli train-mtp "${GEN_ARGS[@]}" "${ENGINE_ARGS[@]}" \
  --chain-steps 4 --train-steps 100000 --train-time-budget "${TRAIN_BUDGET:-420}" --batch-tokens 16384 \
  --lr "${LR:-5e-4}" --warmup-steps "${WARMUP:-100}" --draft-vocab-size "${VOCAB:-0}" --eval-num-steps "" \
  ${INIT:+--init-draft "$INIT"} ${GREEDY_ONLY:+--greedy-only} ${AUX:+--aux-hidden-layers "$AUX"} 2>&1 \
  | grep -v -i "warn" | tee "$OUT/train.log" | tail -25
cp /tmp/head/config.json /tmp/head/model.safetensors /tmp/head/report.json "$OUT/" 2>/dev/null
ls -la /tmp/head
