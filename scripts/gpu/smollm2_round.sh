#!/usr/bin/env bash
# Issue 17 on the H200 with SmolLM2-135M and the shipped head, in calls on one warm machine (the GGUF travels in
# parts, see env.sh):
#   keep [tests]    carry .smollm2-parts/a: keep part00 in /tmp/keep (with tests: then the adaptive-speculation GPU tests)
#   join            carry .smollm2-parts/b: env.sh joins the GGUF
#   spec            carry .smollm2-parts/wheels and .gpu-data: bench-spec greedy and sampled (T 0.7, top-p 0.95),
#                   plain vs MTP N = 4 with context lookup (the embedded default), concurrency 1 and 8
#   qspec           carry .smollm2-parts/wheels and .gpu-data: sampled (T 0.7, top-p 0.95) plain vs MTP N = 2, 3, 4
#                   with argmax drafts vs drafts drawn from the head (--compare-draft-sampling), concurrency 1
#                   (sampled drafts accept less per position, so a shorter N may pay more than N = 4)
#   sweep ISLS CONC carry .smollm2-parts/wheels: a speculating and a plain server side by side, then
#                   `specserve bench-compare` over input lengths ISLS x concurrency CONC (output 512, 2 x conc prompts)
# The servers' wheels beside gguf's in .smollm2-parts/wheels (the device has Python 3.12, aiohttp, no fastapi):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     -d .smollm2-parts/wheels fastapi starlette uvicorn h11 click pydantic pydantic-core annotated-types \
#     typing-inspection typing-extensions opentelemetry-api annotated-doc
# (fastapi 0.165 imports opentelemetry; after a failed install on a warm machine, `rm -rf /tmp/site` first).
. scripts/gpu/env.sh
D=.gpu-data
case "${1:-}" in
  keep)
    mkdir -p /tmp/keep && cp .smollm2-parts/a/part00 /tmp/keep/ && ls -la /tmp/keep
    [ "${2:-}" = tests ] && bash scripts/gpu/followups.sh adaptive
    ;;
  join)
    ls -la /tmp/smollm2.gguf && python3 -c "import gguf" 2>&1 | tail -1
    ;;
  spec)
    for samp in "" "--temperature 0.7 --top-p 0.95"; do
      # shellcheck disable=SC2086
      timeout 280 python3 -m specserve.cli bench-spec --model-path /tmp/smollm2.gguf \
        --speculative-draft-model-path specserve/assets/smollm2-135m-mtp --speculative-ngram-lookup \
        --prompts $D/gsm8k_test.jsonl $D/qa_question.jsonl $D/sum_question.jsonl $D/humaneval_question.jsonl \
        --prompts-per-file 40 --max-new-tokens 256 --accept-steps "" --speed-steps 4 --concurrency 1,8 \
        --speed-prompts 16 --repeats 3 --context-length 4096 $samp --output-file "$OUT/bench_spec.jsonl" 2>&1 \
        | grep -v -i warn | tail -8
    done
    ;;
  qspec)
    timeout 400 python3 -m specserve.cli bench-spec --model-path /tmp/smollm2.gguf \
      --speculative-draft-model-path specserve/assets/smollm2-135m-mtp --speculative-ngram-lookup \
      --prompts $D/gsm8k_test.jsonl $D/qa_question.jsonl $D/sum_question.jsonl $D/humaneval_question.jsonl \
      --prompts-per-file 40 --max-new-tokens 256 --accept-steps "" --speed-steps 2,3,4 --concurrency 1 \
      --speed-prompts 16 --repeats 2 --context-length 4096 --temperature 0.7 --top-p 0.95 --compare-draft-sampling \
      --output-file "$OUT/bench_qspec.jsonl" 2>&1 | grep -v "Warning" | tail -12
    ;;
  sweep)
    ISLS=${2:-1024,4096}
    CONC=${3:-1,8,32,64}
    MAXC=${CONC##*,}
    MAXL=$(( ${ISLS##*,} + 512 + 16 ))
    KV=$(( MAXC * MAXL + 4096 ))
    python3 -c "import fastapi, uvicorn, aiohttp, gguf, pydantic" || exit 3
    common=(--model-path /tmp/smollm2.gguf --context-length "$MAXL" --max-running-requests "$MAXC"
            --cuda-graph-max-bs "$MAXC" --max-total-tokens "$KV")
    python3 -m specserve.cli serve "${common[@]}" --speculative-algorithm MTP \
      --speculative-draft-model-path specserve/assets/smollm2-135m-mtp --speculative-ngram-lookup --port 30000 \
      > "$OUT/server_spec.log" 2>&1 &
    SPEC=$!
    python3 -m specserve.cli serve "${common[@]}" --port 30001 > "$OUT/server_plain.log" 2>&1 &
    PLAIN=$!
    for port in 30000 30001; do
      for _ in $(seq 1 240); do
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null \
          && break
        kill -0 $SPEC 2>/dev/null && kill -0 $PLAIN 2>/dev/null || { tail -20 "$OUT"/server_*.log; exit 4; }
        sleep 1
      done
    done
    timeout 520 python3 -m specserve.cli bench-compare --spec-url http://127.0.0.1:30000 \
      --plain-url http://127.0.0.1:30001 --input-lens "$ISLS" --output-len 512 --concurrency "$CONC" \
      --output-file "$OUT/compare.jsonl" --plot "$OUT/compare_${ISLS//,/_}.png" 2>&1 | grep -v -i warn | tail -24
    rc=${PIPESTATUS[0]}
    python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:30000/get_server_info').read()[:1200])"
    kill $SPEC $PLAIN; wait 2>/dev/null
    exit $rc
    ;;
  *) echo "usage: $0 keep|join|spec|qspec|sweep [ISLS] [CONC]" >&2; exit 2 ;;
esac
