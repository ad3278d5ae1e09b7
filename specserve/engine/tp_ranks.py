"""The tensor-parallel ranks of one engine (`--tp-size N`): rank 0 runs the scheduler; ranks 1..N-1 follow.

Rank 0 (`TPLeader`, owned by the EngineCore) starts the other ranks of its machine as processes of their own
(`python -m specserve.engine.tp_ranks`: a daemonic model process may not fork multiprocessing children); with
`--nnodes M` each other machine runs `specserve serve --node-rank k` (no HTTP server there: `run_node` starts its
ranks, which join node 0's rendezvous at `--dist-init-addr`); under torchrun every rank is torchrun's process
(rank 0 serves, the others follow: server/launch.py). Rank 0 joins all of them in one
torch.distributed group (NCCL on GPUs, gloo on CPUs; distributed/tp.py), and before every forward step broadcasts a
`StepMessage` over a gloo control group: what the step runs (prefill chunks, a decode step, a speculative or an
adaptive plain step) with the requests' host data, and the page-table entries the step writes. A follower (`follow`)
has the same model runner over its slice of every weight, but no scheduler and no allocator: it writes those table
entries (and, for a request's first prefill chunk, zeroes and binds the recurrent-state row rank 0 gave it) and runs
the same step function (engine/steps.py). Every rank gathers the full logits and samples with the
same counter-based noise, so every rank produces the same tokens and keeps the same last-token and draft state
without further messages.

A rank that dies takes the engine down: rank 0 checks its followers before each broadcast and raises with the
rank's exit code; a follower whose leader is gone fails its next receive and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from specserve.distributed.tp import TPGroup, init_tp
from specserve.engine.loading import build_model_runner
from specserve.engine.model_runner import ModelRunner
from specserve.engine.request import Req
from specserve.engine.steps import Chunk, run_decode, run_plain_step, run_prefill, run_spec_step
from specserve.server_args import ServerArgs

logger = logging.getLogger(__name__)
TIMEOUT = timedelta(seconds=120)  # a collective waiting longer on a rank fails instead of hanging


@dataclass
class StepMessage:
    kind: str  # "prefill" | "decode" | "spec" | "plain" | "stop"
    rows: list[int] = field(default_factory=list)  # page-table entries the step writes: (rows[i], cols[i]) ->
    cols: list[int] = field(default_factory=list)  # slots[i]
    slots: list[int] = field(default_factory=list)
    items: list[dict] = field(default_factory=list)  # per chunk (prefill) or per request (decode steps)


def _slots(req: Req, cols: range, page_size: int) -> list[int]:
    """The KV slots of a request's sequence positions, from its pages on the host (what KVManager.ensure wrote into
    the page table): no read of the device table, so no sync in the step."""
    pages = req.kv.pages
    return [pages[c // page_size] * page_size + c % page_size for c in cols]


def prefill_message(model_runner: ModelRunner, chunks: list[Chunk]) -> StepMessage:
    rows, cols, slots, items = [], [], [], []
    ps = model_runner.page_size
    for c in chunks:
        r = c.req
        first = c.start - c.cached  # a prefix-cache hit's positions too: the followers' rows need them
        rows += [r.kv.row] * (c.end - first)
        cols += range(first, c.end)
        slots += _slots(r, range(first, c.end), ps)
        items.append(dict(rid=r.rid, fill=r.fill_ids[:c.end + 1], start=c.start, end=c.end, cached=c.cached,
                          prefill_len=r.prefill_len, row=r.kv.row, sampling=r.sampling, seed=r.seed,
                          mrope_delta=r.mrope_delta,
                          # a request's first chunk (after its cached prefix): the state row rank 0 gave it
                          state_row=r.kv.state_row if c.start == c.cached else 0))
    return StepMessage("prefill", rows, cols, slots, items)


def decode_message(model_runner: ModelRunner, kind: str, reqs: list[Req]) -> StepMessage:
    """kind: "decode" (one new position a request), "spec" (N + 1) or "plain" (one)."""
    width = model_runner.num_steps + 1 if kind == "spec" else 1
    rows = [r.kv.row for r in reqs for _ in range(width)]
    cols = [r.seq_len + j for r in reqs for j in range(width)]
    slots = [x for r in reqs for x in _slots(r, range(r.seq_len, r.seq_len + width), model_runner.page_size)]
    items = [dict(row=r.kv.row, seq_len=r.seq_len, mrope_delta=r.mrope_delta, sampling=r.sampling, seed=r.seed)
             for r in reqs]
    return StepMessage(kind, rows, cols, slots, items)


def _request(item: dict) -> Req:
    r = Req(rid=item.get("rid", ""), origin_input_ids=list(item.get("fill", [])), sampling=item["sampling"],
            seed=item["seed"])
    r.kv.row = item["row"]
    r.mrope_delta = item["mrope_delta"]
    r.seq_len = item.get("seq_len", 0)
    r.prefill_len = item.get("prefill_len", 0)
    return r


def apply(model_runner: ModelRunner, msg: StepMessage) -> None:
    """Run on a follower the step rank 0 runs."""
    if msg.rows:
        table = model_runner.req_to_token.table
        dev = table.device
        table[torch.tensor(msg.rows, device=dev), torch.tensor(msg.cols, device=dev)] = torch.tensor(
            msg.slots, dtype=table.dtype, device=dev)
    if msg.kind == "prefill":
        pool = model_runner.caches.state
        for i in msg.items:
            if pool is not None and i["state_row"]:
                pool.reset(i["state_row"])
                pool.bind(i["row"], i["state_row"])
        run_prefill(model_runner, [Chunk(_request(i), i["start"], i["end"], i["cached"]) for i in msg.items])
    elif msg.kind == "decode":
        run_decode(model_runner, [_request(i) for i in msg.items])
    elif msg.kind == "spec":
        run_spec_step(model_runner, [_request(i) for i in msg.items])
    elif msg.kind == "plain":
        run_plain_step(model_runner, [_request(i) for i in msg.items])
    else:
        raise ValueError(f"unknown step {msg.kind!r}")


def rendezvous(args: ServerArgs) -> str:
    """The group's init method: node 0's --dist-init-addr across machines, else a free local port."""
    if args.nnodes > 1:
        return f"tcp://{args.dist_init_addr}"
    return f"tcp://127.0.0.1:{_free_port()}"


def start_local_ranks(args: ServerArgs, device: torch.device, init_method: str, first: int) -> list:
    """This machine's ranks from global rank node_rank * per_node + first on, each its own process."""
    per_node = args.tp_size // args.nnodes
    base = args.node_rank * per_node
    payload = json.dumps(dataclasses.asdict(args))
    return [subprocess.Popen([sys.executable, "-m", "specserve.engine.tp_ranks", "--rank", str(base + i),
                              "--local-rank", str(i), "--size", str(args.tp_size), "--init-method", init_method,
                              "--device", device.type, "--args", payload]) for i in range(first, per_node)]


def run_node(args: ServerArgs, device: torch.device) -> int:
    """A machine of node rank > 0: start its ranks (they join node 0's group and follow its steps) and wait for
    them; the exit code is the first non-zero one of theirs."""
    procs = start_local_ranks(args, device, rendezvous(args), first=0)
    logger.info("node %d: ranks %d..%d started, following node 0 at %s", args.node_rank,
                args.node_rank * len(procs), (args.node_rank + 1) * len(procs) - 1, args.dist_init_addr)
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _control_group():
    return dist.new_group(backend="gloo", timeout=TIMEOUT)


class TPLeader:
    """Rank 0's side: the follower processes, the group, the broadcasts."""

    def __init__(self, args: ServerArgs, device: torch.device):
        size = args.tp_size
        per_node = size // args.nnodes
        if device.type == "cuda" and torch.cuda.device_count() < per_node:
            raise ValueError(f"--tp-size {size} over {args.nnodes} node(s) needs {per_node} GPUs on this machine; "
                             f"it has {torch.cuda.device_count()}")
        launched = torchrun_env()
        if launched is not None:  # torchrun started every rank: nothing to start, rendezvous from its env
            if launched[2] != size:
                raise ValueError(f"torchrun started {launched[2]} processes; --tp-size is {size}")
            init_method, self.procs = "env://", []
        else:
            init_method = rendezvous(args)
            self.procs = start_local_ranks(args, device, init_method, first=1)
        try:
            self.tp: TPGroup = init_tp(0, size, init_method, timeout=TIMEOUT)
            self.ctrl = _control_group()
        except BaseException:
            self.kill()
            raise
        self.stopped = False

    def check_alive(self) -> None:
        for r, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None:
                raise RuntimeError(f"tensor-parallel rank {r} exited (code {code}); the engine stops")

    def send(self, msg: StepMessage) -> None:
        self.check_alive()
        dist.broadcast_object_list([msg], src=0, group=self.ctrl)

    def check_same_pools(self, model_runner: ModelRunner) -> None:
        """Every rank must have sized its pools alike (rank 0 allocates the slots all ranks write)."""
        mine = torch.tensor([model_runner.num_slots, model_runner.max_running], dtype=torch.int64)
        seen = [torch.zeros_like(mine) for _ in range(self.tp.size)]
        dist.all_gather(seen, mine, group=self.ctrl)
        if any(not torch.equal(s, mine) for s in seen):
            raise RuntimeError(f"tensor-parallel ranks sized their pools differently ({[s.tolist() for s in seen]}"
                               " slots, rows); pass --max-total-tokens and --max-running-requests")

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        try:
            self.send(StepMessage("stop"))
            dist.barrier(group=self.ctrl)  # every rank has its stop: none needs the rendezvous any more
            for p in self.procs:
                p.wait(timeout=60)
        except Exception as e:  # a rank already gone: make sure none is left behind
            logger.warning("stopping the tensor-parallel ranks: %s", e)
        finally:
            self.kill()
            if dist.is_initialized():
                dist.destroy_process_group()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()


def follow(model_runner: ModelRunner, ctrl) -> None:
    """A follower's loop: receive each step and run it, until "stop"."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=ctrl)
        msg = box[0]
        if msg.kind == "stop":
            return
        apply(model_runner, msg)


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, local rank, world size) when torchrun started this process (its RANK / LOCAL_RANK / WORLD_SIZE
    contract; the rendezvous is then env://), else None."""
    try:
        return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None


def run_follower(rank: int, local_rank: int, size: int, init_method: str, device_type: str,
                 args: ServerArgs) -> int:
    """A follower rank's whole life: its model runner over its slice, then every step rank 0 sends, until stop."""
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format=f"[%(asctime)s rank {rank} %(levelname)s] %(message)s", datefmt="%H:%M:%S")
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // (size // args.nnodes)))
        device = torch.device("cpu")
    tp = init_tp(rank, size, init_method, timeout=TIMEOUT)
    ctrl = _control_group()
    model_runner = build_model_runner(args, device, tp)
    mine = torch.tensor([model_runner.num_slots, model_runner.max_running], dtype=torch.int64)
    dist.all_gather([torch.zeros_like(mine) for _ in range(size)], mine, group=ctrl)
    follow(model_runner, ctrl)
    dist.barrier(group=ctrl)
    return 0


def exit_follower(code_fn) -> None:
    """Run a follower and leave the process at once: no process-group teardown at exit, which would race rank 0
    tearing down the rendezvous it hosts (gloo then aborts the process)."""
    try:
        code = code_fn()
    except BaseException:
        logger.exception("tensor-parallel rank failed")
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve.engine.tp_ranks",
                                description="one follower rank of a tensor-parallel engine (started by rank 0)")
    p.add_argument("--rank", type=int, required=True, help="global rank")
    p.add_argument("--local-rank", type=int, required=True, help="rank on this machine (its GPU)")
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--args", required=True, help="rank 0's resolved ServerArgs as JSON")
    a = p.parse_args(argv)
    exit_follower(lambda: run_follower(a.rank, a.local_rank, a.size, a.init_method, a.device,
                                       ServerArgs(**json.loads(a.args))))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
