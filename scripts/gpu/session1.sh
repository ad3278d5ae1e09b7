#!/usr/bin/env bash
# GPU session 1: kernel + graph tests, then the phase benchmark on Llama-3.1-8B shapes and on SmolLM2-135M.
. scripts/gpu/env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
git log -1 --format=%H 2>/dev/null | tee -a "$OUT/gpu.txt"
echo "== GPU tests"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_triton_attention.py \
  tests/test_triton_accept.py tests/test_triton_kernels.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
echo "== bench-phases llama-3.1-8b"
timeout 240 python3 -m specserve.cli bench-phases --preset llama-3.1-8b --batch-sizes 1,8,32,64 \
  --output-file "$OUT/phases.jsonl" 2>&1 | tee "$OUT/phases_8b.log" | grep -v Warning | tail -32
echo "== bench-phases smollm2"
timeout 150 python3 -m specserve.cli bench-phases --model-path /tmp/smollm2.gguf --batch-sizes 1,8,32,64 \
  --output-file "$OUT/phases.jsonl" 2>&1 | tee "$OUT/phases_smollm2.log" | grep -v Warning | tail -32
