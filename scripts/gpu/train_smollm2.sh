#!/usr/bin/env bash
# Train the shipped SmolLM2-135M MTP head on a GPU, in two steps that may run as two separate GPU commands:
#   selfdistill: generate the target's own responses to the training prompts and to reading prompts into
#                /tmp/head/selfdistill (`specserve train-mtp --generate-only`), and copy the cache to $OUT in 15 MB
#                parts (sd.part-*, sd.meta.json);
#   train:       train the head from that cache (found in /tmp/head/selfdistill on the same machine, or rebuilt from
#                the parts carried in .gpu-sd/), into /tmp/head (copies of its files in $OUT).
# Both steps pass the same generation settings: they key the data cache. Prompt files are read from .gpu-data/.
#
# Usage: bash scripts/gpu/train_smollm2.sh [selfdistill|train]   (default: train)
#        bash scripts/gpu/train_smollm2.sh -h
# Environment: NUM_PROMPTS (0: all), READING (reading prompts, default 4000), GEN_BUDGET (s, default 450);
#   train: TRAIN_BUDGET (s, default 420), LR (default 5e-4), WARMUP (default 100), VOCAB (draft vocabulary, 0: the
#   target's), INIT (a head folder to continue from), AUX (auto or layer ids: an EAGLE-3 style head reading those
#   target layers too), GREEDY_ONLY (set: greedy responses only).
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0; fi
STEP=${1:-train}
. scripts/gpu/env.sh
D=.gpu-data
GEN_ARGS=(--model-path /tmp/smollm2.gguf
  --prompts $D/codegen-instruct.json $D/roleplay-instruct.json $D/gsm8k_train.jsonl $D/alpaca_question.jsonl
  --output /tmp/head --num-prompts "${NUM_PROMPTS:-0}" --reading-prompts "${READING:-4000}" --reading-chars 1200,5000
  --max-new-tokens 256 --sampled-fraction 0.3 --extra-sampled-responses 1
  --generation-time-budget "${GEN_BUDGET:-450}" --max-seq-len 2048 --seed 0)
ENGINE_ARGS=(--max-running-requests 256 --cuda-graph-max-bs 256 --context-length 2304 --chunked-prefill-size 16384)
case "$STEP" in
  selfdistill)
    timeout 590 python3 -m specserve.cli train-mtp "${GEN_ARGS[@]}" "${ENGINE_ARGS[@]}" --generate-only 2>&1 \
      | grep -v -i "warn" | tee "$OUT/selfdistill.log" | tail -15
    ls -la /tmp/head/selfdistill
    cp /tmp/head/selfdistill/selfdistill.meta.json "$OUT/sd.meta.json"
    split -b 15m /tmp/head/selfdistill/selfdistill.jsonl.gz "$OUT/sd.part-"
    ;;
  train)
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
    ;;
  *) echo "unknown step '$STEP' (selfdistill or train; -h for help)" >&2; exit 2 ;;
esac
