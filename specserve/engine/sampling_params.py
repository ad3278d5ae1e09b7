"""Per-request sampling parameters, validated with clear errors (a bad request never reaches the GPU).

Names are SGLang's. Besides the sampling filters a request may carry logit rules (engine/logit_rules.py): penalties,
a logit bias and one grammar (`json_schema`, `regex` or `ebnf`), applied to the target's logits at every position it
samples or verifies. Only their form is checked here (this module is also the HTTP process's validator, which never
loads the grammar library); a grammar that does not compile is refused by the engine (engine/grammar.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

_INT_MAX = 2**63 - 1
MAX_LOGIT_BIAS = 1024  # tokens a logit_bias may name (OpenAI allows 300)
MAX_GRAMMAR_CHARS = 1 << 20  # a grammar's text (schema, regex, EBNF)
# Stop strings are matched on the engine's loop after every token of the request (engine/stop.py decodes the last
# longest-stop-string tokens each time) and in the HTTP process's detokenizer (each update scans every stop string's
# prefixes), so their count and length bound per-token work that every other request waits on. Constants, not flags:
# no use needs more (OpenAI allows 4 strings); 1024 characters is far past any real delimiter.
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024  # a request's stop_token_ids at most (a 15 MiB list of them used to be accepted)
MAX_STOP_CHARS = 1024


MAX_TOP_LOGPROBS = 20  # OpenAI's bound
# Temperatures below this are greedy. The samplers divide logits by the temperature in float32: at 1e-40 a logit of
# 1 already overflows to inf, and the softmax of a row of infs is NaN (sampled as token 0). At 1e-5 a logit would
# have to exceed 3.4e33 to overflow, far beyond any model's, and the distribution is already one-hot wherever the
# top two logits differ by more than about 1e-3 (SGLang folds tiny temperatures into greedy the same way).
MIN_TEMPERATURE = 1e-5


def check_logprob_args(return_logprob, top_logprobs_num, logprob_start_len=-1, prompt_len: int | None = None) -> None:
    """SGLang's return_logprob / top_logprobs_num / logprob_start_len, checked (ValueError)."""
    if not isinstance(return_logprob, bool):
        raise ValueError("return_logprob must be a boolean")
    if (isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int)
            or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS):
        raise ValueError(f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs_num!r}")
    if isinstance(logprob_start_len, bool) or not isinstance(logprob_start_len, int) or logprob_start_len < -1 or (
            prompt_len is not None and logprob_start_len >= prompt_len):
        raise ValueError(f"logprob_start_len must be -1 (no prompt logprobs) or a prompt index, got "
                         f"{logprob_start_len!r}")


def logprobs_meta(ids: list[int], logprobs: list[float], top: list, top_num: int) -> dict:
    """SGLang's meta_info entries for output logprobs: output_token_logprobs [[logprob, id, None], ...] and, with
    top_num, output_top_logprobs [[[logprob, id, None], ...], ...] (None: the text, which SGLang gives only when
    asked)."""
    out = {"output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)]}
    if top_num:
        out["output_top_logprobs"] = [[[lp, t, None] for t, lp in pos] for pos in top]
    return out


def input_logprobs_meta(ids: list[int], logprobs: list, top: list, top_num: int) -> dict:
    """SGLang's meta_info entries for the prompt's logprobs (from logprob_start_len): input_token_logprobs
    [[logprob | None, id, None], ...] and, with top_num, input_top_logprobs [[[logprob, id, None], ...] | None]."""
    out = {"input_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)]}
    if top_num:
        out["input_top_logprobs"] = [None if pos is None else [[lp, t, None] for t, lp in pos] for pos in top]
    return out


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # logit rules (engine/logit_rules.py)
    frequency_penalty: float = 0.0  # minus this x the token's count in the output so far (OpenAI)
    presence_penalty: float = 0.0  # minus this once the token is in the output (OpenAI)
    repetition_penalty: float = 1.0  # a seen token's (prompt or output) logit divided (> 0) or multiplied (< 0) by it
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> bias added to its logit
    json_schema: str | None = None  # a JSON schema (as a JSON string) the output must match
    regex: str | None = None  # a regular expression the output must match
    ebnf: str | None = None  # an EBNF (GBNF) grammar the output must match

    @staticmethod
    def from_dict(d: dict | None, defaults: dict | None = None) -> SamplingParams:
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        merged = {k: v for k, v in (defaults or {}).items() if k in names}
        merged.update({k: v for k, v in d.items() if v is not None})
        if isinstance(merged.get("stop"), str):
            merged["stop"] = [merged["stop"]]
        sp = SamplingParams(**merged)
        sp.validate()
        return sp

    def validate(self) -> None:
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x):
            return isinstance(x, int | float) and not isinstance(x, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= _INT_MAX):
            raise ValueError(f"seed must be a non-negative 64-bit integer, got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got "
                             f"{max(len(s) for s in self.stop)}")
        if isinstance(self.stop_token_ids, list) and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError("ignore_eos must be a boolean")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        self._validate_logit_bias()
        self._validate_grammar()

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError("logit_bias must be an object mapping token ids to biases")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
        for k, v in bias.items():
            if not (isinstance(k, str) and k.isdigit()) and not (isinstance(k, int) and not isinstance(k, bool)
                                                               and k >= 0):
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
            if isinstance(v, bool) or not isinstance(v, int | float) or not -100.0 <= v <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {v!r} for token {k}")

    def _validate_grammar(self) -> None:
        given = [n for n in ("json_schema", "regex", "ebnf") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"only one of json_schema, regex and ebnf may be given, got {' and '.join(given)}")
        for name in given:
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ValueError(f"{name} must be a non-empty string")
            if len(v) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"{name} is longer than {MAX_GRAMMAR_CHARS} characters")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("json_schema must be a JSON object (a schema)")

    @property
    def bias_items(self) -> list[tuple[int, float]]:
        """logit_bias as (token id, bias) pairs."""
        return [(int(k), float(v)) for k, v in (self.logit_bias or {}).items()]

    @property
    def grammar(self) -> tuple[str, str] | None:
        """The request's grammar as (kind, text), kind in json_schema / regex / ebnf; None without one."""
        for name in ("json_schema", "regex", "ebnf"):
            v = getattr(self, name)
            if v is not None:
                return name, v
        return None

    @property
    def has_penalties(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    @property
    def has_logit_rules(self) -> bool:
        """Whether the target's logits are changed before this request samples (engine/logit_rules.py)."""
        return self.has_penalties or bool(self.logit_bias) or self.grammar is not None

    @property
    def is_greedy(self) -> bool:
        """Every sampling path (plain, speculative verify and drafting, logprobs) asks this, so they agree."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1
