# Sourced at the start of every device command: joins the SmolLM2 GGUF (sent in two parts, see README
# "Benchmarks on the GPU"), installs the carried wheels, and sets PYTHONPATH to the checkout.
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
