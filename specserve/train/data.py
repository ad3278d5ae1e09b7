"""Prompts and self-distillation data.

Prompt files are JSON (a list of records) or JSONL (one record a line). A record's prompt is the first field present
of: `messages` (a chat list), `turns` (the first turn), `instruction` (+ "\\n\\n" + `input` when non-empty),
`question`, `prompt`, `text`. Answers stored in the files are ignored: the head learns the *target's* own responses,
generated with the engine (greedy, and sampled for a fraction and for extra passes), so the training data is what the
head will see. Generated data is cached (gzipped JSONL) in the output folder under a key of everything that shaped
it, with files named by base name and size, so a cache carried to another machine is reused there too.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import random
import time
from collections import deque
from dataclasses import asdict, dataclass

from tqdm import tqdm

logger = logging.getLogger(__name__)

CACHE_FILE = "selfdistill.jsonl.gz"
CACHE_META = "selfdistill.meta.json"


@dataclass
class Prompt:
    messages: list[dict]  # chat messages ending with a user turn
    source: str  # the file it came from


@dataclass
class Sample:
    """One self-distilled sequence: chat-templated prompt tokens + the target's response tokens."""

    prompt_ids: list[int]
    response_ids: list[int]
    sampled: bool
    source: str

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass
class GenerationSettings:
    num_prompts: int
    max_new_tokens: int
    sampled_fraction: float  # share of prompts answered by sampling (the rest greedy)
    temperature: float
    seed: int
    max_prompt_len: int  # longer (templated) prompts are skipped: they would leave no room for a response
    extra_sampled: int = 0  # further sampled responses per prompt, queued after every prompt's first response
    time_budget_s: float | None = None  # at this many seconds, unfinished requests stop (partial ones are kept)


MIN_PARTIAL_TOKENS = 16  # a response cut by the time budget is kept when it has at least this many tokens


# ---------------------------------------------------------------------------------------------------- prompt files
def read_records(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        records = json.loads(stripped)
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{path}: expected a JSON list of objects or JSONL objects")
    return records


def record_messages(rec: dict) -> list[dict] | None:
    """The chat messages of one record (None when it has no usable prompt)."""
    if isinstance(rec.get("messages"), list):
        msgs = [m for m in rec["messages"] if isinstance(m, dict) and isinstance(m.get("content"), str)]
        while msgs and msgs[-1].get("role") != "user":
            msgs.pop()  # drop the recorded answer: the target writes its own
        return [{"role": m["role"], "content": m["content"]} for m in msgs] or None
    text = None
    if isinstance(rec.get("turns"), list) and rec["turns"]:
        text = rec["turns"][0]
    elif isinstance(rec.get("instruction"), str):
        extra = rec.get("input")
        text = rec["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else "")
    else:
        for key in ("question", "prompt", "text"):
            if isinstance(rec.get(key), str):
                text = rec[key]
                break
    if not isinstance(text, str) or not text.strip():
        return None
    return [{"role": "user", "content": text}]


def load_prompts(paths: list[str]) -> list[Prompt]:
    out = []
    for path in paths:
        found = [m for m in (record_messages(r) for r in read_records(path)) if m]
        if not found:
            raise ValueError(f"{path}: no record has a prompt field (messages/turns/instruction/question/prompt/text)")
        out.extend(Prompt(m, os.path.basename(path)) for m in found)
    return out


def select_prompts(prompts: list[Prompt], num: int, seed: int) -> list[Prompt]:
    """A seeded random subset of `num` prompts (all of them when num <= 0 or num >= len)."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    if 0 < num < len(order):
        order = order[:num]
    return [prompts[i] for i in order]


def prompt_token_ids(engine, messages: list[dict]) -> list[int]:
    """Tokenise a chat prompt exactly as `specserve generate --chat` does (the template, then the engine)."""
    if engine.tokenizer.chat_template:
        text = engine.apply_chat_template(messages)
    else:
        text = "\n\n".join(m["content"] for m in messages)
    return engine.core.tokenize(text)


# ---------------------------------------------------------------------------------------------------- generation
def generate_samples(engine, prompts: list[Prompt], gs: GenerationSettings) -> list[Sample]:
    """The target's responses for `prompts`, fed to the engine in waves (continuous batching up to
    --max-running-requests, see below): first one response per prompt (a `sampled_fraction` of them sampled, the rest
    greedy), then `extra_sampled` more sampled ones per prompt. Under a time budget, the requests still unfinished
    at the deadline are aborted; partial responses of at least MIN_PARTIAL_TOKENS tokens are kept. A progress bar
    counts finished requests."""
    core = engine.core
    rng = random.Random(gs.seed)
    n_sampled = round(gs.sampled_fraction * len(prompts))
    sampled_idx = set(rng.sample(range(len(prompts)), n_sampled)) if n_sampled else set()
    reqs, metas = [], []
    prompt_ids = [(i, p, ids) for i, p in enumerate(prompts)
                  if len(ids := prompt_token_ids(engine, p.messages)) <= gs.max_prompt_len]
    skipped = len(prompts) - len(prompt_ids)
    for rep in range(1 + gs.extra_sampled):
        for i, p, ids in prompt_ids:
            sampled = rep > 0 or i in sampled_idx
            sp = {"max_new_tokens": gs.max_new_tokens, "temperature": gs.temperature if sampled else 0.0,
                  "seed": (gs.seed * 1_000_003 + i) * 7919 + rep}
            reqs.append(core.make_request(ids, sp))
            metas.append((sampled, p.source))
    if skipped:
        logger.info("skipped %d prompts longer than %d tokens", skipped, gs.max_prompt_len)
    sched = core.scheduler
    # Feed the engine in waves: a request enters only when a quarter of the running slots is free, so each
    # prefill step batches many prompts (with one prompt per freed slot, nearly every graphed decode step of a long
    # generation run is followed by a small eager prefill step, which costs several decode steps).
    cap = sched.model_runner.max_running
    wave = max(1, cap // 4)
    queue = deque(reqs)
    pending: set[str] = set()
    t0, new_tokens, stopped = time.perf_counter(), 0, False
    with tqdm(total=len(reqs), desc="Generating responses", unit="seq", disable=None) as bar:
        while queue or pending:
            if queue and len(pending) <= cap - wave:
                for _ in range(min(len(queue), cap - len(pending))):
                    r = queue.popleft()
                    sched.add_request(r)
                    pending.add(r.rid)
            for r in sched.step():
                if r.finished and r.rid in pending:
                    pending.discard(r.rid)
                    new_tokens += len(r.output_ids)
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{new_tokens / max(time.perf_counter() - t0, 1e-6):.0f}")
            if pending and not sched.has_work:
                raise RuntimeError("the engine went idle with unfinished generation requests")
            if gs.time_budget_s is not None and time.perf_counter() - t0 > gs.time_budget_s and not stopped:
                logger.info("generation time budget reached: stopping %d requests, %d never started", len(pending),
                            len(queue))
                for rid in list(pending):
                    sched.abort(rid)
                sched.step()  # hands back the aborted requests (their KV is already freed)
                pending.clear()
                queue.clear()
                stopped = True
    dt = time.perf_counter() - t0
    out = [Sample(list(r.origin_input_ids), list(r.output_ids), s, src) for r, (s, src) in zip(reqs, metas)
           if r.finished and (r.finished_reason["type"] != "abort" or len(r.output_ids) >= MIN_PARTIAL_TOKENS)]
    tokens = sum(len(s.response_ids) for s in out)
    logger.info("generated %d responses (%d requested), %d tokens in %.1f s (%.0f tokens/s)", len(out), len(reqs),
                tokens, dt, tokens / max(dt, 1e-6))
    return out


def cache_key(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def load_cached(out_dir: str, key: str) -> list[Sample] | None:
    meta_path, data_path = os.path.join(out_dir, CACHE_META), os.path.join(out_dir, CACHE_FILE)
    if not (os.path.exists(meta_path) and os.path.exists(data_path)):
        return None
    with open(meta_path) as f:
        if json.load(f).get("key") != key:
            return None
    with gzip.open(data_path, "rt", encoding="utf-8") as f:
        return [Sample(**json.loads(line)) for line in f if line.strip()]


def save_cache(out_dir: str, key: str, fields: dict, samples: list[Sample]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    data_path = os.path.join(out_dir, CACHE_FILE)
    with gzip.open(data_path + ".tmp", "wt", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(asdict(s)) + "\n")
    os.replace(data_path + ".tmp", data_path)  # the meta file is written last: a torn run is never reused
    with open(os.path.join(out_dir, CACHE_META), "w") as f:
        json.dump({"key": key, "fields": fields, "num_samples": len(samples)}, f, indent=2)
