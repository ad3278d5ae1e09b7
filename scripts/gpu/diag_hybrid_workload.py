"""Where a hybrid target's greedy tokens leave transformers' argmax in the mixed retraction workload
(tests/test_kv_accounting.py _workload) on this device: for each engine variant, the first token per request whose
logit is more than 1e-3 below the teacher-forced maximum. Isolates graphs, kernels and speculation.

    python3 scripts/gpu/diag_hybrid_workload.py
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

from hybrid_helpers import build_tiny_hybrid  # noqa: E402
from test_kv_accounting import _workload  # noqa: E402
from test_qwen3_next import _hf, _hf_logits  # noqa: E402

from specserve import Engine  # noqa: E402

# (engine arguments, workload change): "greedy" makes every request greedy, "alone" runs each request by itself
VARIANTS = [({}, None), ({}, "greedy"), ({}, "alone"), ({"speculative_num_steps": 3}, "greedy")]


def main() -> None:
    path = build_tiny_hybrid("/tmp/diag_hybrid", "qwen3_next", seed=41, mtp=True)
    prompts, params = _workload()
    hf = _hf(path, "qwen3_next")
    for var, change in VARIANTS:
        kw = dict(context_length=128, chunked_prefill_size=32, max_running_requests=8, cuda_graph_bs=[1, 2, 4, 8],
                  schedule_conservativeness=0.0, max_total_tokens=8192, dtype="float32", **var)
        if "speculative_num_steps" in kw:
            kw["speculative_algorithm"] = "MTP"
        eng = Engine(model_path=path, **kw)
        sps = [{k: v for k, v in sp.items() if k not in ("temperature", "seed")} | {"temperature": 0.0}
               for sp in params] if change == "greedy" else params
        if change == "alone":
            out = [eng.generate(input_ids=[p], sampling_params=[sp])[0] for p, sp in zip(prompts, sps)]
        else:
            out = eng.generate(input_ids=prompts, sampling_params=sps)
        params_now = sps
        bad = []
        for i, (p, sp, o) in enumerate(zip(prompts, params_now, out)):
            if sp.get("temperature"):
                continue
            ids = o["output_ids"]
            logits = _hf_logits(hf, p + ids)[len(p) - 1:-1]
            top = logits.max(dim=-1).values
            chosen = logits.gather(1, torch.tensor(ids)[:, None])[:, 0]
            off = (chosen < top - 1e-3).nonzero()
            if len(off):
                j = int(off[0])
                bad.append({"req": i, "prompt_len": len(p), "at": j, "of": len(ids),
                            "margin": round(float(top[j] - chosen[j]), 4)})
        print(json.dumps({"variant": var, "change": change, "bad": bad}))
        eng.shutdown() if hasattr(eng, "shutdown") else None
        del eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
