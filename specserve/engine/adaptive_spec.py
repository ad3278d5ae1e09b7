"""Adaptive speculation: per decode step, speculate (N drafts) or take a plain step (no drafts, no draft forward;
the draft catches up before the next speculative step), whichever gives more tokens per second at the running
batch size.

Estimates, per batch-size bucket (the batch size rounded up to a power of two):
- the wall time of a speculative step and of a plain step (exponential moving averages of what the scheduler
  measures around each step, host sync included: the real cost, graphs or not), from steady steps only: steps that
  followed a decode step of their own kind. The first steps after a switch pay for it (a drain of the overlap
  schedule, whose switches run synchronously with the host work in plain sight; the draft's catch-up): under the
  overlap schedule an isolated plain probe between overlapped speculative steps costs more than a plain step of a
  run, and a policy that averaged such probes kept speculating below plain's throughput. So a probe is a run of
  `probe_len` steps of the other mode, and its transition steps count for nothing but acceptance;
- tokens per speculative step per request (accepted drafts + 1), one moving average over all buckets (acceptance
  depends on the text, not the batch size) in which every request of a step counts as one sample: at batch 1 one
  step's accept length (1 to N + 1) is a noisy sample, and a fast average of it let a few short steps hold a
  policy near break-even on plain steps for whole probe intervals;
- the draft's catch-up after plain steps (speculative/draft_lag.py), per catch-up: a plain step runs no draft, and
  the draft extends over the positions it missed before the next speculative step, in one forward whose cost
  hardly depends on how many positions it covers. Either mode pays one catch-up a probe period (speculating: after
  its plain probe; plain: before its speculative probe); what plain decoding adds is that cost spread over the plain
  steps of a period, `period - probe_len` of them. (Spread over the plain steps that left it, as before, a probe of
  4 plain steps would carry a quarter of a catch-up each.)

A plain step is taken when 1 / (t_plain + t_catch_up / (period - probe_len)) > tokens_per_spec_step / t_spec.
A bucket measures speculation first, then plain steps until one of them is steady; after that, the last
`probe_len` steps of every probe period there take the mode not chosen, so both estimates follow load, contexts and
acceptance as they change. A period is `probe_every` steps and doubles, up to `max_period`, each time a probe leaves
the choice as it was: a probe costs two switches and, while plain steps are chosen, a catch-up of the draft, which
at batch 1 on small models takes a visible share of plain decoding's speed when probes come often. Greedy
outputs do not depend on the choice (both modes are lossless); sampled outputs are samples of the same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def bucket(bs: int) -> int:
    """Batch size -> its bucket: the next power of two."""
    return 1 << max(bs - 1, 0).bit_length()


@dataclass
class AdaptiveSpeculation:
    probe_every: int = 32  # the shortest probe period: every this many steps in a bucket, a probe of the other mode
    probe_len: int = 4  # steps a probe takes (under the overlap schedule the first two are transitions)
    max_period: int = 128  # the longest period (at most the draft lag's capacity: a longer run of plain steps
    # would be cut by a forced catch-up anyway)
    alpha: float = 0.2  # weight of a new step time in the moving averages
    token_alpha: float = 0.02  # weight of one request's tokens of one step in the accept average
    spec_s: dict[int, float] = field(default_factory=dict)  # bucket -> seconds per speculative step
    plain_s: dict[int, float] = field(default_factory=dict)  # bucket -> seconds per plain step
    catch_up_s: dict[int, float] = field(default_factory=dict)  # bucket -> seconds per catch-up of the draft
    tokens_per_spec: float | None = None  # accepted drafts + 1 per request per speculative step
    steps: dict[int, int] = field(default_factory=dict)  # bucket -> steps decided in its current period
    period: dict[int, int] = field(default_factory=dict)  # bucket -> its probe period now
    choice: dict[int, bool] = field(default_factory=dict)  # bucket -> the mode chosen at its period's start
    num_plain: int = 0
    num_spec: int = 0

    def plain_is_faster(self, bs: int) -> bool | None:
        """Whether the estimates favour a plain step at this batch size (None: not both measured yet)."""
        b = bucket(bs)
        if b not in self.spec_s or b not in self.plain_s or self.tokens_per_spec is None:
            return None
        return 1.0 / (self.plain_s[b] + self.catch_up_per_plain_step(b)) > self.tokens_per_spec / self.spec_s[b]

    def catch_up_per_plain_step(self, b: int) -> float:
        """A bucket's catch-up, spread over the plain steps of a probe period taken plain."""
        return self.catch_up_s.get(b, 0.0) / max(self.period.get(b, self.probe_every) - self.probe_len, 1)

    def choose_plain(self, bs: int) -> bool:
        """Decide the next step of a batch of `bs` requests: True for a plain step. A period whose probe left the
        choice as it was is followed by one twice as long (up to max_period): each probe pays a switch there and
        back and, when plain decoding is chosen, a catch-up of the draft, so a settled choice probes less often; a
        changed choice starts over at probe_every."""
        b = bucket(bs)
        if b not in self.spec_s:
            return False
        if b not in self.plain_s:
            return True
        plain = bool(self.plain_is_faster(bs))
        n, period = self.steps.get(b, 0), self.period.get(b, self.probe_every)
        if n >= period:  # a period and its probe ended
            held = self.choice.get(b) == plain
            longest = max(self.max_period, self.probe_every)
            period = self.period[b] = min(2 * period, longest) if held else self.probe_every
            n = 0
        if n == 0:
            self.choice[b] = plain
        self.steps[b] = n + 1
        return (not plain) if n >= period - self.probe_len else plain

    def record(self, bs: int, plain: bool, seconds: float, tokens_per_request: float,
               catch_up: tuple[float, int, int] | None = None, steady: bool = True) -> None:
        """A finished step of bs requests: its wall time without the draft's catch-up, (speculative steps) its mean
        tokens per request, the catch-up it ran first, if any: (seconds, rows, positions), and whether it followed
        a decode step of its own kind (only such steps' times are averaged)."""
        b = bucket(bs)
        if steady:
            self._average(self.plain_s if plain else self.spec_s, b, seconds)
        if catch_up is not None and catch_up[2] > 0:
            self._average(self.catch_up_s, b, catch_up[0])
        if plain:
            self.num_plain += 1
        else:
            self.num_spec += 1
            t = self.tokens_per_spec
            a = 1.0 - (1.0 - self.token_alpha) ** max(bs, 1)  # bs samples of weight token_alpha each
            self.tokens_per_spec = tokens_per_request if t is None else t + a * (tokens_per_request - t)

    def _average(self, table: dict[int, float], b: int, seconds: float) -> None:
        old = table.get(b)
        table[b] = seconds if old is None else old + self.alpha * (seconds - old)

    def summary(self) -> dict:
        """For /get_server_info: the step counts and the estimates per bucket (milliseconds)."""
        return {"plain_steps": self.num_plain, "spec_steps": self.num_spec,
                "tokens_per_spec_step": self.tokens_per_spec,
                "buckets": {b: {"spec_ms": 1e3 * self.spec_s[b] if b in self.spec_s else None,
                                "plain_ms": 1e3 * self.plain_s[b] if b in self.plain_s else None,
                                "catch_up_ms": 1e3 * self.catch_up_s[b] if b in self.catch_up_s else None,
                                "catch_up_ms_per_plain_step": (1e3 * self.catch_up_per_plain_step(b)
                                                               if b in self.catch_up_s else None),
                                "plain_is_faster": self.plain_is_faster(b),
                                "probe_period": self.period.get(b, self.probe_every)}
                            for b in sorted(set(self.spec_s) | set(self.plain_s))}}
