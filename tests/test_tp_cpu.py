"""Tensor parallelism on CPU over gloo (issue 15, first step: the dense families at the model level): a tiny
checkpoint loaded as 2 and 4 ranks (each its slice of every weight; at 4 ranks the 2 KV heads are replicated) gives
the same prefill and greedy-decode logits as one rank, through the model runner's own prefill and decode paths;
tied embeddings too; Qwen3-MoE with its experts split over the ranks (expert parallelism). Families without
tensor-parallel layers refuse a group of more than one rank."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from tp_helpers import build_hybrids, build_mla, check_dying_rank_stops_engine, rank_main, single

from specserve.distributed.tp import TPGroup

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [7, 7, 120], [200, 1, 64, 33, 90, 12, 5, 77, 18, 140, 2]]
STEPS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_logits(path: str, size: int, tmp_path) -> list[torch.Tensor]:
    out = str(tmp_path / f"tp{size}.pt")
    rendezvous = f"file://{tmp_path / f'rdzv{size}'}"
    mp.spawn(rank_main, args=(size, rendezvous, path, PROMPTS, STEPS, out), nprocs=size, join=True)
    return torch.load(out)


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    from helpers import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tied") / "m"), "llama", seed=9, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    return build_hybrids(tmp_path_factory.mktemp("tp_hybrid"))


@pytest.mark.parametrize("arch,size", [("llama", 2), ("qwen2", 2), ("qwen3", 4), ("qwen3_moe", 2), ("qwen3_moe", 4)])
def test_tp_logits_equal_one_rank(tiny_models, arch, size, tmp_path):
    """qwen2: q/k/v biases (sliced with their heads) and no o-proj bias; qwen3: per-head q/k norms, and 4 ranks
    over 2 KV heads (replicated); qwen3_moe: attention and its dense layer split, the 8 experts split 4 / 2 a rank
    (expert parallelism over the same ranks)."""
    want = single(tiny_models[arch], PROMPTS, STEPS)
    got = _tp_logits(tiny_models[arch], size, tmp_path)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_tp_hybrid_logits_equal_one_rank(hybrids, kind, tmp_path):
    """The hybrid family at 2 ranks: gated-delta-net key / value heads (their conv channels, gates and state), gated
    attention heads and the experts split; Qwen3-Next's interleaved fused projections de-interleaved, then sliced;
    Qwen3.5's split projections."""
    want = single(hybrids[kind], PROMPTS, STEPS)
    for g, w in zip(_tp_logits(hybrids[kind], 2, tmp_path), want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def mla_models(tmp_path_factory):
    return build_mla(tmp_path_factory.mktemp("tp_mla"))


@pytest.mark.parametrize("key", ["v3", "glm"])
def test_tp_mla_logits_equal_one_rank(mla_models, key, tmp_path):
    """DeepSeek-V3 and GLM-5 (truly sparse top-k) at 2 ranks: MLA heads (q_b / kv_b rows, o_proj columns), the
    dense MLP and the grouped-sigmoid experts split; the latent cache and the indexer whole on every rank."""
    want = single(mla_models[key], PROMPTS, STEPS)
    for g, w in zip(_tp_logits(mla_models[key], 2, tmp_path), want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_tp_tied_embeddings(tied_llama, tmp_path):
    want = single(tied_llama, PROMPTS, STEPS)
    for g, w in zip(_tp_logits(tied_llama, 2, tmp_path), want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_tp_refuses_undeclared_families_and_bad_sizes(tiny_models):
    """A family class that does not declare tensor_parallel itself (here a subclass of the dense one) refuses a
    group of more than one rank; sizes that do not divide are refused with the size named."""
    from specserve.models.dense import DenseForCausalLM
    from specserve.models.loader import ModelSource, load_hf_config, load_target
    from specserve.models.registry import config_from_hf

    class Undeclared(DenseForCausalLM):
        pass

    cfg = config_from_hf(load_hf_config(ModelSource.resolve(tiny_models["llama"])))
    cfg.tp = TPGroup(0, 2)
    with torch.device("meta"), pytest.raises(ValueError, match="declares no tensor-parallel layers"):
        Undeclared(cfg, 64)
    with pytest.raises(ValueError, match="not divisible"):
        load_target(ModelSource.resolve(tiny_models["llama"]), torch.float32, torch.device("cpu"), 64,
                    tp=TPGroup(0, 3))


# ---------------------------------------------------------------------- the engine over ranks (engine/tp_ranks.py)
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
ENGINE = dict(max_total_tokens=2048, max_running_requests=8, dtype="float32")
ENGINE_PROMPTS = [[5, 17, 99, 3, 250], [7, 7, 120, 8], list(range(3, 40)), [9] * 21]


def _generate(path: str, params=GREEDY, **kw) -> list[list[int]]:
    from specserve import Engine

    with Engine(model_path=path, **{**ENGINE, **kw}) as e:
        if e.core.tp_leader is not None:
            procs = e.core.tp_leader.procs
        out = [o["output_ids"] for o in e.generate(input_ids=ENGINE_PROMPTS, sampling_params=params)]
        e.core.scheduler.check_idle_invariants()
    if kw.get("tp_size", 1) > 1:  # this machine's other ranks stopped cleanly
        assert [p.returncode for p in procs] == [0] * (kw["tp_size"] // kw.get("nnodes", 1) - 1)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("key,spec", [("llama_mtp", None), ("llama_mtp", 3), ("qwen3_moe", None),
                                      ("qwen3_next", 3), ("glm", 3)])
def test_engine_tp2_equals_one_rank(tiny_models, hybrids, mla_models, key, spec):
    """rank 0 schedules and broadcasts each step; greedy tokens equal one rank's, with MTP speculation (the draft
    split like the target) and adaptive plain steps interleaved, for Qwen3-MoE (experts split) and Qwen3-Next (the
    recurrent-state rows rank 0 allocates, zeroed and bound on the other ranks; the reference's TP2 / EP2 shape)."""
    path = {**tiny_models, **hybrids, **mla_models}[key]
    kw = dict(speculative_algorithm="MTP", speculative_num_steps=spec, speculative_adaptive=True) if spec else {}
    ref = _generate(path)
    assert _generate(path, tp_size=2, **kw) == ref


@pytest.mark.timeout(240)
@pytest.mark.parametrize("key", ["llama", "qwen3_next"])
def test_engine_tp2_retraction_and_sampling(tiny_models, hybrids, key):
    """A pool of 16-token pages small enough to retract (re-prefills with new slots and, for the hybrid, fresh state
    rows, sent to the other ranks), rows reused by later requests, mixed greedy and sampled requests: greedy ones
    equal one rank's, sampled ones finish with their token counts."""
    from test_kv_accounting import _workload

    from specserve import Engine

    prompts, params = _workload()
    path = hybrids[key] if key in hybrids else tiny_models[key]
    kw = dict(model_path=path, context_length=128, chunked_prefill_size=32, max_running_requests=8,
              schedule_conservativeness=0.0, dtype="float32", max_total_tokens=200, page_size=16)
    with Engine(**kw) as e:
        ref = e.generate(input_ids=prompts, sampling_params=params)
    with Engine(tp_size=2, **kw) as e:
        got = e.generate(input_ids=prompts, sampling_params=params)
        assert e.core.scheduler.stats.num_retractions > 0
        e.core.scheduler.check_idle_invariants()
    for a, b, p in zip(got, ref, params):
        assert len(a["output_ids"]) == len(b["output_ids"]) or p.get("stop") or p.get("stop_token_ids") or \
            not p.get("ignore_eos")
        if p["temperature"] == 0.0:
            assert a["output_ids"] == b["output_ids"]


@pytest.mark.timeout(240)
def test_engine_stops_when_a_rank_dies(tiny_models):
    check_dying_rank_stops_engine(tiny_models["llama"], ENGINE_PROMPTS[:1], GREEDY, **ENGINE)


@pytest.mark.timeout(300)
def test_live_server_tp2_answers_the_openai_client(tiny_models, tmp_path):
    from openai import OpenAI
    from server_fixtures import start_server

    srv = start_server(["--model-path", tiny_models["llama"], "--tp-size", "2", "--max-total-tokens", "2048",
                        "--dtype", "float32"], str(tmp_path / "server.log"))
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="hello there", max_tokens=8, temperature=0.0)
        assert out.usage.completion_tokens == 8
        assert srv.server_info()["tp_size"] == 2
    finally:
        assert srv.terminate() == 0, srv.log()


@pytest.mark.timeout(240)
def test_two_nodes_on_one_machine(tiny_models, tmp_path):
    """--nnodes 2: node 1 (`specserve serve --node-rank 1`, no HTTP server) runs its rank and joins node 0's
    rendezvous at --dist-init-addr; the engine on node 0 gives one rank's tokens and, on shutdown, node 1 exits 0."""
    import subprocess
    import sys

    path = tiny_models["llama"]
    ref = _generate(path)
    addr = f"127.0.0.1:{_free_port()}"
    multi = dict(tp_size=2, nnodes=2, dist_init_addr=addr)
    node1 = subprocess.Popen([sys.executable, "-m", "specserve.launch_server", "--model-path", path, "--tp-size", "2",
                              "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr, "--max-total-tokens",
                              "2048", "--max-running-requests", "8", "--dtype", "float32"],
                             stdout=open(tmp_path / "node1.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    try:
        assert _generate(path, **multi) == ref
        assert node1.wait(timeout=60) == 0, (tmp_path / "node1.log").read_text()
    finally:
        if node1.poll() is None:
            node1.kill()


def test_multi_node_flags_are_checked():
    from specserve.server_args import ServerArgs

    for kw, needle in ((dict(tp_size=3, nnodes=2), "divide"), (dict(tp_size=2, nnodes=2), "dist-init-addr"),
                       (dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), "node-rank")):
        with pytest.raises(ValueError, match=needle):
            ServerArgs(**kw)


@pytest.mark.timeout(300)
def test_live_server_under_torchrun(tiny_models, tmp_path):
    """torchrun --nproc-per-node 2 -m specserve.launch_server --tp-size 2: rank 0 serves, rank 1 follows."""
    import subprocess
    import sys
    import time

    import httpx
    from server_fixtures import free_port

    port = free_port()
    log = open(tmp_path / "torchrun.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(_free_port()), "-m", "specserve.launch_server", "--model-path",
                             tiny_models["llama"], "--tp-size", "2", "--port", str(port), "--max-total-tokens", "2048",
                             "--max-running-requests", "8", "--dtype", "float32", "--skip-warmup"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 150
        while True:
            assert proc.poll() is None, (tmp_path / "torchrun.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, (tmp_path / "torchrun.log").read_text()
            time.sleep(0.5)
        r = httpx.post(url + "/generate", json={"input_ids": ENGINE_PROMPTS[0], "sampling_params": GREEDY},
                       timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == _generate(tiny_models["llama"])[0]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.timeout(240)
def test_engine_tp2_prefix_cache_hits_equal_one_rank_without_it(tiny_models):
    """Under tensor parallelism (dense family, MTP) a second wave that extends the first wave's conversations hits
    the prefix cache (rank 0 sends the cached positions' slots; every rank's pages hold the prefix), and its greedy
    tokens equal one rank's with the cache off."""
    from specserve import Engine

    path = tiny_models["llama_mtp"]
    kw = dict(ENGINE, model_path=path, speculative_algorithm="MTP", speculative_num_steps=3, page_size=4)

    def waves(e) -> tuple[list, list]:
        first = e.generate(input_ids=ENGINE_PROMPTS, sampling_params=GREEDY)
        second = [p + o["output_ids"] + [11, 12, 13] for p, o in zip(ENGINE_PROMPTS, first)]
        return first, e.generate(input_ids=second, sampling_params=GREEDY)

    with Engine(disable_radix_cache=True, **kw) as e:
        ref = waves(e)
    with Engine(tp_size=2, **kw) as e:
        got = waves(e)
        e.core.scheduler.check_idle_invariants()
    assert [o["output_ids"] for o in got[0] + got[1]] == [o["output_ids"] for o in ref[0] + ref[1]]
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in ref[1])
    assert all(o["meta_info"]["cached_tokens"] >= 4 for o in got[1])
