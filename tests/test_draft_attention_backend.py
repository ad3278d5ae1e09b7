"""--speculative-draft-attention-backend: the draft model's attention backend chosen apart from the target's (auto:
the target's). A target on the Triton backend (Triton's interpreter on CPU) with a draft on the torch reference
speculates losslessly: greedy outputs equal plain decoding's."""

import pytest
import torch
from spec_fixtures import build_scheduler, run_greedy

from specserve.attention.torch_backend import TorchAttentionBackend
from specserve.attention.triton_backend import TritonAttentionBackend
from specserve.batch import CacheKind

pytest.importorskip("triton")
# spec_fixtures builds CPU engines: the Triton backend can run them only under the interpreter (CPU sessions).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU engine fixtures; GPU runs compile the kernels")

PROMPT_LENS = (7, 21, 3)
NEW = 6


def _mha_backends(sched):
    """(the target prefill's MHA backend, the draft's), as built by the model runner's factories."""
    return (type(sched.model_runner.prefill.eager_backends[CacheKind.MHA]),
            type(sched.model_runner.spec.ctx.make_backends()[CacheKind.MHA]))


def test_draft_backend_apart_from_the_target(tiny_models):
    path = tiny_models["llama_mtp"]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in PROMPT_LENS]
    plain, _ = build_scheduler(path, page_size=4, max_total_tokens=1024)
    want = [r.output_ids for r in run_greedy(plain, prompts, NEW)]
    spec, _ = build_scheduler(path, page_size=4, max_total_tokens=1024, attention_backend="triton",
                              speculative_draft_attention_backend="torch", speculative_algorithm="MTP",
                              speculative_num_steps=2)
    assert _mha_backends(spec) == (TritonAttentionBackend, TorchAttentionBackend)
    assert [r.output_ids for r in run_greedy(spec, prompts, NEW)] == want
    # auto: the target's backend
    same, _ = build_scheduler(path, page_size=4, max_total_tokens=1024, attention_backend="triton",
                              speculative_algorithm="MTP", speculative_num_steps=2)
    assert _mha_backends(same) == (TritonAttentionBackend, TritonAttentionBackend)
