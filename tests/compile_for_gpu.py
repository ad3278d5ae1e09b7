"""Compiles Triton kernels for an H100/H200 (sm_90) on a machine without a GPU (run by
tests/test_compile_for_gpu.py in a process without TRITON_INTERPRET: the interpreter runs a kernel as Python and
accepts code the GPU compiler rejects, e.g. a non-constexpr tl.static_range bound).

Each case calls a product launcher with CPU tensors of a real model's shapes; the kernel objects it launches are
swapped, for the call, for recorders that keep the launch arguments instead of running, and each recorded launch is
then compiled to PTX by triton.compile for sm_90 (the bundled ptxas; no driver needed). Prints one line a launch;
exits non-zero on the first failure."""

from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
_TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16", torch.int64: "i64",
          torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv",
          torch.float8_e5m2: "fp8e5"}
BF16 = torch.bfloat16
SM90_SHARED_BYTES = 232448  # the most shared memory an H100 / H200 block may use (227 KiB)


class _Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def _compile(kernel, args, kwargs, aligned: bool = False) -> triton.compiler.CompiledKernel:
    """aligned: mark pointers and integers divisible by 16 as such, as the JIT specialises a GPU launch (so the PTX
    has its 16-byte vector loads and the pipeline's async copies); else nothing is assumed."""
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    kwargs.pop("launch_pdl", None)
    values = dict(zip(kernel.arg_names, args), **kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        v = values[name]
        if aligned and i not in kernel.constexprs and (isinstance(v, torch.Tensor) or (
                isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0)):
            attrs[(i,)] = [["tt.divisibility", 16]]
        if i in kernel.constexprs:
            signature[name] = "constexpr"
            constexprs[(i,)] = v
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + _TYPES[v.dtype]
        elif isinstance(v, bool):
            signature[name] = "i1"
        elif isinstance(v, int):
            signature[name] = "i64" if abs(v) >= 2 ** 31 else "i32"
        elif isinstance(v, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}.{name}: {type(v).__name__}")
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=TARGET, options=options)


def check(label: str, module, names: list[str], launch, aligned: bool = False, **override) -> None:
    """Run launch() with module's kernels `names` recording, then compile every recorded launch (its keyword
    arguments updated by `override`: a launch option the product's defaults leave off, e.g. GDC; keys a kernel does
    not take are ignored; aligned: as _compile's). module: a module, or a list of them (each name from the first
    that has it: a launcher that calls another module's launcher)."""
    modules = module if isinstance(module, list) else [module]
    owners = {n: next(m for m in modules if hasattr(m, n)) for n in names}
    kernels = {n: getattr(owners[n], n) for n in names}
    recorders = {n: _Recorder() for n in names}
    for n in names:
        setattr(owners[n], n, recorders[n])
    try:
        launch()
    finally:
        for n in names:
            setattr(owners[n], n, kernels[n])
    launched = 0
    for n in names:
        for args, kwargs in recorders[n].launches:
            compiled = _compile(kernels[n], args, {**kwargs, **override}, aligned)
            # what the GPU would refuse at launch (triton's OutOfResources): sm_90's shared memory a block
            assert compiled.metadata.shared <= SM90_SHARED_BYTES, (
                f"{label}: {n} needs {compiled.metadata.shared} bytes of shared memory, sm_90 has {SM90_SHARED_BYTES}")
            launched += 1
            print(f"{label}: {n} -> {len(compiled.asm['ptx'])} chars of PTX")
    assert launched, f"{label}: nothing was launched"


def fp8_cases() -> None:
    """The FP8 linear kernels (kernels/triton_fp8.py) at Llama-3.1-8B's projections (qkv, gate_up, down), block
    (128, 128) and per-channel: the decode GEMV at 1 row (CUDA cores) and 8 rows (tensor-core tile), the activation
    quantisers and the GEMM at 64 and 256 rows. The launchers see CPU tensors, so the GPU's launch options are put back:
    fp8 tl.dot operands, no interpreter rounding fix-up."""
    from specserve.kernels import reference_fp8 as rf
    from specserve.kernels import triton_fp8 as tf

    gpu = dict(DOT_DTYPE="fp8", EXACT_FIRST=False)
    for n, k in ((6144, 4096), (28672, 4096), (4096, 14336)):
        wq = torch.empty(n, k, dtype=rf.FP8)
        for block in ((128, 128), None):
            sw = torch.ones(n) if block is None else torch.ones(-(-n // 128), -(-k // 128))
            for m in (1, 8, 64, 256):
                x = torch.randn(m, k).to(BF16)
                check(f"fp8 linear {n}x{k} block={block} rows={m}", tf,
                      ["_fp8_mm_kernel", "_fp8_gemv_kernel", "_quant_groups_kernel", "_quant_tokens_kernel"],
                      lambda x=x, wq=wq, sw=sw, block=block: tf.fp8_linear(x, wq, sw, block), **gpu)
    # the split-K decode GEMV at Llama-3.1-8B's four projections, 1 and 4 rows (CUDA cores; 4 block-scaled rows: the
    # tensor-core tile), block and channel, with the launch gemv_config picks on an H100's 132 SMs (split K for qkv,
    # o and down), aligned as the JIT specialises these shapes: 16-byte loads and the pipeline's async copies
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        wq = torch.empty(n, k, dtype=rf.FP8)
        for block in ((128, 128), None):
            sw = torch.ones(n) if block is None else torch.ones(-(-n // 128), -(-k // 128))
            for m in (1, 4):
                x, cfg = torch.randn(m, k).to(BF16), tf.gemv_config(m, n, k, block, 132)
                check(f"fp8 gemv {n}x{k} block={block} rows={m} {cfg}", tf, ["_fp8_gemv_kernel"],
                      lambda x=x, wq=wq, sw=sw, block=block, cfg=cfg: tf.fp8_gemv_with(x, wq, sw, block, None, cfg),
                      aligned=True, **gpu)


def main() -> None:
    fp8_cases()
    from specserve.kernels import triton_attention as ta
    from specserve.kernels import triton_gemv as tg
    from specserve.kernels import triton_moe as tm
    from specserve.kernels import triton_moe_blocks as tmb
    from specserve.kernels import triton_moe_fp8 as tmf
    from specserve.kernels import triton_qk_prep as tq
    from specserve.kernels import triton_rope as trope
    from specserve.kernels import triton_router as tr
    from specserve.kernels import triton_sample as ts
    from specserve.kernels.rope_store import RopeStore

    def norm_gemv_case(rows, k, silu, m=1, **cfg_extra):
        x, r = torch.randn(m, k).to(BF16), torch.randn(m, k).to(BF16)
        w = torch.randn(rows, k).to(BF16)
        cfg = dict(tg.gemv_config(m, rows, k, BF16, silu), **cfg_extra)
        y = torch.empty(m, rows // (2 if silu else 1), dtype=BF16)
        return lambda: tg._launch(x, r, torch.ones(k, dtype=BF16), w, None, y, torch.empty_like(x), 1e-5, 0.0, silu,
                                  cfg)

    # Llama-3.1-8B's qkv and gate_up (norm, SiLU-mul), with the statistics prologue and with LATE_RSTD, PDL on/off
    for late in (0, 1):
        for pdl in (0, 2):
            check(f"qkv late={late} pdl={pdl}", tg, ["_gemv_kernel"],
                  norm_gemv_case(6144, 4096, False, LATE_RSTD=late, PDL=pdl))
            check(f"gate_up late={late} pdl={pdl}", tg, ["_gemv_kernel"],
                  norm_gemv_case(28672, 4096, True, LATE_RSTD=late, PDL=pdl))
    check("smollm2 qkv 3 rows late", tg, ["_gemv_kernel"],
          norm_gemv_case(960, 576, False, m=3, LATE_RSTD=1))
    # the q/k prep epilogue, without and with q/k norms (Qwen3-30B-A3B's heads)
    hq, hkv, d, k = 32, 4, 128, 2048
    for normed in (False, True):
        x = torch.randn(1, k).to(BF16)
        w = torch.randn((hq + 2 * hkv) * d, k).to(BF16)
        caches = [torch.zeros(16, hkv, d, dtype=BF16) for _ in range(2)]
        norms = (torch.ones(d, dtype=BF16), torch.ones(d, dtype=BF16)) if normed else ()
        rope = RopeStore(torch.randn(64, d), torch.tensor([3]), torch.tensor([5]), *caches, hq, hkv, d, *norms)
        y = torch.empty(1, w.shape[0], dtype=BF16)
        check(f"qkv rope epilogue normed={normed}", tg, ["_gemv_kernel"],
              lambda x=x, w=w, rope=rope, y=y: tg._launch(x, None, torch.ones(k, dtype=BF16), w, None, y, None, 1e-5,
                                                          0.0, False, tg.rope_store_config(x, w, rope), rope))
    # the one-token MoE's grouped direct path (Qwen3-30B-A3B's and Qwen3-Next's experts)
    for e, h, i, top in ((128, 2048, 768, 8), (512, 2048, 512, 10)):
        w13, w2 = torch.empty(e, 2 * i, h, dtype=BF16), torch.empty(e, h, i, dtype=BF16)
        x, ids, wts = torch.randn(1, h).to(BF16), torch.arange(top)[None], torch.rand(1, top)
        check(f"moe direct E{e} I{i}", tm, ["_gate_up_kernel", "_down_kernel"],
              lambda w13=w13, w2=w2, x=x, ids=ids, wts=wts: tm.fused_moe(x, w13, w2, wts, ids))
    # the FP8 MoE (W8A8, 128 x 128 weight blocks): Qwen3-30B-A3B's and DeepSeek-V3/GLM-like experts, one token
    # (direct) and 64 (aligned: 512 pairs, the three alignment kernels, recorded too: nothing runs on CPU here): x's
    # quantizer (triton_fp8's), the FP8 gate/up GEMM with the act quantized in its epilogue, the FP8 down GEMM.
    # F32_DOT / RNE / EXACT_FIRST off, as CUDA tensors launch them: the e4m3 dot and the hardware e4m3 cast, not the
    # CPU upcast and roundings. Aligned (16-byte divisibility), as the JIT specialises the GPU launch.
    from specserve.kernels import triton_fp8 as tf
    fp8, align = torch.float8_e4m3fn, ["_count_kernel", "_offsets_kernel", "_place_kernel"]
    gpu_fp8 = dict(F32_DOT=False, RNE=False, EXACT_FIRST=False)
    moe_fp8 = ["_quant_groups_kernel", "_gate_up_fp8_kernel", "_down_fp8_kernel", "_sum_k_kernel", *align]
    for e, h, i, top in ((128, 2048, 768, 8), (256, 7168, 2048, 8)):
        w13, w2 = torch.empty(e, 2 * i, h, dtype=fp8), torch.empty(e, h, i, dtype=fp8)  # never touched: no pages
        s13, s2 = torch.ones(e, 2 * i // 128, h // 128), torch.ones(e, h // 128, i // 128)
        for t in (1, 64):
            x, wts = torch.randn(t, h).to(BF16), torch.rand(t, top)
            ids = torch.stack([torch.randperm(e)[:top] for _ in range(t)])
            check(f"moe fp8 E{e} H{h} I{i} T{t}", [tm, tmf, tmb, tf], moe_fp8,
                  lambda w13=w13, w2=w2, s13=s13, s2=s2, x=x, ids=ids, wts=wts: tm.fused_moe(
                      x, w13, w2, wts, ids, w13_scale=s13, w2_scale=s2, block=(128, 128)), aligned=True, **gpu_fp8)
    # and the GPU tests' 16 x 16 blocks: a K step below the e4m3 dot's least K of 32 (triton_fp8_tiles.dot_e4m3)
    w13, w2 = torch.empty(4, 64, 64, dtype=fp8), torch.empty(4, 64, 32, dtype=fp8)
    s13, s2 = torch.ones(4, 4, 4), torch.ones(4, 4, 2)
    check("moe fp8 16 x 16 blocks", [tm, tmf, tmb, tf], moe_fp8[:3],
          lambda: tm.fused_moe(torch.randn(1, 64).to(BF16), w13, w2, torch.rand(1, 2), torch.arange(2)[None],
                               w13_scale=s13, w2_scale=s2, block=(16, 16)), **gpu_fp8)
    # per-channel FP8 experts (compressed-tensors FP8-dynamic: a scale per weight row, x per token, the act per pair
    # from the gate/up GEMM's partial amaxes): Qwen3-30B-A3B's shapes at one token and 64, and the GPU tests' tiny
    # ones (a K tile below the e4m3 dot's 32, one amax partial a row)
    moe_channel = ["_quant_tokens_kernel", "_gate_up_fp8_channel_kernel", "_down_fp8_channel_kernel", "_sum_k_kernel",
                   *align]
    e, h, i, top = 128, 2048, 768, 8
    w13, w2 = torch.empty(e, 2 * i, h, dtype=fp8), torch.empty(e, h, i, dtype=fp8)
    s13, s2 = torch.ones(e, 2 * i), torch.ones(e, h)
    for t in (1, 64):
        x, wts = torch.randn(t, h).to(BF16), torch.rand(t, top)
        ids = torch.stack([torch.randperm(e)[:top] for _ in range(t)])
        check(f"moe fp8 per-channel E{e} H{h} I{i} T{t}", [tm, tmf, tmb, tf], moe_channel,
              lambda w13=w13, w2=w2, s13=s13, s2=s2, x=x, ids=ids, wts=wts: tm.fused_moe(
                  x, w13, w2, wts, ids, w13_scale=s13, w2_scale=s2, block=None), aligned=True, **gpu_fp8)
    w13, w2 = torch.empty(4, 32, 16, dtype=fp8), torch.empty(4, 16, 16, dtype=fp8)
    check("moe fp8 per-channel tiny", [tm, tmf, tmb, tf], moe_channel[:3],
          lambda: tm.fused_moe(torch.randn(1, 16).to(BF16), w13, w2, torch.rand(1, 2), torch.arange(2)[None],
                               w13_scale=torch.ones(4, 32), w2_scale=torch.ones(4, 16), block=None), **gpu_fp8)
    # the router with the norm inside (Qwen3-30B-A3B: 128 experts, top 8)
    x, r = torch.randn(1, 2048).to(BF16), torch.randn(1, 2048).to(BF16)
    for gdc in (False, True):  # and launched with PDL (a config's PDL key)
        check(f"router + norm gdc={gdc}", tr, ["_router_gemv_topk_kernel"],
              lambda: tr.norm_router_topk_triton(x, r, torch.ones(2048, dtype=BF16), 1e-6, 0.0,
                                                 torch.randn(128, 2048).to(BF16), 8, True), GDC=gdc)
    # the q/k prep (Qwen3's q/k norms, rotary, K/V store) and the attention (decode with split merge, verify width 4,
    # a prefill's variable lengths), Llama-3.1-8B's heads
    hq, hkv, d, slots = 32, 8, 128, 4096
    kc, vc = torch.zeros(slots, hkv, d, dtype=BF16), torch.zeros(slots, hkv, d, dtype=BF16)
    q, k, v = torch.randn(1, hq, d).to(BF16), torch.randn(1, hkv, d).to(BF16), torch.randn(1, hkv, d).to(BF16)
    check("q/k prep with norms", tq, ["_qk_prep_kernel"],
          lambda: tq.qk_norm_rope_store_triton(q, k, v, kc, vc, torch.tensor([7]), torch.randn(64, d),
                                               torch.tensor([3]), None, torch.ones(d, dtype=BF16),
                                               torch.ones(d, dtype=BF16), 1e-6))
    # Qwen3.5's gated attention prep: 16 q / 2 kv heads of 256, zero-centred norms, rotary on 64 dims at 3-row
    # positions with interleaved mRoPE (sections [11, 11, 10]); and the plain rope kernel in that layout
    q5, k5, v5 = (torch.randn(2, h, 256).to(BF16) for h in (16, 2, 2))
    c5 = torch.zeros(16, 2, 256, dtype=BF16)
    pos3, cs64 = torch.randint(0, 64, (3, 2)), torch.randn(64, 64)
    check("q/k prep interleaved mRoPE", tq, ["_qk_prep_kernel"],
          lambda: tq.qk_norm_rope_store_triton(q5, k5, v5, c5, c5.clone(), torch.tensor([3, 4]), cs64, pos3,
                                               [11, 11, 10], torch.zeros(256, dtype=BF16),
                                               torch.zeros(256, dtype=BF16), 1e-6, 1.0, mrope_interleaved=True))
    check("rope interleaved mRoPE", trope, ["_rope_kernel"],
          lambda: trope.rope(q5[..., :64], k5[..., :64], cs64, pos3, [11, 11, 10], True))
    table = torch.arange(slots, dtype=torch.int64)[None]  # [1, slots]
    rows, lens = torch.zeros(1, dtype=torch.int64), torch.full((1,), 513, dtype=torch.int64)
    for width, splits in ((1, 8), (4, 8), (1, 1)):
        qw = torch.randn(width, hq, d).to(BF16)
        check(f"decode attention width {width} splits {splits}", ta, ["_fixed_width_kernel"],
              lambda qw=qw, width=width, splits=splits: ta.fixed_width_attention(qw, kc, vc, table, rows, lens,
                                                                                 width, splits, d ** -0.5))
    # the same attention doing the q/k prep itself (Qwen3's q/k norms at decode; no norms at verify's width 4)
    cs, one = torch.randn(4096, d), torch.ones(d, dtype=BF16)
    for width, norms in ((1, True), (4, False)):
        qkv = torch.randn(width, (hq + 2 * hkv) * d).to(BF16)
        qw, kw, vw = qkv.split([hq * d, hkv * d, hkv * d], -1)
        prep = ta.AttnPrep(kw.view(width, hkv, d), vw.view(width, hkv, d), torch.arange(width), cs,
                           torch.arange(width), *((one, one) if norms else (None, None)))
        check(f"decode attention with the q/k prep, width {width} norms {norms}", ta, ["_fixed_width_kernel"],
              lambda qw=qw, width=width, prep=prep: ta.fixed_width_attention(
                  qw.view(width, hq, d), kc, vc, table, rows, lens, width, 8, d ** -0.5, prep=prep))
    # sampling at one row over Llama-3.1-8B's vocabulary: T 0.8, top-k 200 (the filter's statistics, levels, race)
    logits = torch.randn(1, 128256)
    one = dict(temperature=torch.tensor([0.8]), top_k=torch.tensor([200]), top_p=torch.tensor([1.0]),
               min_p=torch.tensor([0.0]), greedy=torch.tensor([False]), seeds=torch.tensor([1]),
               positions=torch.tensor([5]))
    check("sample top-k", ts, ["_stats_kernel", "_level_kernel", "_race_kernel"],
          lambda: ts.sample_triton(logits, need_filter=True, **one))
    qp = torch.randn(100, hq, d).to(BF16)
    check("prefill attention", ta, ["_varlen_kernel"],
          lambda: ta.varlen_attention(qp, kc, vc, table, rows, lens, torch.zeros(1, dtype=torch.int64),
                                      torch.full((1,), 100, dtype=torch.int64), 100, d ** -0.5))
    fp8_kv_cases(hq, hkv, d, slots)


def fp8_kv_cases(hq: int, hkv: int, d: int, slots: int) -> None:
    """The FP8 KV cache's kernels (kernels/triton_kv_fp8.py inside them), Llama-3.1-8B's heads, each cache format:
    the stores (store_kv, the q/k prep), decode with split merge, verify width 4, the attention's own prep store, a
    prefill. Compiled as on the GPU: hardware casts and dots (F32_DOT / RNE off; CPU tensors would set them)."""
    from specserve.kernels import triton_attention as ta
    from specserve.kernels import triton_kv as tkv
    from specserve.kernels import triton_qk_prep as tq

    table = torch.arange(slots, dtype=torch.int64)[None]  # [1, slots]
    rows, lens = torch.zeros(1, dtype=torch.int64), torch.full((1,), 513, dtype=torch.int64)
    cs, one = torch.randn(4096, d), torch.ones(d, dtype=BF16)
    for fmt, dt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        kc, vc = torch.zeros(slots, hkv, d, dtype=dt), torch.zeros(slots, hkv, d, dtype=dt)
        sc = dict(k_scale=torch.ones(slots, hkv), v_scale=torch.ones(slots, hkv))
        k, v = torch.randn(3, hkv, d).to(BF16), torch.randn(3, hkv, d).to(BF16)
        check(f"fp8 {fmt} store_kv", tkv, ["_store_kv_kernel"],
              lambda kc=kc, vc=vc, k=k, v=v, sc=sc: tkv.store_kv(kc, vc, torch.arange(3), k, v, **sc), RNE=False)
        q = torch.randn(3, hq, d).to(BF16)
        check(f"fp8 {fmt} q/k prep with norms", tq, ["_qk_prep_kernel"],
              lambda kc=kc, vc=vc, q=q, k=k, v=v, sc=sc: tq.qk_norm_rope_store_triton(
                  q, k, v, kc, vc, torch.arange(3), cs, torch.arange(3), None, one, one, 1e-6, **sc), RNE=False)
        for width, splits in ((1, 8), (4, 8)):
            qw = torch.randn(width, hq, d).to(BF16)
            check(f"fp8 {fmt} decode attention width {width} splits {splits}", ta, ["_fixed_width_kernel"],
                  lambda kc=kc, vc=vc, qw=qw, width=width, splits=splits, sc=sc: ta.fixed_width_attention(
                      qw, kc, vc, table, rows, lens, width, splits, d ** -0.5, **sc), F32_DOT=False)
        for width, norms in ((1, True), (4, False)):
            qkv = torch.randn(width, (hq + 2 * hkv) * d).to(BF16)
            qw, kw, vw = qkv.split([hq * d, hkv * d, hkv * d], -1)
            prep = ta.AttnPrep(kw.view(width, hkv, d), vw.view(width, hkv, d), torch.arange(width), cs,
                               torch.arange(width), *((one, one) if norms else (None, None)))
            check(f"fp8 {fmt} decode attention with the q/k prep, width {width} norms {norms}", ta,
                  ["_fixed_width_kernel"],
                  lambda kc=kc, vc=vc, qw=qw, width=width, prep=prep, sc=sc: ta.fixed_width_attention(
                      qw.view(width, hq, d), kc, vc, table, rows, lens, width, 8, d ** -0.5, prep=prep, **sc),
                  F32_DOT=False)
        # the MLA latent store (DeepSeek / GLM-5 rows: 512 latent values + 64 rope, 5 scales)
        from specserve.kernels import triton_latent_store as tls
        lat, lat_s, x = torch.zeros(slots, 576, dtype=dt), torch.ones(slots, 5), torch.randn(3, 576).to(BF16)
        check(f"fp8 {fmt} MLA latent store", tls, ["_store_latent_kernel"],
              lambda lat=lat, lat_s=lat_s, x=x: tls.store_latent_triton(lat, lat_s, torch.arange(3), x, 64), RNE=False)
        # the absorbed-MLA kernel over those fp8 rows (GLM-5 / DeepSeek: 64 or 16 heads of 512 + 64), bf16 queries
        # (the tiles whose shared memory the first H200 run found over the limit): decode, verify, a slot list
        from specserve.kernels import triton_mla as tm_la
        for heads, width in ((64, 1), (64, 4), (16, 4)):
            q = torch.randn(2 * width, heads, 576).to(BF16)
            tbl, lens2 = torch.arange(2 * 300).view(2, 300) % slots, torch.full((2,), 300)
            check(f"fp8 {fmt} MLA decode H{heads} width {width}", tm_la, ["_mla_decode_kernel"],
                  lambda q=q, lat=lat, lat_s=lat_s, tbl=tbl, lens2=lens2, width=width: tm_la.mla_decode_triton(
                      q, lat, tbl, lens2, width, 0.1, 512, scales=lat_s), F32_DOT=False)
        qp = torch.randn(100, hq, d).to(BF16)
        check(f"fp8 {fmt} prefill attention", ta, ["_varlen_kernel"],
              lambda kc=kc, vc=vc, qp=qp, sc=sc: ta.varlen_attention(
                  qp, kc, vc, table, rows, lens, torch.zeros(1, dtype=torch.int64),
                  torch.full((1,), 100, dtype=torch.int64), 100, d ** -0.5, **sc), F32_DOT=False)


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on the exit status
        print(f"FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
