"""Bandwidth floors (bench/floors.py): the expected distinct experts against a simulation, weight bytes against the
parameters counted another way and against the presets' published sizes, token-cache bytes against the pools a
model runner allocates, the recurrent state's slots, and the `bench-floors` command."""

import json
import math

import pytest
import torch

from specserve.batch import CacheKind
from specserve.bench.floors import (
    expected_distinct_experts,
    main,
    phase_floors,
    state_slot_bytes,
    token_cache_bytes,
    weight_bytes,
)
from specserve.bench.phase_setup import PRESETS, make_runners, meta_models, random_draft
from specserve.models.loader import ModelSource, load_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("tokens", [1, 2, 3, 8])
def test_expected_distinct_experts_matches_simulation(tokens):
    e, k, trials = 16, 4, 20000
    g = torch.Generator().manual_seed(tokens)
    picks = torch.rand(trials, tokens, e, generator=g).argsort(dim=-1)[..., :k]  # [trials, tokens, k]: k-subsets
    chosen = torch.zeros(trials, e, dtype=torch.bool)
    chosen.scatter_(1, picks.reshape(trials, -1), True)
    simulated = chosen.sum(dim=1).double().mean().item()
    assert expected_distinct_experts(e, k, tokens) == pytest.approx(simulated, rel=0.01)
    assert expected_distinct_experts(e, k, 1) == k and expected_distinct_experts(e, k, 0) == 0.0
    assert expected_distinct_experts(e, k, 10 ** 6) == pytest.approx(e)


def _param_bytes(model) -> tuple[int, int, int]:
    """(all unique parameter bytes, routed expert bytes, embedding bytes) by parameter name."""
    total = experts = 0
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel() * p.element_size()
        total += n
        experts += n if ".experts.w" in name else 0
    return total, experts, model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()


def test_weight_bytes_count_the_chosen_experts_and_skip_an_untied_embedding(tiny_models):
    cpu = torch.device("cpu")
    moe = load_target(ModelSource.resolve(tiny_models["qwen3_moe"]), torch.float32, cpu, 64)
    total, experts, embed = _param_bytes(moe.model)
    assert experts > 0 and moe.model.lm_head.weight is not moe.model.embed_tokens.weight
    cfg = moe.config
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    for tokens in (1, 4, 10 ** 6):
        share = expected_distinct_experts(e, k, tokens) / e
        assert weight_bytes(moe.model, tokens) == pytest.approx(total - embed - experts * (1 - share))
    dense = load_target(ModelSource.resolve(tiny_models["llama"]), torch.float32, cpu, 64)
    total, experts, embed = _param_bytes(dense.model)
    tied = dense.model.lm_head.weight is dense.model.embed_tokens.weight
    assert experts == 0
    assert weight_bytes(dense.model, 1) == weight_bytes(dense.model, 64) == total - (0 if tied else embed)


def test_token_cache_bytes_match_the_allocated_pools(tiny_models):
    cpu = torch.device("cpu")
    t = load_target(ModelSource.resolve(tiny_models["qwen3"]), torch.float32, cpu, 200)
    draft = random_draft(t.config, t.model, torch.float32, cpu, 200)
    pair = make_runners(t.model, draft, t.config, torch.float32, cpu, 2, 2, 128, disable_graphs=True)
    pool = pair.plain.caches.pools[next(iter(pair.plain.caches.pools))]
    per_token = sum(x[0].numel() * x.element_size() for x in (*pool.k, *pool.v))
    assert token_cache_bytes(t.model.cache_specs(), 100, torch.float32) == 100 * per_token
    floors = phase_floors(t.model, draft, 3, 100, 2, torch.float32)
    # a dense target reads the same weights and cache for one token or N + 1; so does its draft
    assert floors.decode == floors.target_verify and floors.draft_extend == floors.draft_step
    assert floors.spec_iter == floors.target_verify + floors.draft_extend + floors.draft_step
    d_cache = 3 * token_cache_bytes(draft.cache_specs(), 100, torch.float32)
    # the draft reads its own weights, its cache and the target's LM head it shares (not the embedding rows)
    own = sum(p.numel() * p.element_size() for p in draft.parameters())
    assert floors.draft_step == own + draft.head.weight.numel() * 4 + d_cache


def test_presets_on_meta_match_their_published_sizes():
    """Llama-3.1-8B: 8.03 B parameters, 0.53 B of them the (untied) embedding; Qwen3-30B-A3B: 30.5 B, 3.3 B
    active; every preset's floors computed without memory."""
    target, draft = meta_models("llama-3.1-8b", 600)
    assert weight_bytes(target, 1) == pytest.approx(2 * (8.03e9 - 128256 * 4096), rel=0.01)
    target, draft = meta_models("qwen3-30b-a3b", 600)
    assert weight_bytes(target, 10 ** 6) - 2 * 151936 * 2048 == pytest.approx(2 * 30.5e9, rel=0.02)
    assert weight_bytes(target, 1) == pytest.approx(2 * (3.3e9 - 151936 * 2048), rel=0.03)
    for name in PRESETS:
        target, draft = meta_models(name, 600)
        f = phase_floors(target, draft, 2, 512, 3, torch.bfloat16)
        assert f.target_verify >= f.decode > 0 and f.draft_extend >= f.draft_step > 0, name


def test_recurrent_state_slots_in_the_hybrid_floors():
    """Qwen3-Next's 18 GDN layers in the preset: a conv window of 3 x 8192 bf16 and a 32 x 128 x 128 float32 state
    a slot; a decode step reads and writes one slot a row, a verify reads one and writes N + 1."""
    target, draft = meta_models("qwen3-next-80b-a3b", 600)
    slot = state_slot_bytes(target.cache_specs())
    assert slot == 18 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)
    bs, n = 4, 3
    f = phase_floors(target, draft, bs, 512, n, torch.bfloat16)
    weights = weight_bytes(target, bs * (n + 1)) - weight_bytes(target, bs)
    assert f.target_verify - f.decode == pytest.approx(weights + bs * ((1 + n + 1) - 2) * slot)


def test_dsa_attention_reads_only_its_top_k_latent_rows():
    target, _ = meta_models("glm-5", 600)
    specs = target.cache_specs()
    short = token_cache_bytes(specs, 1000, torch.bfloat16, index_topk=2048)
    long = token_cache_bytes(specs, 32000, torch.bfloat16, index_topk=2048)
    dense = token_cache_bytes(specs, 32000, torch.bfloat16)
    latent = sum(s.bytes_per_token(torch.bfloat16) for s in specs if s.kind is CacheKind.MLA)
    keys = sum(s.bytes_per_token(torch.bfloat16) for s in specs if s.kind is CacheKind.INDEX_KEYS)
    assert latent > 0 and keys > 0
    assert short == 1000 * (latent + keys)  # a context below top-k: every row
    assert long == 2048 * latent + 32000 * keys and dense == 32000 * (latent + keys)


def test_bench_floors_command(tmp_path, capsys):
    out = tmp_path / "floors.jsonl"
    assert main(["--preset", "qwen3-30b-a3b", "--batch-sizes", "1,8", "--contexts", "512,4096",
                 "--output-file", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bandwidth floors: qwen3-30b-a3b" in text and "spec/plain" in text
    rec = json.loads(out.read_text())
    assert [(r["bs"], r["context"]) for r in rec["floors"]] == [(1, 512), (8, 512), (1, 4096), (8, 4096)]
    r = rec["floors"][0]
    assert math.isclose(r["ms"]["decode"], r["decode"] / 4200e9 * 1e3)
    assert r["spec_over_plain"] > 2  # 4 verify tokens read ~3.7x the experts of one at E 128, top 8


def test_bench_phases_prints_each_phase_against_its_floor(capsys):
    from specserve.bench.phases import print_floor_line

    target, draft = meta_models("qwen3-30b-a3b", 600)
    f = phase_floors(target, draft, 1, 513, 3, torch.bfloat16).as_dict(4000.0)
    ms = f["ms"]
    b = {"bs": 1, "floors": f, "spec_iter_ms": 2 * ms["spec_iter"], "plain_step_ms": ms["spec_iter"] / 1.5,
         **{k: {"graph_ms": 4 * ms[m]} for k, m in (("decode", "decode"), ("target_verify", "target_verify"),
                                                    ("draft_decode", "draft_step"), ("draft_extend", "draft_extend"))}}
    print_floor_line(b)
    text = capsys.readouterr().out
    assert "decode" in text and "(25%)" in text and "spec iter" in text and "(50%)" in text
    assert ">= 1.50x" in text and f"{f['spec_over_plain']:.2f}x" in text
