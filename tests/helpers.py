"""Small random checkpoints built with transformers, and helpers shared by the tests."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, vocab_size=256, rms_norm_eps=1e-6, tie_word_embeddings=False)


# Qwen3-MoE: 8 experts, top 2, a dense MLP on layer 1 of 3 (mlp_only_layers), experts of a quarter of the dense width
TINY_MOE = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])


def _tiny_tokenizer_files(folder: str, vocab_size: int) -> None:
    """A byte-level-ish word tokenizer over a fixed vocabulary, saved through tokenizers (no hub access)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    pieces = letters + list("0123456789 .,!?'\":;-()") + ["Ġ" + c for c in letters]
    for p in pieces:
        if len(vocab) >= vocab_size:
            break
        vocab.setdefault(p, len(vocab))
    while len(vocab) < vocab_size:
        vocab[f"<extra_{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(folder)


def build_tiny_model(folder: str, arch: str = "llama", seed: int = 0, mtp_layout: str | None = None,
                     logit_scale: float = 1.0, **overrides) -> str:
    """Save a random HF checkpoint of `arch` (llama | qwen2 | qwen3 | qwen3_moe) to folder and return it.

    mtp_layout: None, or "deepseek" to append a random MTP layer at model.layers.{L}.* (num_nextn_predict_layers=1).
    logit_scale: multiplies the lm-head weights (> 1: lower-entropy next-token distributions).
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[arch]
    kw = dict(TINY)
    if arch == "qwen3_moe":
        kw.update(TINY_MOE)
    kw.update(overrides)
    if arch in ("qwen3", "qwen3_moe"):
        kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    cfg = cls(**kw)
    cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                          "qwen3_moe": "Qwen3MoeForCausalLM"}[arch]]
    cfg.eos_token_id = 2
    cfg.bos_token_id = 1
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _spread_weights(model, seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(folder, safe_serialization=True)
    _tiny_tokenizer_files(folder, cfg.vocab_size)
    if mtp_layout == "deepseek":
        tensors = random_mtp_tensors(cfg, prefix=f"model.layers.{cfg.num_hidden_layers}.", seed=seed + 1)
        save_file(tensors, os.path.join(folder, "mtp.safetensors"))
        with open(os.path.join(folder, "config.json")) as f:
            c = json.load(f)
        c["num_nextn_predict_layers"] = 1
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(c, f, indent=2)
        _index_all_shards(folder)
    return folder


def _index_all_shards(folder: str) -> None:
    """If the checkpoint is a single file plus our mtp file, write an index so loaders see both."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    weight_map = {}
    for fn in files:
        with safe_open(os.path.join(folder, fn), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118
                weight_map[k] = fn
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _spread_weights(model, seed: int) -> None:
    """HF's init (std 0.02) gives near-uniform logits on a tiny model; larger weights make argmax decisive so
    greedy comparisons test something (ties would be decided by rounding)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[1] ** 0.5))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def random_mtp_tensors(cfg, prefix: str, seed: int, own_head: bool = False,
                       num_aux: int = 0) -> dict[str, torch.Tensor]:
    """Random MTP layer tensors in the DeepSeek-V3 naming under `prefix` (+ aux_fc for num_aux aux layers)."""
    g = torch.Generator().manual_seed(seed)
    h, i = cfg.hidden_size, cfg.intermediate_size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or h // nh
    r = lambda *s: torch.randn(*s, generator=g) * (1.0 / s[-1] ** 0.5)
    n = lambda: 1.0 + 0.1 * torch.randn(h, generator=g)
    t = {
        "enorm.weight": n(), "hnorm.weight": n(), "eh_proj.weight": r(h, 2 * h),
        "shared_head.norm.weight": n(),
        "input_layernorm.weight": n(), "post_attention_layernorm.weight": n(),
        "self_attn.q_proj.weight": r(nh * d, h), "self_attn.k_proj.weight": r(nkv * d, h),
        "self_attn.v_proj.weight": r(nkv * d, h), "self_attn.o_proj.weight": r(h, nh * d),
    }
    arch = cfg.architectures[0]
    if getattr(cfg, "num_experts", None):  # an MoE family: the MTP block's MLP is the target's MoE (per expert)
        mi = cfg.moe_intermediate_size
        t["mlp.gate.weight"] = r(cfg.num_experts, h)
        for e in range(cfg.num_experts):
            t.update({f"mlp.experts.{e}.gate_proj.weight": r(mi, h), f"mlp.experts.{e}.up_proj.weight": r(mi, h),
                      f"mlp.experts.{e}.down_proj.weight": r(h, mi)})
    else:
        t.update({"mlp.gate_proj.weight": r(i, h), "mlp.up_proj.weight": r(i, h), "mlp.down_proj.weight": r(h, i)})
    if arch.startswith("Qwen2"):
        for k, s in (("q", nh * d), ("k", nkv * d), ("v", nkv * d)):
            t[f"self_attn.{k}_proj.bias"] = 0.1 * torch.randn(s, generator=g)
    if arch.startswith("Qwen3"):
        t["self_attn.q_norm.weight"] = 1.0 + 0.1 * torch.randn(d, generator=g)
        t["self_attn.k_norm.weight"] = 1.0 + 0.1 * torch.randn(d, generator=g)
    if own_head:
        t["shared_head.head.weight"] = r(cfg.vocab_size, h)
    if num_aux:
        t["aux_fc.weight"] = r(h, (1 + num_aux) * h)
    return {prefix + k: v.contiguous() for k, v in t.items()}


def build_draft_folder(folder: str, target_folder: str | None, seed: int = 7, own_head: bool = False,
                       hf_config=None, aux_layers: list[int] | None = None) -> str:
    """A separate draft checkpoint (--speculative-draft-model-path): config.json with num_hidden_layers = 1 and the
    MTP layer at model.layers.0.*. The target's config comes from its folder, or is given (e.g. read from GGUF).
    aux_layers: an EAGLE-3 style head reading those target layers' outputs too."""
    from transformers import AutoConfig

    cfg = hf_config if hf_config is not None else AutoConfig.from_pretrained(target_folder)
    if not getattr(cfg, "architectures", None):
        cfg.architectures = ["LlamaForCausalLM"]
    os.makedirs(folder, exist_ok=True)
    save_file(random_mtp_tensors(cfg, "model.layers.0.", seed, own_head, len(aux_layers or [])),
              os.path.join(folder, "model.safetensors"))
    c = cfg.to_dict()
    if aux_layers:
        c["aux_hidden_state_layer_ids"] = list(aux_layers)
    c["num_hidden_layers"] = 1
    c["num_nextn_predict_layers"] = 1
    c["architectures"] = [cfg.architectures[0] + "NextN"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    return folder


def shared_data_dir() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.normpath(os.path.join(here, "..", "..", "shared", "data"))
    return path if os.path.isdir(path) else None


def make_qk_prep(d: int, rot_dim: int, norms: bool, zero_centred: bool, positions: torch.Tensor,
                 g: torch.Generator, max_pos: int):
    """A layers.attention.QKPrep on positions' device: rotary over the first rot_dim of d dims (a table of max_pos
    positions) and, with norms, random per-head q/k RMSNorm weights (zero-centred or plain)."""
    from specserve.layers.attention import QKPrep
    from specserve.layers.norm import RMSNorm
    from specserve.layers.rotary import RotaryEmbedding

    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    with torch.device(positions.device):
        rotary = RotaryEmbedding(rot_dim, max_pos, inv_freq)
        if not norms:
            return QKPrep(rotary, positions)
        q_norm, k_norm = RMSNorm(d, 1e-6, zero_centred), RMSNorm(d, 1e-6, zero_centred)
    with torch.no_grad():
        for n in (q_norm, k_norm):
            n.weight.copy_(torch.randn(d, generator=g) * 0.3 + (0.0 if zero_centred else 1.0))
    return QKPrep(rotary, positions, q_norm, k_norm)
