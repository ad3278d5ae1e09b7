#!/usr/bin/env bash
# Sourced at the start of every GPU command of the scripts here: joins the SmolLM2 GGUF when it came in two parts
# (/tmp/keep/part00 plus .smollm2-parts/b/part0*), installs the wheels carried in .smollm2-parts/wheels into
# /tmp/site, puts the checkout and /tmp/site on PYTHONPATH, and sets OUT (default /tmp/out), the folder results go to.
#
# Usage: . scripts/gpu/env.sh        (from the repository root)
#        bash scripts/gpu/env.sh -h  (this help)
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
  return 0 2>/dev/null || exit 0
fi
set -u
if [ ! -f /tmp/smollm2.gguf ] && [ -f /tmp/keep/part00 ] && ls .smollm2-parts/b/part0* >/dev/null 2>&1; then
  cat /tmp/keep/part00 .smollm2-parts/b/part0* > /tmp/smollm2.gguf
fi
if [ -d .smollm2-parts/wheels ] && [ ! -d /tmp/site/gguf ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .smollm2-parts/wheels/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
