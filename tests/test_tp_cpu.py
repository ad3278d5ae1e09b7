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
from tp_helpers import rank_main, single

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
    mp.spawn(rank_main, args=(size, _free_port(), path, PROMPTS, STEPS, out), nprocs=size, join=True)
    return torch.load(out)


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    from helpers import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tied") / "m"), "llama", seed=9, tie_word_embeddings=True)


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


def test_tp_tied_embeddings(tied_llama, tmp_path):
    want = single(tied_llama, PROMPTS, STEPS)
    for g, w in zip(_tp_logits(tied_llama, 2, tmp_path), want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_tp_refuses_other_families_and_bad_sizes(tiny_models, tmp_path):
    from hybrid_helpers import build_tiny_hybrid

    from specserve.models.loader import ModelSource, load_target

    qwen3_next = build_tiny_hybrid(str(tmp_path / "next"), "qwen3_next", seed=5)
    with pytest.raises(ValueError, match="dense and Qwen3-MoE families"):
        load_target(ModelSource.resolve(qwen3_next), torch.float32, torch.device("cpu"), 64, tp=TPGroup(0, 2))
    with pytest.raises(ValueError, match="not divisible"):
        load_target(ModelSource.resolve(tiny_models["llama"]), torch.float32, torch.device("cpu"), 64,
                    tp=TPGroup(0, 3))
