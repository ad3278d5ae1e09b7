"""Small random DeepSeek-V3 checkpoints (MLA with q-LoRA, grouped sigmoid MoE with a shared expert, one dense layer
first) built with transformers, with an optional random MTP layer at model.layers.{L} in the DeepSeek layout."""

from __future__ import annotations

import json
import os

import torch
from helpers import _index_all_shards, _spread_weights, _tiny_tokenizer_files
from safetensors.torch import save_file

# 3 layers (the first dense); 4 heads; q-LoRA 32, kv-LoRA 32, qk 16 + 8 rope, v 16; 8 experts in 4 groups, top 2
# of the best 2 groups, 1 shared expert, routed scaling 2.5
TINY_DEEPSEEK = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                     num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1,
                     norm_topk_prob=True, first_k_dense_replace=1, max_position_embeddings=512, vocab_size=256,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True)


def build_tiny_deepseek(folder: str, seed: int = 0, mtp: bool = False, **overrides) -> str:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = DeepseekV3Config(**{**TINY_DEEPSEEK, **overrides})
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg.eos_token_id, cfg.bos_token_id = 2, 1
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _spread_weights(model, seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):  # a bias that changes the choice now and then
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder, safe_serialization=True)
    _tiny_tokenizer_files(folder, cfg.vocab_size)
    if mtp:
        save_file(random_mla_mtp_tensors(cfg, f"model.layers.{cfg.num_hidden_layers}.", seed + 1),
                  os.path.join(folder, "mtp.safetensors"))
        with open(os.path.join(folder, "config.json")) as f:
            c = json.load(f)
        c["num_nextn_predict_layers"] = 1
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(c, f, indent=2)
        _index_all_shards(folder)
    return folder


def random_mla_mtp_tensors(cfg, prefix: str, seed: int) -> dict[str, torch.Tensor]:
    """A random DeepSeek-V3 MTP layer under `prefix`: enorm, hnorm, eh_proj, shared_head.norm and the block (MLA +
    MoE with the correction bias and the shared expert)."""
    g = torch.Generator().manual_seed(seed)
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    r = lambda *s: torch.randn(*s, generator=g) * (1.0 / s[-1] ** 0.5)
    n = lambda k: 1.0 + 0.1 * torch.randn(k, generator=g)
    mi, e = cfg.moe_intermediate_size, cfg.n_routed_experts
    t = {"enorm.weight": n(h), "hnorm.weight": n(h), "eh_proj.weight": r(h, 2 * h), "shared_head.norm.weight": n(h),
         "input_layernorm.weight": n(h), "post_attention_layernorm.weight": n(h),
         "self_attn.q_a_proj.weight": r(cfg.q_lora_rank, h), "self_attn.q_a_layernorm.weight": n(cfg.q_lora_rank),
         "self_attn.q_b_proj.weight": r(nh * qk, cfg.q_lora_rank),
         "self_attn.kv_a_proj_with_mqa.weight": r(cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
         "self_attn.kv_a_layernorm.weight": n(cfg.kv_lora_rank),
         "self_attn.kv_b_proj.weight": r(nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
         "self_attn.o_proj.weight": r(h, nh * cfg.v_head_dim),
         "mlp.gate.weight": r(e, h), "mlp.gate.e_score_correction_bias": 0.05 * torch.randn(e, generator=g),
         "mlp.shared_experts.gate_proj.weight": r(mi, h), "mlp.shared_experts.up_proj.weight": r(mi, h),
         "mlp.shared_experts.down_proj.weight": r(h, mi)}
    for i in range(e):
        t.update({f"mlp.experts.{i}.gate_proj.weight": r(mi, h), f"mlp.experts.{i}.up_proj.weight": r(mi, h),
                  f"mlp.experts.{i}.down_proj.weight": r(h, mi)})
    return {prefix + k: v.contiguous() for k, v in t.items()}


# DSA: an indexer of 2 heads of 16 (rope on the first 8) per layer
TINY_DSA = dict(index_n_heads=2, index_head_dim=16)


def build_tiny_dsa(folder: str, arch: str, seed: int = 0, index_topk: int = 1024, **overrides) -> str:
    """A random DeepSeek-V3.2 ("deepseek_v32") or GLM-5 ("glm_moe_dsa") checkpoint; GLM's layer 2 reuses layer 1's
    selection (indexer_types full, full, shared)."""
    from transformers import AutoModelForCausalLM, DeepseekV32Config, GlmMoeDsaConfig

    kw = {k: v for k, v in TINY_DEEPSEEK.items() if k != "rope_interleave"}
    kw.update(TINY_DSA, index_topk=index_topk, mlp_layer_types=["dense", "sparse", "sparse"])
    if arch == "glm_moe_dsa":
        kw["indexer_types"] = ["full", "full", "shared"]
    kw.update(overrides)
    cfg = (GlmMoeDsaConfig if arch == "glm_moe_dsa" else DeepseekV32Config)(**kw)
    cfg.architectures = ["GlmMoeDsaForCausalLM" if arch == "glm_moe_dsa" else "DeepseekV32ForCausalLM"]
    cfg.eos_token_id, cfg.bos_token_id = 2, 1
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _spread_weights(model, seed)
    model.save_pretrained(folder, safe_serialization=True)
    _tiny_tokenizer_files(folder, cfg.vocab_size)
    return folder


def hf_logits_and_index_scores(hf, ids: list[int]):
    """transformers' logits for `ids` [T, V] and, for every layer that runs its own indexer, (scores [T, T], chosen
    [T, min(index_topk, T)]): the index scores recomputed from the inputs the indexer was called with (the formula
    of its forward, masked keys -inf), beside the top-k indices it returned. Shared GLM layers have no indexer."""
    import torch.nn.functional as F
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer, apply_rotary_pos_emb
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer, apply_rotary_pos_emb_interleave

    rope = {DeepseekV32Indexer: apply_rotary_pos_emb, GlmMoeDsaIndexer: apply_rotary_pos_emb_interleave}
    seen = []

    def hook(mod, args, out):
        h, q_resid, (cos, sin), mask = args[:4]  # [1, T, H], [1, T, Q], rope tables, [1, T, T] (bool or additive)
        t, r = h.shape[1], mod.qk_rope_head_dim
        q = mod.wq_b(q_resid).view(1, t, mod.n_heads, mod.head_dim)  # [1, T, Hi, Di]
        k = mod.k_norm(mod.wk(h)).unsqueeze(2)  # [1, T, 1, Di]
        q_rot, k_rot = rope[type(mod)](q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., r:]], -1)[0]  # [T, Hi, Di]
        k = torch.cat([k_rot, k[..., r:]], -1)[0, :, 0]  # [T, Di]
        s = F.relu(torch.einsum("thd,kd->thk", q.float(), k.float()) * mod.softmax_scale)  # [T, Hi, T]
        w = mod.weights_proj(h[0].to(mod.weights_proj.weight.dtype)).float() * mod.n_heads ** -0.5  # [T, Hi]
        scores = torch.einsum("th,thk->tk", w, s)
        causal = mask[0] if mask.dtype == torch.bool else mask[0] == 0  # [T, T]
        seen.append((scores.masked_fill(~causal, float("-inf")), out[0].long()))

    hooks = [m.register_forward_hook(hook) for m in hf.modules() if type(m) in rope]
    try:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0]  # [T, V]
    finally:
        for h in hooks:
            h.remove()
    return logits, seen


def check_selection_is_tie_free(seen, k: int, rel: float = 1e-4) -> int:
    """Precondition of a logits comparison with a truly sparse top-k: in every indexer row with more than k causal
    keys, the k-th and (k+1)-th best scores are apart by more than `rel` of the row's largest |score| (no tie, exact
    or within rounding, straddles the boundary, so any correct top-k picks the same set), and the recomputed scores'
    top-k is the set transformers chose. -> the number of rows whose selection excludes some causal key."""
    sparse = 0
    for scores, chosen in seen:  # [T, T], [T, k']
        for i in range(scores.shape[0]):
            n = i + 1  # causal keys of row i
            top = torch.sort(scores[i, :n], descending=True)
            if n <= k:
                assert set(chosen[i].tolist()) >= set(range(n))
                continue
            gap = float(top.values[k - 1] - top.values[k])
            assert gap > rel * float(top.values.abs().max()), f"row {i}: a tie at the top-{k} boundary ({gap})"
            assert set(chosen[i].tolist()) == set(top.indices[:k].tolist()), f"row {i}: not transformers' choice"
            sparse += 1
    return sparse
