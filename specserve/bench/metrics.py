"""Summary of a benchmark run, with sglang.bench_serving's field names (times in ms, throughputs per second)."""

from __future__ import annotations

import numpy as np

from specserve.bench.backends import RequestOutput


def _stats(name: str, values: list[float], percentiles: tuple[int, ...] = (99,), with_max: bool = False) -> dict:
    """mean/median/std/pXX of `values` (seconds) as `{stat}_{name}_ms`; None for every stat when there is no value."""
    arr = np.asarray(values, dtype=np.float64) * 1000.0  # [n] ms
    empty = arr.size == 0
    out = {
        f"mean_{name}_ms": None if empty else float(arr.mean()),
        f"median_{name}_ms": None if empty else float(np.median(arr)),
        f"std_{name}_ms": None if empty else float(arr.std()),
    }
    for p in percentiles:
        out[f"p{p}_{name}_ms"] = None if empty else float(np.percentile(arr, p))
    if with_max:
        out[f"max_{name}_ms"] = None if empty else float(arr.max())
    return out


def mean_accept_length(outputs: list[RequestOutput]) -> float | None:
    """Tokens per verify step over the run: weighted by each request's verify count when every reporting request
    gave one (= total accepted tokens / total verify steps), else the plain mean over requests."""
    rep = [o for o in outputs if o.success and o.accept_length is not None]
    if not rep:
        return None
    if all(o.verify_ct is not None for o in rep):
        steps = sum(o.verify_ct for o in rep)
        if steps > 0:
            return sum(o.accept_length * o.verify_ct for o in rep) / steps
    return float(np.mean([o.accept_length for o in rep]))


def cached_tokens(outputs: list[RequestOutput]) -> tuple[int | None, float | None]:
    """Prompt tokens the server's prefix cache gave over the successful requests that report them, and their share
    of those requests' prompt tokens (the prefill saved); (None, None) when no request reported it."""
    rep = [o for o in outputs if o.success and o.cached_tokens is not None]
    if not rep:
        return None, None
    cached = sum(o.cached_tokens for o in rep)
    prompt = sum(o.prompt_len for o in rep)
    return cached, cached / prompt if prompt else 0.0


def compute_metrics(outputs: list[RequestOutput], duration: float) -> dict:
    """Aggregate per-request measurements. Every successful output must have output_len set (the runner fills it
    by re-tokenizing the text when the server reported none)."""
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_len or 0 for o in ok)
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if (o.output_len or 0) > 1]
    itls = [gap for o in ok for gap in o.itl]
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    m = {
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(total_in),
        "output_throughput": per_s(total_out),
        "total_throughput": per_s(total_in + total_out),
        # mean number of requests in flight: total request time over wall time (sglang's definition)
        "concurrency": per_s(sum(o.latency for o in ok)),
        "accept_length": mean_accept_length(ok),
    }
    m["total_cached_tokens"], m["cache_hit_rate"] = cached_tokens(ok)
    m.update(_stats("ttft", [o.ttft for o in ok]))
    m.update(_stats("tpot", tpots))
    m.update(_stats("itl", itls, percentiles=(95, 99), with_max=True))
    m.update(_stats("e2e_latency", [o.latency for o in ok]))
    return m


_MAIN_STATS = (("mean", "Mean"), ("median", "Median"), ("p99", "P99"))


def _fmt(v, spec: str = ".2f") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def format_summary(result: dict) -> str:
    """The console table, laid out like sglang.bench_serving's."""
    rows: list[str] = []

    def line(label: str, v, spec: str = ".2f") -> None:
        rows.append(f"{label:<40} {_fmt(v, spec):<10}")

    def head(title: str, fill: str = "-") -> None:
        rows.append(f"{title:{fill}^50}")

    head(" Serving Benchmark Result ", "=")
    line("Backend:", result["backend"])
    line("Traffic request rate:", result["request_rate"])
    line("Max request concurrency:", result["max_concurrency"] if result["max_concurrency"] else "not set")
    line("Successful requests:", result["completed"])
    line("Failed requests:", result["failed"])
    line("Benchmark duration (s):", result["duration"])
    line("Total input tokens:", result["total_input_tokens"])
    line("Total generated tokens:", result["total_output_tokens"])
    line("Request throughput (req/s):", result["request_throughput"])
    line("Input token throughput (tok/s):", result["input_throughput"])
    line("Output token throughput (tok/s):", result["output_throughput"])
    line("Total token throughput (tok/s):", result["total_throughput"])
    line("Concurrency:", result["concurrency"])
    line("Accept length:", result["accept_length"])
    scope = "this run" if result.get("server_accept_length_scope") == "run" else "since it started"
    line(f"Accept length (server, {scope}):", result.get("server_accept_length"))
    for title, key, label in (("End-to-End Latency", "e2e_latency", "E2E Latency"),
                              ("Time to First Token", "ttft", "TTFT"),
                              ("Time per Output Token (excl. 1st token)", "tpot", "TPOT")):
        head(title)
        for stat, name in _MAIN_STATS:
            line(f"{name} {label} (ms):", result[f"{stat}_{key}_ms"])
        if key == "ttft":  # what the prefix cache saved of the prefill, next to the latency it shortens
            line("Cached prompt tokens:", result.get("total_cached_tokens"))
            rate = result.get("cache_hit_rate")
            line("Prompt tokens from cache (%):", None if rate is None else 100.0 * rate)
    head("Inter-Token Latency")
    for stat, name in (("mean", "Mean"), ("median", "Median"), ("p95", "P95"), ("p99", "P99"), ("max", "Max")):
        line(f"{name} ITL (ms):", result[f"{stat}_itl_ms"])
    head("", "=")
    return "\n".join(rows)
