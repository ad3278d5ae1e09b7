#!/usr/bin/env bash
# GPU: self-distil SmolLM2-135M-Instruct and train its MTP head (the shipped one). Data files are carried in
# .gpu-data/ (copies of ../shared/data: prompts and GSM8K train/test). Output: /tmp/head (+ copies in $OUT).
. scripts/gpu/env.sh
D=.gpu-data
timeout 590 python3 -m specserve.cli train-mtp --model-path /tmp/smollm2.gguf \
  --prompts $D/codegen-instruct.json $D/roleplay-instruct.json $D/gsm8k_train.jsonl $D/alpaca_question.jsonl \
  --output /tmp/head --num-prompts "${NUM_PROMPTS:-6000}" --max-new-tokens 256 --sampled-fraction 0.3 \
  --chain-steps 4 --train-steps 6000 --train-time-budget "${TRAIN_BUDGET:-1000}" --batch-size 32 \
  --max-seq-len 768 --lr 5e-4 --warmup-steps 40 --draft-vocab-size "${VOCAB:-16384}" --eval-num-steps "" \
  --max-running-requests 256 --cuda-graph-max-bs 256 --context-length 1024 2>&1 \
  | grep -v -i "warn" | tee "$OUT/train.log" | tail -25
cp /tmp/head/config.json /tmp/head/model.safetensors /tmp/head/report.json "$OUT/" 2>/dev/null
ls -la /tmp/head
