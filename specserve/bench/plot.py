"""PNG of a concurrency sweep: output throughput and median TPOT against max concurrency.

Uses matplotlib's object API with the Agg canvas directly, so no global backend is switched (pyplot is not used).
"""

from __future__ import annotations

import importlib.util

MATPLOTLIB_HINT = "--plot needs matplotlib: pip install 'specserve[plot]'"


def check_available() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(MATPLOTLIB_HINT)


def _concurrency(r: dict) -> float:
    # An uncapped run is drawn at its number of prompts, the most requests that can be in flight.
    return r["max_concurrency"] if r["max_concurrency"] else r["num_prompts"]


def plot_sweep(results: list[dict], path: str, title: str = "") -> None:
    """results: summary dicts (one per concurrency point) holding max_concurrency, num_prompts, output_throughput
    and median_tpot_ms."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    pts = sorted(results, key=_concurrency)
    xs = [_concurrency(r) for r in pts]
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax_tp, ax_tpot = fig.subplots(1, 2)
    ax_tp.plot(xs, [r["output_throughput"] for r in pts], marker="o")
    ax_tp.set_ylabel("output throughput (tok/s)")
    tpot = [(x, r["median_tpot_ms"]) for x, r in zip(xs, pts, strict=True) if r["median_tpot_ms"] is not None]
    ax_tpot.plot([x for x, _ in tpot], [y for _, y in tpot], marker="o", color="tab:orange")
    ax_tpot.set_ylabel("median TPOT (ms)")
    for ax in (ax_tp, ax_tpot):
        ax.set_xlabel("max concurrency")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(int(x)) for x in xs])
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, format="png")
