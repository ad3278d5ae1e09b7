"""Which GDN prefill kernel variant runs on this GPU, and how close to the reference: each variant in its own
process (an illegal memory access ends a CUDA context), real Qwen3-Next head shapes, T = 100 over two sequences.

    python3 scripts/gpu/diag_gdn_prefill.py
"""

from __future__ import annotations

import json
import subprocess
import sys

VARIANTS = [("conv", {}), ("delta", dict(chunk=64)), ("delta", dict(chunk=32)), ("delta", dict(chunk=16)),
            ("delta", dict(chunk=64, precision="tf32")), ("delta", dict(chunk=64, split=1)),
            ("delta", dict(chunk=64, block_v=64))]


def one(kind: str, kw: dict) -> None:
    import torch

    from specserve.kernels import reference as ref
    from specserve.kernels.triton_gdn_chunked import causal_conv_prefill_triton, gated_delta_rule_prefill_triton

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    hk, hv, d, t = 16, 32, 128, 100
    meta = (torch.tensor([1, 2], device=dev), torch.tensor([0, 1], device=dev), torch.tensor([0, 37], device=dev),
            torch.tensor([37, 63], device=dev))
    if kind == "conv":
        c = 2 * hk * d + hv * d
        x = torch.randn(t, c, generator=g, device=dev).bfloat16()
        w = torch.randn(c, 4, generator=g, device=dev).bfloat16()
        st = torch.randn(3, 2, 3, c, generator=g, device=dev).bfloat16()
        s2 = st.clone()
        out = causal_conv_prefill_triton(x, w, st, *meta, t)
        torch.cuda.synchronize()
        want = ref.causal_conv_states(x, w, s2, *meta, False)
        err = (out.float() - want.float()).abs().max().item()
        serr = (st.float() - s2.float()).abs().max().item()
    else:
        q = torch.randn(t, hk, d, generator=g, device=dev).bfloat16()
        k = torch.randn(t, hk, d, generator=g, device=dev).bfloat16()
        v = torch.randn(t, hv, d, generator=g, device=dev).bfloat16()
        gl = -torch.rand(t, hv, generator=g, device=dev)
        beta = torch.rand(t, hv, generator=g, device=dev)
        st = torch.randn(3, 2, hv, d, d, generator=g, device=dev) * 0.1
        s2 = st.clone()
        out = gated_delta_rule_prefill_triton(q, k, v, gl, beta, st, *meta, **kw)
        torch.cuda.synchronize()
        want = ref.gated_delta_rule_states(q, k, v, gl, beta, s2, *meta, False)
        err = (out.float() - want.float()).abs().max().item()
        serr = (st - s2).abs().max().item()
    print(json.dumps({"kind": kind, "kw": kw, "ok": True, "max_out_err": err, "max_state_err": serr}))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        one(sys.argv[1], json.loads(sys.argv[2]))
    else:
        for kind, kw in VARIANTS:
            r = subprocess.run([sys.executable, __file__, kind, json.dumps(kw)], capture_output=True, text=True,
                               timeout=120)
            line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
            err = [x for x in r.stderr.splitlines() if "Error" in x][-1:] if r.returncode else []
            print(line or json.dumps({"kind": kind, "kw": kw, "ok": False, "error": err}))
