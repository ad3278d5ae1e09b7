"""Bandwidth floors of a step's phases: the bytes each phase must move at the least, and the time that takes at a
given bandwidth. A measured phase reads against its floor; a target on a ratio of phases (a speculative iteration
against a plain step) reads against the ratio of their floors.

What a phase must move (weights once, whatever the batch; caches per request row):
- weights: every parameter once, except the embedding table when it is not also the LM head (a step reads only its
  rows), and of each MoE block's routed experts only those some token of the phase chose. Under routing that is
  uniform and independent between tokens (what random weights give) `T` tokens choose
  `E * (1 - (1 - k / E) ** T)` distinct experts of E at top-k on average: 4 verify tokens of Qwen3-30B-A3B (E 128,
  top 8) read 29.2 experts a layer where a decode token reads 8. Real checkpoints route with locality and read
  fewer; this floor is the random-weight benchmarks' own.
- token caches: every K/V, latent and index-key row up to the context, once per row (a DSA layer's attention only
  its `index_topk` chosen latent rows; its indexer every key).
- recurrent state (docs/architecture.md): a decode step reads a row's current slot and writes one; a verify of
  N + 1 tokens reads one and writes N + 1 (the state after every verified position).
- A speculative iteration (engine/spec_step.py) is a target verify of N + 1 tokens a row, a draft extend over the
  same N + 1 positions and N - 1 draft decode steps; a plain step is one target decode.

`specserve bench-floors --preset P` prints them with no GPU (the models are built on the meta device);
`specserve bench-phases` prints them beside the measured phases.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

from specserve.batch import CacheKind
from specserve.kvcache.cache_spec import CacheSpec
from specserve.server_args import CommandParser


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Experts of num_experts that `tokens` tokens choose at top_k each, on average under uniform routing
    independent between tokens (exactly top_k for one token)."""
    if tokens <= 0:
        return 0.0
    top_k = min(top_k, num_experts)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def weight_bytes(model: torch.nn.Module, tokens: int = 1) -> float:
    """Weight bytes a forward of `tokens` tokens must read (see the module doc)."""
    from specserve.layers.moe import SparseMoEBlock

    share: dict[int, float] = {}
    for m in model.modules():
        if isinstance(m, SparseMoEBlock):  # a fused shared expert (always read) is the last of experts.w13 / w2
            extra = int(m.fused_shared)
            routed = m.experts.w13.shape[0] - extra  # this rank's routed experts
            chosen = expected_distinct_experts(routed, m.top_k, tokens) if m.ep.size == 1 else \
                min(routed, tokens * m.top_k)  # (expert parallel: a rank's share of the choices; a bound)
            share.update({id(m.experts.w13): (chosen + extra) / (routed + extra),
                          id(m.experts.w2): (chosen + extra) / (routed + extra)})
    embed = model.embed_tokens.weight if model.embed_tokens is not None else None
    head = getattr(model, "head", model.lm_head).weight  # an MTP draft's head may be the target's, shared
    params = list(model.parameters()) + [head]
    seen: set[int] = set()
    total = 0.0
    for p in params:
        if id(p) in seen or (p is embed and head is not embed):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size() * share.get(id(p), 1.0)
    return total


def token_cache_bytes(specs: list[CacheSpec], context: int, dtype: torch.dtype, index_topk: int = 0,
                      kind_dtypes: dict[CacheKind, torch.dtype] | None = None) -> int:
    """Bytes of token caches one request row's step reads at `context` cached tokens."""
    kind_dtypes = kind_dtypes or {}
    total = 0
    for s in specs:
        if not s.kind.token_indexed:
            continue
        rows = min(context, index_topk) if s.kind is CacheKind.MLA and index_topk else context
        total += rows * s.bytes_per_token(kind_dtypes.get(s.kind, dtype))
    return total


def state_slot_bytes(specs: list[CacheSpec]) -> int:
    """Recurrent-state bytes of one slot over every recurrent layer."""
    return sum(s.bytes_per_slot() for s in specs if s.kind is CacheKind.RECURRENT)


@dataclass
class PhaseFloors:
    """Floor bytes of each phase for `bs` rows at `context` cached tokens, N draft steps."""

    bs: int
    context: int
    num_steps: int
    decode: float  # a plain step: one target token a row
    target_verify: float  # N + 1 target tokens a row
    draft_extend: float  # the draft over the same N + 1 positions
    draft_step: float  # one draft decode step

    @property
    def spec_iter(self) -> float:
        return self.target_verify + self.draft_extend + (self.num_steps - 1) * self.draft_step

    @property
    def spec_over_plain(self) -> float:
        """A speculative iteration against a plain step with both at their floors."""
        return self.spec_iter / self.decode

    def ms(self, nbytes: float, gbps: float) -> float:
        return nbytes / (gbps * 1e9) * 1e3

    def as_dict(self, gbps: float | None = None) -> dict:
        d = asdict(self) | {"spec_iter": self.spec_iter, "spec_over_plain": self.spec_over_plain}
        if gbps:
            d["ms_at_GBps"] = gbps
            d["ms"] = {k: self.ms(d[k], gbps) for k in ("decode", "target_verify", "draft_extend", "draft_step",
                                                         "spec_iter")}
        return d


def phase_floors(target, draft, bs: int, context: int, num_steps: int, dtype: torch.dtype,
                 kind_dtypes: dict[CacheKind, torch.dtype] | None = None) -> PhaseFloors:
    """The floors of a speculating engine's phases and of a plain step (module doc); target and draft as the
    engine holds them (or built on the meta device, phase_setup.meta_models); token caches in `dtype` but for the
    kinds in kind_dtypes."""
    n1 = num_steps + 1
    t_specs, d_specs = target.cache_specs(), draft.cache_specs()
    t_topk = getattr(target.config, "index_topk", 0) or 0
    d_topk = getattr(draft.config, "index_topk", 0) or 0
    t_cache = bs * token_cache_bytes(t_specs, context, dtype, t_topk, kind_dtypes)
    d_cache = bs * token_cache_bytes(d_specs, context, dtype, d_topk, kind_dtypes)
    t_state, d_state = state_slot_bytes(t_specs), state_slot_bytes(d_specs)
    # the draft shares the target's embedding and LM head: count them in its forward as well
    return PhaseFloors(
        bs=bs, context=context, num_steps=num_steps,
        decode=weight_bytes(target, bs) + t_cache + 2 * bs * t_state,
        target_verify=weight_bytes(target, bs * n1) + t_cache + (1 + n1) * bs * t_state,
        draft_extend=weight_bytes(draft, bs * n1) + d_cache + (1 + n1) * bs * d_state,
        draft_step=weight_bytes(draft, bs) + d_cache + 2 * bs * d_state)


def print_floors(rows: list[PhaseFloors], gbps: float, label: str) -> None:
    print(f"\n=== bandwidth floors: {label}, N={rows[0].num_steps}, at {gbps:.0f} GB/s ===")
    hdr = (f"{'bs':>4} {'context':>8} | {'decode':>9} {'verify':>9} {'d.extend':>9} {'d.step':>9} | "
           f"{'spec iter':>9} | {'spec/plain':>10}")
    print(hdr + "\n" + "-" * len(hdr))
    for f in rows:
        ms = [f.ms(x, gbps) for x in (f.decode, f.target_verify, f.draft_extend, f.draft_step, f.spec_iter)]
        print(f"{f.bs:>4} {f.context:>8} | {ms[0]:9.3f} {ms[1]:9.3f} {ms[2]:9.3f} {ms[3]:9.3f} | {ms[4]:9.3f} | "
              f"{f.spec_over_plain:9.2f}x")
    print("(ms at the floor; verify/extend over N + 1 tokens a row; experts: the uniform-routing expectation)")


def main(argv: list[str] | None = None) -> int:
    from specserve.bench.phase_setup import PRESETS, meta_models

    p = CommandParser(prog="specserve bench-floors", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), required=True)
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--contexts", default="1024", help="cached tokens a request (comma-separated)")
    p.add_argument("--speculative-num-steps", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--bandwidth-gbps", type=float, default=4200.0,
                   help="the bandwidth the floors are timed at (default: about the H200's measured copy bandwidth)")
    p.add_argument("--output-file", default=None, help="append the floors as one JSON line")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    ctxs = [int(x) for x in args.contexts.split(",")]
    target, draft = meta_models(args.preset, max(ctxs) + args.speculative_num_steps + 8, dtype)
    rows = [phase_floors(target, draft, int(b), c, args.speculative_num_steps, dtype)
            for c in ctxs for b in args.batch_sizes.split(",")]
    print_floors(rows, args.bandwidth_gbps, f"{args.preset} ({args.dtype})")
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps({"preset": args.preset, "floors": [r.as_dict(args.bandwidth_gbps) for r in rows]})
                    + "\n")
    return 0
