"""The benchmark loop: Poisson (or burst) arrivals, a concurrency cap, progress, warm-up."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field, replace

import aiohttp
import numpy as np
from tqdm import tqdm

from specserve.bench.backends import Backend, RequestOutput, send_request
from specserve.bench.datasets import BenchRequest

# A benchmark request may legitimately run for a long time (long outputs on a loaded server).
REQUEST_TIMEOUT_S = 6 * 3600


@dataclass
class RunConfig:
    backend: Backend
    url: str  # full URL of the generation route
    model: str | None
    ignore_eos: bool
    extra_body: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    max_concurrency: int | None = None  # None: no cap
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    seed: int = 1
    disable_tqdm: bool = False


def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each of n requests: 0 for the first; exponential gaps (a Poisson process) at a finite
    rate, all 0 at rate inf."""
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {rate}")
    rng = np.random.default_rng(seed)
    return [0.0] + rng.exponential(1.0 / rate, size=n - 1).tolist()


def _session() -> aiohttp.ClientSession:
    # limit=0: no connector-level cap, so --max-concurrency alone bounds the requests in flight.
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
                                 connector=aiohttp.TCPConnector(limit=0))


async def _run(cfg: RunConfig, requests: list[BenchRequest], desc: str) -> tuple[list[RequestOutput], float]:
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    pbar = tqdm(total=len(requests), desc=desc, unit="req", disable=cfg.disable_tqdm)

    async with _session() as session:

        async def one(req: BenchRequest) -> RequestOutput:
            if sem is None:
                out = await send_request(session, cfg.backend, cfg.url, req, cfg.model, cfg.ignore_eos,
                                         cfg.extra_body, cfg.headers)
            else:
                async with sem:
                    out = await send_request(session, cfg.backend, cfg.url, req, cfg.model, cfg.ignore_eos,
                                             cfg.extra_body, cfg.headers)
            pbar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        for gap, req in zip(arrival_gaps(len(requests), cfg.request_rate, cfg.seed), requests, strict=True):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    pbar.close()
    return list(outputs), duration


def run_benchmark(cfg: RunConfig, requests: list[BenchRequest]) -> tuple[list[RequestOutput], float]:
    """Send every request; returns the per-request outputs (in request order) and the wall time in seconds."""
    return asyncio.run(_run(cfg, requests, desc="bench"))


def run_warmup(cfg: RunConfig, first: BenchRequest, n: int, max_new_tokens: int = 16) -> list[RequestOutput]:
    """n concurrent copies of the first prompt with a short output, not measured: the first requests of a fresh
    server pay for lazy initialisation."""
    if n <= 0:
        return []
    short = replace(first, output_len=min(first.output_len, max_new_tokens))
    warm = replace(cfg, max_concurrency=None, request_rate=math.inf, disable_tqdm=True)
    outputs, _ = asyncio.run(_run(warm, [short] * n, desc="warmup"))
    return outputs


def fill_missing_output_lens(outputs: list[RequestOutput], tokenizer) -> int:
    """For servers that report no completion token count, count the tokens of the returned text (may differ from
    what was generated). Returns how many requests needed it."""
    n = 0
    for o in outputs:
        if o.success and o.output_len is None:
            o.output_len = len(tokenizer.encode(o.text, add_special_tokens=False))
            n += 1
    return n
