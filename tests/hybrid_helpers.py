"""Small random checkpoints of the hybrid linear-attention family (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, the Qwen3.5 and
Qwen3.5-MoE vision-language layouts), built with transformers, with an optional random `mtp.*` layer in the
Qwen3-Next layout; and that MTP layer's reference logits, assembled from transformers' own modules."""

from __future__ import annotations

import json
import os

import torch
from helpers import _index_all_shards, _spread_weights, _tiny_tokenizer_files
from safetensors.torch import load_file, save_file

# 4 layers, 3:1 linear/full; GDN 2 key heads / 4 value heads of 16; attention 4 q / 2 kv heads of 32, rotary on 8
TINY_HYBRID = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   max_position_embeddings=512, vocab_size=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16, linear_conv_kernel_dim=4,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
TINY_HYBRID_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32)

ARCHS = {
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe_vl": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_5_vl": "Qwen3_5ForConditionalGeneration",  # last: the kinds above keep their fixture seeds
}


def _config(kind: str, **overrides):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig

    kw = dict(TINY_HYBRID)
    if kind == "qwen3_next":
        kw.update(TINY_HYBRID_MOE, intermediate_size=128, mlp_only_layers=[1], norm_topk_prob=True)
    elif kind in ("qwen3_5", "qwen3_5_vl"):
        kw.update(intermediate_size=128)
    else:
        kw.update(TINY_HYBRID_MOE)
    kw.update(overrides)
    if kind == "qwen3_next":
        cfg = Qwen3NextConfig(**kw)
    elif kind == "qwen3_5":
        cfg = Qwen3_5TextConfig(**kw)
    elif kind == "qwen3_5_moe":
        cfg = Qwen3_5MoeTextConfig(**kw)
    else:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
        vl = Qwen3_5Config if kind == "qwen3_5_vl" else Qwen3_5MoeConfig
        cfg = vl(text_config=kw, vision_config=vision)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is not None:
            c.eos_token_id, c.bos_token_id = 2, 1
    cfg.architectures = [ARCHS[kind]]
    return cfg


def build_tiny_hybrid(folder: str, kind: str, seed: int = 0, mtp: bool = False, logit_scale: float = 1.0,
                      **overrides) -> str:
    """Save a random checkpoint of `kind` (ARCHS) to folder; mtp: add a random `mtp.*` layer (Qwen3-Next layout)
    and mtp_num_hidden_layers = 1; logit_scale multiplies the lm-head (> 1: lower-entropy distributions)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = _config(kind, **overrides)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if kind.endswith("_vl") else AutoModelForCausalLM
    model = auto.from_config(cfg, dtype=torch.float32)
    _spread_weights(model, seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("conv1d.weight"):  # [C, 1, K]: taps of order 1 keep the conv's output alive
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):  # decays exp(-A softplus(.)) spread between fast and slow
                p.copy_(torch.empty(p.shape).uniform_(-3.0, 1.0, generator=g))
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(folder, safe_serialization=True)
    text = getattr(cfg, "text_config", cfg)
    _tiny_tokenizer_files(folder, text.vocab_size)
    if mtp:
        save_file(random_hybrid_mtp_tensors(text, seed + 1), os.path.join(folder, "mtp.safetensors"))
        edit_config(folder, mtp_num_hidden_layers=1)
        _index_all_shards(folder)
    return folder


def random_hybrid_mtp_tensors(cfg, seed: int) -> dict[str, torch.Tensor]:
    """A random Qwen3-Next style MTP layer: mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm} and
    mtp.layers.0.* = one gated full-attention layer with the target's MLP kind (zero-centred norms)."""
    g = torch.Generator().manual_seed(seed)
    h, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    r = lambda *s: torch.randn(*s, generator=g) * (1.0 / s[-1] ** 0.5)
    zc = lambda n: 0.1 * torch.randn(n, generator=g)  # zero-centred norm weights
    t = {"mtp.fc.weight": r(h, 2 * h), "mtp.pre_fc_norm_embedding.weight": zc(h),
         "mtp.pre_fc_norm_hidden.weight": zc(h), "mtp.norm.weight": zc(h)}
    layer = {"input_layernorm.weight": zc(h), "post_attention_layernorm.weight": zc(h),
             "self_attn.q_proj.weight": r(2 * nh * d, h), "self_attn.k_proj.weight": r(nkv * d, h),
             "self_attn.v_proj.weight": r(nkv * d, h), "self_attn.o_proj.weight": r(h, nh * d),
             "self_attn.q_norm.weight": zc(d), "self_attn.k_norm.weight": zc(d)}
    if getattr(cfg, "num_experts", None):
        mi, si = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        layer["mlp.gate.weight"] = r(cfg.num_experts, h)
        for e in range(cfg.num_experts):
            layer.update({f"mlp.experts.{e}.gate_proj.weight": r(mi, h), f"mlp.experts.{e}.up_proj.weight": r(mi, h),
                          f"mlp.experts.{e}.down_proj.weight": r(h, mi)})
        layer.update({"mlp.shared_expert.gate_proj.weight": r(si, h), "mlp.shared_expert.up_proj.weight": r(si, h),
                      "mlp.shared_expert.down_proj.weight": r(h, si), "mlp.shared_expert_gate.weight": r(1, h)})
    else:
        i = cfg.intermediate_size
        layer.update({"mlp.gate_proj.weight": r(i, h), "mlp.up_proj.weight": r(i, h), "mlp.down_proj.weight": r(h, i)})
    t.update({f"mtp.layers.0.{k}": v for k, v in layer.items()})
    return {k: v.contiguous() for k, v in t.items()}


def edit_config(folder: str, drop: tuple[str, ...] = (), **values) -> None:
    """Rewrite the checkpoint's config.json (its text_config where it has one): remove the `drop` keys, set
    `values`."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        c = json.load(f)
    text = c.get("text_config") or c
    for k in drop:
        text.pop(k, None)
    text.update(values)
    with open(path, "w") as f:
        json.dump(c, f, indent=2)


def hf_mtp_logits(hf, path: str, ids: torch.Tensor, hidden: torch.Tensor,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
    """The checkpoint's MTP layer assembled from transformers' modules: token ids [T] (at p + 1) and the target's
    final hidden states [T, H] (at p = 0..T-1) -> draft logits [T, V]. positions: the rotary's mRoPE rows [3, T]
    (Qwen3.5), else the token indices.
        e = norm_e(embed(ids))   h = norm_h(hidden)   x = fc([e ; h])
        x = decoder layer (transformers' own, a full-attention layer index, causal over the T positions)
        logits = lm_head(norm(x))   (embedding and LM head: the target's; every norm zero-centred, (1 + w))"""
    text = hf.config.get_text_config()
    mtp = load_file(os.path.join(path, "mtp.safetensors"))
    model = hf.model
    layer = type(model.layers[0])(text, text.layer_types.index("full_attention")).eval()
    assert hasattr(layer.mlp, "experts") == bool(getattr(text, "num_experts", 0))  # the target's MLP kind
    sd = {k.removeprefix("mtp.layers.0."): v for k, v in mtp.items() if k.startswith("mtp.layers.0.")}
    if hasattr(layer.mlp, "experts"):  # transformers keeps experts fused: gate_up [E, 2I, H], down [E, H, I]
        ex = [[sd.pop(f"mlp.experts.{e}.{w}_proj.weight") for w in ("gate", "up", "down")]
              for e in range(text.num_experts)]
        sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in ex])
        sd["mlp.experts.down_proj"] = torch.stack([d for _, _, d in ex])
    layer.load_state_dict(sd)  # strict: every weight of the layer, nothing left over

    def norm(name):
        n = type(model.norm)(text.hidden_size, eps=text.rms_norm_eps)
        n.weight.data.copy_(mtp[f"mtp.{name}.weight"])
        return n

    t = ids.shape[0]
    with torch.no_grad():
        e = norm("pre_fc_norm_embedding")(model.embed_tokens(ids[None]))  # [1, T, H]
        h = norm("pre_fc_norm_hidden")(hidden[None])
        x = torch.nn.functional.linear(torch.cat([e, h], dim=-1), mtp["mtp.fc.weight"])  # [1, T, H]
        pos = torch.arange(t)[None]
        rope_pos = pos if positions is None else positions[:, None, :]  # [1, T] or [3, 1, T]
        if rope_pos.dim() == 2 and type(model.rotary_emb).__name__.startswith("Qwen3_5"):
            rope_pos = rope_pos[None].expand(3, 1, t)  # older transformers' Qwen3.5 rotary wants the 3 rows given
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]  # [1, 1, T, T] causal
        x = layer(x, position_embeddings=model.rotary_emb(x, rope_pos), attention_mask=mask, position_ids=pos)
        return hf.lm_head(norm("norm")(x))[0]  # [T, V]
