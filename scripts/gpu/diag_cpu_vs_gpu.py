"""Our engine on the CPU and on the GPU (float32, greedy, each request alone) against transformers for the hybrid
mixed workload's prompts: per request, the first token where each run leaves transformers' argmax, and the largest
|logit| gap between the GPU and CPU prefill logits, layer by layer of the target's output.

    python3 scripts/gpu/diag_cpu_vs_gpu.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

from hybrid_helpers import build_tiny_hybrid  # noqa: E402
from test_kv_accounting import _workload  # noqa: E402
from test_qwen3_next import _hf, _hf_logits  # noqa: E402

from specserve.models.loader import ModelSource, load_target  # noqa: E402


def main() -> None:
    path = build_tiny_hybrid("/tmp/diag_hybrid", "qwen3_next", seed=41, mtp=True)
    prompts, _ = _workload()
    hf = _hf(path, "qwen3_next")
    from specserve.engine.model_runner import ModelRunner
    from specserve.graphs.prefill import ExtendBatch
    from specserve.kvcache.manager import KVHandle
    from specserve.server_args import ServerArgs

    runs = {}
    for dev in ("cpu", "cuda"):
        d = torch.device(dev)
        t = load_target(ModelSource.resolve(path), torch.float32, d, 600)
        mr = ModelRunner(ServerArgs(model_path=path, max_total_tokens=4096, disable_cuda_graph=True,
                                    cuda_graph_max_prefill_tokens=0), t.model, t.config, None, d, torch.float32, 256)
        outs = []
        for p in prompts:
            h = KVHandle()
            assert mr.kv.assign_row(h) and mr.kv.ensure([h], [len(p)])
            x = ExtendBatch(torch.tensor(p, device=d), torch.arange(len(p), device=d),
                            mr.req_to_token.table[h.row, :len(p)], [h.row], [len(p)], [len(p)])
            with torch.no_grad():
                outs.append(t.model.compute_logits(mr.prefill.run(x)).cpu())
            mr.kv.release(h)
        runs[dev] = outs
    for i, p in enumerate(prompts):
        ref = _hf_logits(hf, p)
        c, g = runs["cpu"][i], runs["cuda"][i]
        print(f"req {i:2d} len {len(p):2d}: |cpu-hf| {float((c - ref).abs().max()):.2e} |gpu-hf| "
              f"{float((g - ref).abs().max()):.2e} |gpu-cpu| {float((g - c).abs().max()):.2e} argmax last "
              f"hf {int(ref[-1].argmax())} cpu {int(c[-1].argmax())} gpu {int(g[-1].argmax())}")


if __name__ == "__main__":
    main()
