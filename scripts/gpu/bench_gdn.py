"""GDN kernel times on Qwen3-Next shapes (16 key heads / 32 value heads of 128, conv over 8192 channels, K = 4)
against their memory floor: the bytes a kernel must move (states read and written, inputs and outputs once) at the
measured copy bandwidth. Decode (1 token, state in place), verify (4 tokens, a state per position) at batch 1..64,
timed as CUDA-graph replays;
prefill at 512..8192 tokens, token-sequential vs chunked. One layer; bf16 inputs, float32 SSM state, bf16 conv state.
Printed per row: the kernel's ms, its floor's ms and the floor as a percentage of the kernel's time (100%: at the
copy bandwidth); prefill rows also give the chunked kernel's TFLOP/s and its largest difference from the sequential
kernel. Needs a CUDA GPU.

    python3 scripts/gpu/bench_gdn.py [--output-file PATH]
"""

from __future__ import annotations

import argparse

import torch

from specserve.bench.tee import tee_stdout_to
from specserve.kernels import reference as ref
from specserve.kernels.triton_gdn import causal_conv_states_triton, gated_delta_rule_states_triton

HK, HV, DK, DV, K = 16, 32, 128, 128, 4
C = 2 * HK * DK + HV * DV
DEV = torch.device("cuda")


def copy_bw() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = bench(y.copy_, x)
    return 2 * x.numel() / (ms * 1e-3)


def bench(fn, *args, reps: int = 50) -> float:
    """Mean ms of fn(*args) over `reps` back-to-back calls (CUDA events)."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def bench_graph(fn, *args, reps: int = 20) -> float:
    """Mean ms of fn(*args) replayed from a CUDA graph of `reps` back-to-back calls: the kernels without the host
    launch (which dominates eager timing of a microsecond kernel)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn(*args)
    return bench(graph.replay, reps=10) / reps


def inputs(b: int, w: int, slots: int):
    t = b * w
    g = torch.Generator(device=DEV).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device=DEV)
    q, k = r(t, HK, DK).bfloat16(), r(t, HK, DK).bfloat16()
    v = r(t, HV, DV).bfloat16()
    gl = -torch.rand(t, HV, generator=g, device=DEV)
    beta = torch.rand(t, HV, generator=g, device=DEV)
    ssm = torch.zeros(b + 1, slots, HV, DK, DV, device=DEV)
    conv = torch.zeros(b + 1, slots, K - 1, C, dtype=torch.bfloat16, device=DEV)
    x = r(t, C).bfloat16()
    wconv = r(C, K).bfloat16()
    meta = (torch.arange(1, b + 1, device=DEV), torch.zeros(b, dtype=torch.int64, device=DEV),
            torch.arange(b, device=DEV) * w, torch.full((b,), w, device=DEV))
    return q, k, v, gl, beta, ssm, conv, x, wconv, meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-file", default=None, help="also write the printed tables to this file (text)")
    tee_stdout_to(p.parse_args().output_file)
    bw = copy_bw()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; one layer, Hk {HK} Hv {HV} Dk {DK} Dv {DV}, conv {C} x {K}")
    state_b = HV * DK * DV * 4  # float32 SSM state per slot
    conv_b = (K - 1) * C * 2
    print(f"{'phase':<10} {'bs':>3} {'w':>2} | {'delta ms':>9} {'floor ms':>9} {'% floor':>7} | {'conv ms':>8} "
          f"{'floor ms':>9} {'% floor':>7}")
    for w, per_pos in ((1, False), (4, True)):
        for b in (1, 8, 32, 64):
            q, k, v, gl, beta, ssm, conv, x, wconv, meta = inputs(b, w, 4)
            d_ms = bench_graph(gated_delta_rule_states_triton, q, k, v, gl, beta, ssm, *meta, per_pos)
            c_ms = bench_graph(causal_conv_states_triton, x, wconv, conv, *meta, per_pos)
            writes = w if per_pos else 1
            t = b * w
            d_bytes = b * state_b * (1 + writes) + t * (2 * HK * DK + 2 * HV * DV) * 2 + t * HV * 8
            c_bytes = b * conv_b * (1 + writes) + t * C * 4 + C * K * 2
            d_floor, c_floor = d_bytes / bw * 1e3, c_bytes / bw * 1e3
            name = "decode" if w == 1 else "verify"
            print(f"{name:<10} {b:>3} {w:>2} | {d_ms:9.4f} {d_floor:9.4f} {100 * d_floor / d_ms:6.1f}% | "
                  f"{c_ms:8.4f} {c_floor:9.4f} {100 * c_floor / c_ms:6.1f}%")
    try:
        from specserve.kernels.triton_gdn_chunked import causal_conv_prefill_triton, gated_delta_rule_prefill_triton
    except ImportError:
        gated_delta_rule_prefill_triton = causal_conv_prefill_triton = None
    print(f"\n{'prefill T':<10} | {'sequential ms':>13} | {'chunked ms':>10} | {'floor ms':>9} | "
          f"{'chunked TFLOP/s':>15} | {'conv seq ms':>11} | {'conv par ms':>11}")
    for t in (512, 2048, 8192):
        q, k, v, gl, beta, ssm, conv, x, wconv, meta = inputs(1, t, 1)
        seq = bench(gated_delta_rule_states_triton, q, k, v, gl, beta, ssm, *meta, False, reps=5)
        cseq = bench(causal_conv_states_triton, x, wconv, conv, *meta, False, reps=5)
        floor = (t * (2 * HK * DK + 2 * HV * DV) * 2 + t * HV * 8 + 2 * state_b) / bw * 1e3
        # chunked delta rule, per token and value head: about 6 Dk Dv (state products) + 4 C (Dk + Dv) (chunk
        # products, C = 32) multiply-adds
        flops = 2 * t * HV * (6 * DK * DV + 4 * 32 * (DK + DV))
        if gated_delta_rule_prefill_triton is not None:
            ch = bench(gated_delta_rule_prefill_triton, q, k, v, gl, beta, ssm, *meta, reps=10)
            cpar = bench(causal_conv_prefill_triton, x, wconv, conv, *meta, t, reps=10)
            o_seq = gated_delta_rule_states_triton(q, k, v, gl, beta, ssm.clone(), *meta, False)
            o_ch = gated_delta_rule_prefill_triton(q, k, v, gl, beta, ssm.clone(), *meta)
            err = (o_seq.float() - o_ch.float()).abs().max().item()
            print(f"{t:<10} | {seq:13.3f} | {ch:10.3f} | {floor:9.4f} | {flops / (ch * 1e-3) / 1e12:15.1f} | "
                  f"{cseq:11.3f} | {cpar:11.3f}   (max |seq - chunked| {err:.1e})")
        else:
            print(f"{t:<10} | {seq:13.3f} | {'-':>10} | {floor:9.4f} | {'-':>15} | {cseq:11.3f} | {'-':>11}")
    # correctness spot check of the verify kernel at real shapes against the reference
    q, k, v, gl, beta, ssm, conv, x, wconv, meta = inputs(2, 4, 4)
    s1, s2 = ssm.clone(), ssm.clone()
    o1 = gated_delta_rule_states_triton(q, k, v, gl, beta, s1, *meta, True)
    o2 = ref.gated_delta_rule_states(q, k, v, gl, beta, s2, *meta, True)
    print(f"\nverify kernel vs reference at real shapes: max |out| diff {(o1.float() - o2.float()).abs().max():.2e}, "
          f"max |state| diff {(s1 - s2).abs().max():.2e}")


if __name__ == "__main__":
    main()
