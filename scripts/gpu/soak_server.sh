#!/usr/bin/env bash
# A soak test of the server on a GPU: `specserve serve` on SmolLM2-135M (the GGUF env.sh joins) with the shipped MTP
# head and a KV pool small enough to retract, then `specserve soak` against it (mixed routes, streaming, aborts, bad
# inputs, greedy re-runs, the pool back to idle, RSS). Needs the GGUF parts and wheels env.sh reads.
#
# Usage: bash scripts/gpu/soak_server.sh [num-requests (2000)] [concurrency (16)]
#        bash scripts/gpu/soak_server.sh -h
# Output: $OUT/soak.json (the soak's report) and $OUT/server.log; exit status: the soak's.
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0; fi
. scripts/gpu/env.sh
N=${1:-2000}
C=${2:-16}
python3 -c "import fastapi, uvicorn, aiohttp, gguf, pydantic" || exit 3
python3 -m specserve.cli serve --model-path /tmp/smollm2.gguf --speculative-algorithm MTP \
  --speculative-draft-model-path specserve/assets/smollm2-135m-mtp --speculative-num-steps 3 --port 30000 \
  --max-total-tokens 1200 --context-length 256 --max-running-requests 16 --schedule-conservativeness 0 \
  > "$OUT/server.log" 2>&1 &
PID=$!
for _ in $(seq 1 150); do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:30000/health', timeout=2)" 2>/dev/null && break
  kill -0 $PID 2>/dev/null || { tail -30 "$OUT/server.log"; exit 4; }
  sleep 1
done
timeout 400 python3 -m specserve.cli soak --base-url http://127.0.0.1:30000 --num-requests "$N" --concurrency "$C" \
  --seed 1 --server-pid $PID --output-file "$OUT/soak.json" 2>&1 | tail -25
rc=${PIPESTATUS[0]}
python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:30000/get_server_info').read()[:1500])"
kill $PID; wait $PID 2>/dev/null
grep -v -i warn "$OUT/server.log" | tail -5
exit $rc
