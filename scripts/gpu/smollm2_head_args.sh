# Settings of the shipped SmolLM2 head, sourced by selfdistill_smollm2.sh (call 1: generation) and
# train_smollm2.sh (call 2: training). Both must pass the same generation settings: they key the data cache in
# /tmp/head/selfdistill. Prompt files: .gpu-data/ holds copies of ../shared/data (prompts, GSM8K train).
D=.gpu-data
GEN_ARGS=(--model-path /tmp/smollm2.gguf
  --prompts $D/codegen-instruct.json $D/roleplay-instruct.json $D/gsm8k_train.jsonl $D/alpaca_question.jsonl
  --output /tmp/head --num-prompts "${NUM_PROMPTS:-0}" --reading-prompts "${READING:-4000}" --reading-chars 1200,5000
  --max-new-tokens 256 --sampled-fraction 0.3 --extra-sampled-responses 1
  --generation-time-budget "${GEN_BUDGET:-450}" --max-seq-len 2048 --seed 0)
ENGINE_ARGS=(--max-running-requests 256 --cuda-graph-max-bs 256 --context-length 2304 --chunked-prefill-size 16384)
