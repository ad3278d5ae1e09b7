"""FP8 weights through the engine (CPU: the dequantising reference of every FP8 kernel): an FP8 block-scaled
checkpoint with its MTP layer loads with both in FP8 and speculates, greedy MTP equal to greedy plain on the same
FP8 target; online FP8 (--quantization fp8, SGLang's online_quant_config) quantises what it should, its exclusion
globs keep what they name, and its next-token choices agree with the unquantised model's above a stated rate on
every family."""

from __future__ import annotations

import json

import pytest
import torch
from deepseek_helpers import build_tiny_deepseek
from helpers import build_tiny_model
from hybrid_helpers import build_tiny_hybrid
from test_fp8_checkpoint import _fp8_copies, fp8_modules

from specserve.engine.engine import Engine
from specserve.layers.linear import Linear
from specserve.layers.moe import FusedMoE

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 17, 33, 2 + 7, 91, 14], [40, 41, 42, 43, 44, 45, 46, 47, 48], [120, 3, 77]]


def _build(family: str, folder: str) -> str:
    if family == "deepseek_v3":
        return build_tiny_deepseek(folder, seed=4, mtp=True)
    if family == "qwen3_next":
        return build_tiny_hybrid(folder, "qwen3_next", seed=4, mtp=True, logit_scale=3.0)
    return build_tiny_model(folder, family, seed=4, mtp_layout="deepseek", logit_scale=3.0)


def _engine(path: str, **kw) -> Engine:
    return Engine(model_path=path, dtype="float32", max_total_tokens=1024, context_length=128, **kw)


@pytest.mark.parametrize("family,block", [("llama", (16, 16)), ("deepseek_v3", (16, 16)), ("qwen3_next", (16, 16)),
                                          ("llama", None), ("qwen3_moe", None)])  # None: compressed-tensors
def test_fp8_checkpoint_with_mtp_speculates_losslessly(tmp_path, family, block):  # per-channel
    fp8_dir, _ = _fp8_copies(_build(family, str(tmp_path / "m")), str(tmp_path), block)
    with _engine(fp8_dir) as plain:
        want = [o["output_ids"] for o in plain.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    with _engine(fp8_dir, speculative_algorithm="MTP", speculative_num_steps=2) as spec:
        target, draft = spec.core.model_runner.target, spec.core.model_runner.draft
        assert fp8_modules(target)[0] > 0 and fp8_modules(draft)[0] > 0  # the MTP layer kept too, in FP8
        if family != "llama":  # the routed experts kept in FP8 too (per-channel ones included)
            assert fp8_modules(target)[1] > 0
        got = spec.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert spec.scheduler.stats.spec_verify_ct > 0
    assert [o["output_ids"] for o in got] == want


def _top2(engine: Engine, prompt: list[int]) -> list[tuple[int, float]]:
    """(most likely next token, its log-probability margin over the second) at each prompt position."""
    out = engine.generate(input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=1), return_logprob=True,
                          top_logprobs_num=2, logprob_start_len=0)
    return [(pos[0][1], pos[0][0] - pos[1][0]) for pos in out["meta_info"]["input_top_logprobs"] if pos]


# Online FP8 (per-row weight scales, per-token activations; experts in 128 x 128 blocks where they fit) against the
# float32 model: the share of prompt positions whose most likely next token is unchanged, over all positions and
# over those where the float model's top token leads the next by more than CONFIDENT nats. Measured on these tiny
# random models (hidden 64, 3 prompts of 40 tokens): 0.66-0.84 over all positions, 0.90-1.0 over confident ones
# (Qwen3-Next 0.76 / 0.90 with its gated delta net's gate rows kept in float, layers/quant.py ALWAYS_EXCLUDED;
# 0.52 / 0.66 when they were quantised too). The bounds leave a margin under the least.
TOP1_ALL, TOP1_CONFIDENT, CONFIDENT = 0.6, 0.85, 1.0


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "qwen3_next", "deepseek_v3"])
def test_online_fp8_top1_agrees_with_the_float_model(tmp_path, family):
    if family in ("qwen3", "qwen3_moe"):
        path = build_tiny_model(str(tmp_path / "m"), family, seed=6, logit_scale=3.0)
    else:
        path = _build(family, str(tmp_path / "m"))
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (40,), generator=rng).tolist() for _ in range(3)]
    with _engine(path) as ref:
        want = [p for prompt in prompts for p in _top2(ref, prompt)]
    with _engine(path, quantization="fp8") as q:
        assert fp8_modules(q.core.model_runner.target)[0] > 0
        got = [p for prompt in prompts for p in _top2(q, prompt)]
    assert len(want) == len(got) == 3 * 39
    same = [w[0] == g[0] for w, g in zip(want, got)]
    confident = [s for s, w in zip(same, want) if w[1] > CONFIDENT]
    assert sum(same) / len(same) >= TOP1_ALL
    assert len(confident) >= 3 and sum(confident) / len(confident) >= TOP1_CONFIDENT


def test_online_fp8_exclusions_and_mtp_losslessness(tmp_path):
    path = build_tiny_model(str(tmp_path / "m"), "qwen3_moe", seed=7, logit_scale=3.0, mtp_layout="deepseek")
    config = json.dumps({"online_quant_config": {"global_quant_config": "ptpc_fp8",
                                                 "exclude_layer": ["lm_head", "*.mlp.gate", "*expert*",
                                                                   "model.layers.0.self_attn.k_proj"]}})
    with _engine(path, model_loader_extra_config=config, speculative_algorithm="MTP",
                 speculative_num_steps=2) as spec:
        target = spec.core.model_runner.target
        mods = dict(target.named_modules())
        assert not mods["model.layers.0.self_attn.qkv_proj"].is_fp8  # excluded through its k part's name
        assert mods["model.layers.1.self_attn.qkv_proj"].is_fp8 and mods["model.layers.0.self_attn.o_proj"].is_fp8
        assert not any(isinstance(m, FusedMoE) and m.is_fp8 for m in target.modules())  # "*expert*"
        assert not any(m.is_fp8 for n, m in mods.items() if isinstance(m, Linear) and n.endswith("mlp.gate"))
        assert fp8_modules(spec.core.model_runner.draft)[0] > 0
        got = [o["output_ids"] for o in spec.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        assert spec.scheduler.stats.spec_verify_ct > 0
    with _engine(path, model_loader_extra_config=config) as plain:
        assert [o["output_ids"] for o in plain.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == got
    with _engine(path, quantization="fp8") as q:  # no exclusions: the experts too, in 128 x 128 blocks if they fit
        experts = [m for m in q.core.model_runner.target.modules() if isinstance(m, FusedMoE)]
        assert all(m.is_fp8 == (m.intermediate_size % 128 == 0) for m in experts)
