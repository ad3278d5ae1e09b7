"""GSM8K accuracy through an OpenAI-compatible server: data loading, prompts, answer extraction, a concurrent run.

Completion API: few-shot "Question: ...\\nAnswer: ..." prompts ending in "#### N", stopped at the next "Question:".
Chat API: one user turn (optionally after K shot turns) that asks for a final "The answer is N.".
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

COMPLETION_STOP = ["Question:"]
CHAT_INSTRUCTION = ("Solve the following math problem step by step. End your response with a last line of the form "
                    '"The answer is N." where N is the final number only.')
_CALC = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations, e.g. "<<16-3-4=9>>"
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
_ANSWER_IS = re.compile(r"answer is", re.IGNORECASE)
REQUEST_TIMEOUT_S = 3600


@dataclass
class Example:
    question: str
    answer: str  # the reference solution, ending in "#### N"

    @property
    def gold(self) -> float:
        value = extract_answer(self.answer)
        if value is None:
            raise ValueError(f"reference answer has no number: {self.answer[-80:]!r}")
        return value

    def solution(self, final: str = "####") -> str:
        """The reference solution without calculator annotations; final="####" keeps "#### N", otherwise the last
        line becomes "The answer is N."."""
        body, _, num = _CALC.sub("", self.answer).rpartition("####")
        num = num.strip()
        return f"{body.rstrip()}\n#### {num}" if final == "####" else f"{body.rstrip()}\nThe answer is {num}."


def load_gsm8k(path: str) -> list[Example]:
    """A GSM8K jsonl file: one {"question": ..., "answer": "... #### N"} object per line."""
    out = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if not isinstance(rec.get("question"), str) or not isinstance(rec.get("answer"), str):
                raise ValueError(f"{path}:{line_no}: needs string fields 'question' and 'answer'")
            if "####" not in rec["answer"]:
                raise ValueError(f"{path}:{line_no}: the answer has no '#### N' line")
            out.append(Example(rec["question"], rec["answer"]))
    return out


def parse_number(token: str) -> float | None:
    s = token.replace("$", "").replace(",", "")
    try:
        return float(s)
    except ValueError:
        return None


def _first_number(text: str) -> float | None:
    m = _NUMBER.search(text)
    return parse_number(m.group()) if m else None


def extract_answer(text: str) -> float | None:
    """The number after the last "####", else after the last "answer is", else the last number of the text;
    None when there is no number (an invalid answer)."""
    if "####" in text:
        v = _first_number(text.rpartition("####")[2])
        if v is not None:
            return v
    hits = list(_ANSWER_IS.finditer(text))
    if hits:
        v = _first_number(text[hits[-1].end():])
        if v is not None:
            return v
    nums = _NUMBER.findall(text)
    return parse_number(nums[-1]) if nums else None


def is_correct(pred: float | None, gold: float) -> bool:
    return pred is not None and math.isclose(pred, gold, rel_tol=1e-6, abs_tol=1e-6)


def completion_prompt(shots: list[Example], question: str) -> str:
    parts = [f"Question: {s.question}\nAnswer: {s.solution('####')}\n\n" for s in shots]
    return "".join(parts) + f"Question: {question}\nAnswer:"


def chat_messages(shots: list[Example], question: str) -> list[dict]:
    msgs: list[dict] = []
    for s in shots:
        msgs.append({"role": "user", "content": f"{CHAT_INSTRUCTION}\n\n{s.question}"})
        msgs.append({"role": "assistant", "content": s.solution("answer is")})
    msgs.append({"role": "user", "content": f"{CHAT_INSTRUCTION}\n\n{question}"})
    return msgs


@dataclass
class EvalConfig:
    base_url: str
    api: str  # "chat" | "completion"
    model: str | None
    max_tokens: int = 512
    temperature: float = 0.0
    num_threads: int = 64  # requests in flight
    chat_template_kwargs: dict | None = None
    headers: dict | None = None
    disable_tqdm: bool = False


@dataclass
class ExampleResult:
    pred: float | None = None
    correct: bool = False
    text: str = ""
    error: str = ""
    completion_tokens: int = 0
    accept_length: float | None = None
    verify_ct: int | None = None


def request_body(cfg: EvalConfig, shots: list[Example], question: str) -> tuple[str, dict]:
    """(route, JSON body) for one question."""
    body: dict = {"model": cfg.model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature}
    if cfg.api == "chat":
        body["messages"] = chat_messages(shots, question)
        if cfg.chat_template_kwargs:
            body["chat_template_kwargs"] = cfg.chat_template_kwargs
        return "/v1/chat/completions", body
    body["prompt"] = completion_prompt(shots, question)
    body["stop"] = COMPLETION_STOP
    return "/v1/completions", body


def response_text(api: str, resp: dict) -> str:
    choice = resp["choices"][0]
    if api == "chat":
        msg = choice.get("message") or {}
        # a reasoning model may leave the final answer only in its reasoning when it runs out of tokens
        return msg.get("content") or msg.get("reasoning_content") or ""
    return choice.get("text") or ""


async def _ask(session: aiohttp.ClientSession, cfg: EvalConfig, shots: list[Example], ex: Example) -> ExampleResult:
    route, body = request_body(cfg, shots, ex.question)
    res = ExampleResult()
    try:
        async with session.post(cfg.base_url + route, json=body, headers=cfg.headers) as r:
            payload = await r.text()
            if r.status != 200:
                res.error = f"HTTP {r.status}: {payload[:300]}"
                return res
        resp = json.loads(payload)
        res.text = response_text(cfg.api, resp)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    usage = resp.get("usage") or {}
    res.completion_tokens = int(usage.get("completion_tokens") or 0)
    spec = usage.get("spec") or {}
    res.accept_length = spec.get("accept_length")
    res.verify_ct = spec.get("verify_ct")
    res.pred = extract_answer(res.text)
    res.correct = is_correct(res.pred, ex.gold)
    return res


async def _run_all(cfg: EvalConfig, shots: list[Example], examples: list[Example]) -> list[ExampleResult]:
    sem = asyncio.Semaphore(cfg.num_threads)
    pbar = tqdm(total=len(examples), desc="gsm8k", unit="q", disable=cfg.disable_tqdm)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(ex: Example) -> ExampleResult:
            async with sem:
                res = await _ask(session, cfg, shots, ex)
            pbar.update(1)
            return res

        results = await asyncio.gather(*(one(ex) for ex in examples))
    pbar.close()
    return list(results)


def summarize(results: list[ExampleResult], latency: float) -> dict:
    n = len(results)
    answered = [r for r in results if not r.error]
    out_tokens = sum(r.completion_tokens for r in answered)
    spec = [r for r in answered if r.accept_length is not None]
    accept = None
    if spec and all(r.verify_ct for r in spec):
        accept = sum(r.accept_length * r.verify_ct for r in spec) / sum(r.verify_ct for r in spec)
    elif spec:
        accept = sum(r.accept_length for r in spec) / len(spec)
    num_invalid = sum(1 for r in answered if r.pred is None)
    correct = sum(1 for r in results if r.correct)
    return {
        "num_examples": n,
        "correct": correct,
        "accuracy": correct / n if n else 0.0,
        "num_invalid": num_invalid,
        "invalid": num_invalid / n if n else 0.0,
        "failed": n - len(answered),
        "latency": latency,
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / latency if latency > 0 else 0.0,
        "accept_length": accept,
    }


def run_gsm8k(cfg: EvalConfig, shots: list[Example], examples: list[Example]) -> tuple[dict, list[ExampleResult]]:
    """Ask every example (failed requests count as wrong) and summarise: accuracy, invalid rate, wall time,
    output throughput, mean accept length when the server reports usage.spec."""
    start = time.perf_counter()
    results = asyncio.run(_run_all(cfg, shots, examples))
    return summarize(results, time.perf_counter() - start), results
