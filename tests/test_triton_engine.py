"""The whole engine on the Triton attention backend (under Triton's interpreter on CPU) against the torch backend:
greedy outputs token for token, plain decoding and MTP speculation, with chunked prefill. This runs every kernel
of the backend through the real phase runners: EXTEND (varlen), DECODE, TARGET_VERIFY, DRAFT_DECODE and
DRAFT_EXTEND (graph metadata path through the runners' static replay, padded batch sizes included)."""

import pytest
import torch
from spec_fixtures import build_scheduler
from test_spec_greedy import _run

from specserve.attention.triton_backend import TritonAttentionBackend
from specserve.batch import CacheKind

pytest.importorskip("triton")
# spec_fixtures builds CPU engines: the Triton backend can run them only under the interpreter (CPU sessions).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU engine fixtures; GPU runs compile the kernels")

PROMPT_LENS = (7, 21, 3)  # three requests: padded to a captured batch size of 4
NEW = 8


def _generate(path: str, backend: str, **kw) -> list[list[int]]:
    sched, _ = build_scheduler(path, page_size=4, max_total_tokens=1024, attention_backend=backend,
                               chunked_prefill_size=16, **kw)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in PROMPT_LENS]
    reqs = _run(sched, prompts, new=NEW)  # greedy, ignore_eos; checks the pool is back to its start
    spec = sched.model_runner.spec
    runners = spec.phases.all() if spec is not None else sched.model_runner.phases.all()
    # the graph-metadata path ran (static replay on CPU): greedy spec steps run every phase inside the one-graph
    # step, plain decode steps inside the one-graph plain step
    if spec is None:
        replayed = [sched.model_runner.decode_step_graph]
    else:
        replayed = [spec.spec_step_graph] if spec.spec_step_graph is not None else list(runners)
    assert all(r.replays > 0 for r in replayed)
    if backend == "triton":
        assert all(isinstance(r.backends[CacheKind.MHA], TritonAttentionBackend) for r in runners)
        prefill = [sched.model_runner.prefill] + ([spec.prefill] if spec is not None else [])
        assert all(isinstance(r.eager_backends[CacheKind.MHA], TritonAttentionBackend) for r in prefill)
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("spec", [{}, {"speculative_algorithm": "MTP", "speculative_num_steps": 2}],
                         ids=["plain", "mtp2"])
def test_engine_greedy_triton_equals_torch(tiny_models, spec):
    path = tiny_models["llama_mtp"] if spec else tiny_models["llama"]
    want = _generate(path, "torch", **spec)
    got = _generate(path, "triton", **spec)
    assert got == want
    assert all(len(o) == NEW for o in got)
