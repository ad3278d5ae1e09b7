"""Tensor-parallel test helpers: one rank's run of a tiny checkpoint (load its slice, prefill a few prompts, greedy
decode steps through the model runner) and the process entry point for torch.multiprocessing.spawn (gloo)."""

from __future__ import annotations

import os

import torch

from specserve.distributed.tp import TP1, TPGroup, init_tp
from specserve.graphs.padding import ExtendBatch, LiveInputs
from specserve.models.loader import ModelSource, load_target
from specserve.server_args import ServerArgs


def run_model(path: str, tp: TPGroup, prompts: list[list[int]], steps: int,
              expert_parallel: bool = True) -> list[torch.Tensor]:
    """[prefill logits [T, V], then one [bs, V] per greedy decode step] for `prompts`, on this rank.
    expert_parallel: MoE experts partitioned over the ranks (--ep-size = --tp-size), else each split (--ep-size 1)."""
    return run_loaded(load_rank_model(path, tp, expert_parallel), path, prompts, steps)


def load_rank_model(path: str, tp: TPGroup, expert_parallel: bool = True, online_fp8: bool = False):
    """This rank's LoadedTarget of `path` on the CPU in float32; online_fp8: then --quantization fp8 applied."""
    from specserve.layers.quant import OnlineFp8, quantize_fp8_online

    t = load_target(ModelSource.resolve(path), torch.float32, torch.device("cpu"), 600, tp=tp,
                    expert_parallel=expert_parallel)
    if online_fp8:
        quantize_fp8_online(t.model, OnlineFp8())
    return t


def run_loaded(t, path: str, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """run_model's logits for an already loaded target `t`."""
    from specserve.engine.model_runner import ModelRunner
    from specserve.kvcache.manager import KVHandle

    cpu = torch.device("cpu")
    args = ServerArgs(model_path=path, max_total_tokens=2048, max_running_requests=8)
    mr = ModelRunner(args, t.model, t.config, None, cpu, torch.float32, 512)
    handles = [KVHandle() for _ in prompts]
    for h, p in zip(handles, prompts):
        assert mr.kv.assign_row(h) and mr.kv.ensure([h], [len(p) + steps + 1])
    ids = torch.tensor(sum(prompts, []))
    pos = torch.tensor(sum([list(range(len(p))) for p in prompts], []))
    table = mr.req_to_token.table
    loc = torch.cat([table[h.row, :len(p)] for h, p in zip(handles, prompts)])
    lens = [len(p) for p in prompts]
    with torch.inference_mode():
        hidden = mr.prefill.run(ExtendBatch(ids, pos, loc, [h.row for h in handles], lens, lens))
        out = [t.model.compute_logits(hidden)]
        ends = torch.tensor(lens).cumsum(0) - 1
        nxt = out[0][ends].argmax(-1)
        rows = torch.tensor([h.row for h in handles])
        s = torch.tensor(lens)
        for _ in range(steps):
            live = LiveInputs(len(prompts), nxt, s, rows, s + 1, int(s.max()) + 1)
            logits = mr.phases.decode.run(live)["logits"]
            out.append(logits)
            nxt = logits.argmax(-1)
            s = s + 1
    return out


def rank_main(rank: int, size: int, rendezvous: str, path: str, prompts: list[list[int]], steps: int,
              out: str, expert_parallel: bool = True) -> None:
    """rendezvous: a file:// init method (no store server in rank 0 that could go away before another rank's
    teardown)."""
    torch.set_num_threads(1)
    tp = init_tp(rank, size, rendezvous, "gloo")
    logits = run_model(path, tp, prompts, steps, expert_parallel)
    if rank == 0:
        torch.save(logits, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # End the rank here: under load, gloo's threads have once aborted the interpreter's own teardown afterwards
    # ("terminate called without an active exception", SIGABRT), failing a run whose results were all written.
    os._exit(0)


def fp8_rank_main(rank: int, size: int, rendezvous: str, jobs: list[tuple[str, bool, bool]],
                  prompts: list[list[int]], steps: int, out: str) -> None:
    """jobs: (path, expert_parallel, online_fp8) loaded and run one after the other in this one process launch;
    each rank saves `out`.{rank}: per job (its logits on rank 0, else None; the (linear layers, expert stacks) it
    holds in FP8, counted in the rank process)."""
    from test_fp8_checkpoint import fp8_modules

    torch.set_num_threads(1)
    tp = init_tp(rank, size, rendezvous, "gloo")
    results = []
    for path, expert_parallel, online in jobs:
        t = load_rank_model(path, tp, expert_parallel, online)
        logits = run_loaded(t, path, prompts, steps)
        results.append((logits if rank == 0 else None, fp8_modules(t.model)))
    torch.save(results, f"{out}.{rank}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)  # (rank_main says why)


def single(path: str, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    return run_model(path, TP1, prompts, steps)


def build_hybrids(root) -> dict[str, str]:
    """Tiny Qwen3-Next and Qwen3.5 checkpoints with MTP layers, under root."""
    from hybrid_helpers import build_tiny_hybrid

    return {kind: build_tiny_hybrid(str(root / kind), kind, seed=51 + i, mtp=True)
            for i, kind in enumerate(("qwen3_next", "qwen3_5"))}


def build_mla(root) -> dict[str, str]:
    """Tiny DeepSeek-V3 and GLM-5 (sparse top-k 5) checkpoints with MTP layers, under root."""
    from deepseek_helpers import build_tiny_deepseek, build_tiny_dsa
    from test_deepseek_dsa import _with_mtp

    return {"v3": build_tiny_deepseek(str(root / "v3"), seed=81, mtp=True),
            "glm": _with_mtp(build_tiny_dsa(str(root / "glm"), "glm_moe_dsa", seed=82, index_topk=5), 83)}


def check_dying_rank_stops_engine(path: str, prompts: list[list[int]], params: dict, **engine_kw) -> None:
    """Kill rank 1 of a TP2 engine: the next generate raises, naming the rank."""
    import pytest

    from specserve import Engine

    with Engine(model_path=path, tp_size=2, **engine_kw) as e:
        proc = e.core.tp_leader.procs[0]
        proc.kill()
        proc.wait()
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited"):
            e.generate(input_ids=prompts, sampling_params=params)

