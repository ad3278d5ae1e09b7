"""Benchmark prompts: random token ids (exact lengths), groups of random prompts sharing a system prompt (SGLang's
generated-shared-prefix, for the prefix cache), or a jsonl file of prompts / chat conversations. Requests with images:
bench/image_dataset.py."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

PROMPT_FIELDS = ("prompt", "text", "question", "instruction")


@dataclass
class BenchRequest:
    """One prompt to send. Which of the three forms a backend uses is the backend's choice:
    native /generate prefers `prompt_ids` (exact length), /v1/completions `prompt`, chat `messages`."""

    prompt: str  # text form (decoded ids, or the chat template applied to messages)
    prompt_len: int  # our own token count; the server's count (usage / meta_info) replaces it when reported
    output_len: int  # max new tokens
    prompt_ids: list[int] | None = None  # random and generated-shared-prefix datasets: the exact ids
    messages: list[dict] | None = None  # chat form; None means "one user turn holding `prompt`"
    image_data: list[str] | None = None  # image dataset: data URLs, sent as /generate's image_data (the chat form
    # holds the same URLs as image_url parts)

    def chat_messages(self) -> list[dict]:
        return self.messages if self.messages is not None else [{"role": "user", "content": self.prompt}]


def uniform_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    """n integers uniform in [max(1, floor(length * ratio)), length], like sglang's random dataset."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    low = max(1, int(length * range_ratio))
    return rng.integers(low, length + 1, size=n)  # [n]


def usable_token_ids(tokenizer) -> np.ndarray:
    """Every id of the vocabulary except the special ones (BOS/EOS/pad/...): random prompts must not contain an
    EOS or a chat marker that would change how the server treats them."""
    special = set(tokenizer.all_special_ids)
    ids = np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)  # [usable_vocab]
    if ids.size == 0:
        raise ValueError("the tokenizer has no non-special tokens")
    return ids


def random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int) -> list[BenchRequest]:
    """Random token-id prompts. `prompt_ids` has exactly the sampled length; `prompt` is its decoded text, which a
    text backend re-tokenizes (the count may drift a little; the server-reported count is what gets summed)."""
    rng = np.random.default_rng(seed)
    in_lens = uniform_lengths(rng, num_prompts, input_len, range_ratio)  # [num_prompts]
    out_lens = uniform_lengths(rng, num_prompts, output_len, range_ratio)  # [num_prompts]
    vocab = usable_token_ids(tokenizer)
    reqs = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist(), strict=True):
        ids = rng.choice(vocab, size=n_in).tolist()  # [n_in]
        reqs.append(BenchRequest(prompt=tokenizer.decode(ids), prompt_len=n_in, output_len=n_out, prompt_ids=ids))
    return reqs


def shared_prefix_requests(tokenizer, num_groups: int, prompts_per_group: int, system_prompt_len: int,
                           question_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """SGLang bench_serving's generated-shared-prefix dataset, as token ids: each of `num_groups` groups has one
    random system prompt of `system_prompt_len` tokens that its `prompts_per_group` prompts start with, each followed
    by a random question of `question_len` tokens; every request asks for `output_len` tokens. The requests come
    shuffled (groups interleaved), as SGLang's do."""
    for name, v in (("--gsp-num-groups", num_groups), ("--gsp-prompts-per-group", prompts_per_group),
                    ("--gsp-system-prompt-len", system_prompt_len), ("--gsp-question-len", question_len),
                    ("--gsp-output-len", output_len)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    rng = np.random.default_rng(seed)
    vocab = usable_token_ids(tokenizer)
    reqs = []
    for _ in range(num_groups):
        system = rng.choice(vocab, size=system_prompt_len).tolist()  # [system_prompt_len]
        for _ in range(prompts_per_group):
            ids = system + rng.choice(vocab, size=question_len).tolist()  # [system_prompt_len + question_len]
            reqs.append(BenchRequest(prompt=tokenizer.decode(ids), prompt_len=len(ids), output_len=output_len,
                                     prompt_ids=ids))
    order = rng.permutation(len(reqs))  # [num_groups * prompts_per_group]
    return [reqs[i] for i in order.tolist()]


def _record_to_request(rec: dict, tokenizer, output_len: int, line_no: int, path: str) -> BenchRequest:
    if "messages" in rec:
        messages = rec["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f"{path}:{line_no}: 'messages' must be a list of {{role, content}} objects")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return BenchRequest(prompt=text, prompt_len=len(tokenizer.encode(text, add_special_tokens=False)),
                            output_len=output_len, messages=messages)
    for key in PROMPT_FIELDS:
        if isinstance(rec.get(key), str) and rec[key]:
            text = rec[key]
            return BenchRequest(prompt=text, prompt_len=len(tokenizer.encode(text)), output_len=output_len)
    raise ValueError(f"{path}:{line_no}: no 'messages' and none of the fields {', '.join(PROMPT_FIELDS)}")


def jsonl_requests(path: str, tokenizer, num_prompts: int, output_len: int) -> list[BenchRequest]:
    """The first `num_prompts` records of a jsonl file. Each record holds a prompt in one of PROMPT_FIELDS, or a chat
    conversation in "messages"; an optional integer "output_len" / "max_tokens" overrides --random-output-len."""
    reqs: list[BenchRequest] = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if len(reqs) >= num_prompts:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not JSON ({e})") from e
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object")
            n_out = rec.get("output_len", rec.get("max_tokens", output_len))
            if not isinstance(n_out, int) or n_out < 1:
                raise ValueError(f"{path}:{line_no}: output_len must be a positive integer, got {n_out!r}")
            reqs.append(_record_to_request(rec, tokenizer, n_out, line_no, path))
    if not reqs:
        raise ValueError(f"{path}: no prompts found")
    return reqs
