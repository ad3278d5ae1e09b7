"""Set-up for the phase benchmark: models (a checkpoint, or random weights of a named HF config built directly on
the device), paired plain and speculative model runners, and fake running requests with a KV prefix."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.batch import CacheKind
from specserve.engine.model_runner import ModelRunner
from specserve.engine.request import Req
from specserve.engine.sampling_params import SamplingParams
from specserve.kvcache.manager import KVHandle
from specserve.models.config import ModelConfig
from specserve.models.loader import materialize
from specserve.models.mtp import MTPDraftModel
from specserve.models.registry import config_from_hf, model_class
from specserve.server_args import ServerArgs

# Shapes of public checkpoints (random weights: only shapes matter for timing).
PRESETS: dict[str, dict] = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # Qwen3-30B-A3B: 48 layers, 128 experts of 768, top 8 (all layers sparse); 30.5 B parameters = 61 GB in bf16
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # Qwen3-Next-80B-A3B per-layer shapes with 24 of its 48 layers (18 gated delta net + 6 gated attention, the
    # 3:1 pattern kept): 512 experts of 512, top 10 + a gated shared expert of 512; GDN 16 key / 32 value heads of
    # 128; attention 16 q / 2 kv heads of 256, rotary on a quarter. ~40 B parameters = ~80 GB in bf16, leaving
    # room on an H200 for KV and N + 1 state slots per request.
    "qwen3-next-80b-a3b": dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=2048, intermediate_size=5120,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=24,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(24)],
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        vocab_size=151936, max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    ),
    # GLM-5 per-layer shapes (MLA: 64 heads, q-LoRA 2048, kv-LoRA 512, qk 192 + 64 rope, v 256; DSA indexer 32 heads
    # x 128, top 2048; MoE 256 experts of 2048, top 8 + 1 shared) with 4 of its layers: 1 dense + 3 MoE (~19 GB
    # each in bf16) + the MTP layer, ~82 GB.
    "glm-5": dict(
        architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", hidden_size=6144, intermediate_size=12288,
        moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=1,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, num_hidden_layers=4,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], indexer_types=["full"] * 4,
        num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, index_topk=2048, index_head_dim=128, index_n_heads=32,
        vocab_size=154880, max_position_embeddings=202752, rms_norm_eps=1e-5, tie_word_embeddings=False,
        first_k_dense_replace=1, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # GLM-5 at its full depth, 78 layers (3 dense), with 8 routed experts per MoE layer instead of 256 (top 8 kept, so
    # a decode token reads the same expert bytes as in the real model; a batch or a verify reads at most 8 distinct
    # experts per layer where the real model reads up to 8 per token): ~85 GB with the MTP layer.
    "glm-5-78l-e8": dict(
        architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", hidden_size=6144, intermediate_size=12288,
        moe_intermediate_size=2048, n_routed_experts=8, num_experts_per_tok=8, n_shared_experts=1, n_group=1,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, num_hidden_layers=78,
        mlp_layer_types=["dense"] * 3 + ["sparse"] * 75, indexer_types=["full"] * 78,
        num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, index_topk=2048, index_head_dim=128, index_n_heads=32,
        vocab_size=154880, max_position_embeddings=202752, rms_norm_eps=1e-5, tie_word_embeddings=False,
        first_k_dense_replace=3, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # The same shapes with dense MLA (DeepSeek-V3 layout, no indexer): the dense side of the sparse-vs-dense figure.
    "glm-5-dense-mla": dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=6144, intermediate_size=12288,
        moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=1,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, num_hidden_layers=4, first_k_dense_replace=1,
        num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, vocab_size=154880, max_position_embeddings=202752, rms_norm_eps=1e-5,
        tie_word_embeddings=False, rope_interleave=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
        max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
}


def random_init(module: torch.nn.Module, seed: int) -> None:
    """Normal(0, 0.02) weights, unit norms; rotary tables back to float32. For timing: only shapes matter."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    module.requires_grad_(False).eval()


def random_draft(cfg: ModelConfig, target, dtype: torch.dtype, device: torch.device, max_positions: int,
                 seed: int = 1) -> MTPDraftModel:
    with torch.device("meta"):
        draft = MTPDraftModel(cfg, max_positions)
    draft = materialize(draft, cfg, dtype, device, max_positions)  # straight in `dtype`: no float32 copy
    random_init(draft, seed)
    draft.share_target(target.embed_tokens, target.lm_head)
    return draft


def preset_config(preset: str, layers: int = 0, architecture: str | None = None) -> ModelConfig:
    """The model config of a named preset (PRESETS), parsed as the family parses a checkpoint's. layers > 0: only
    the first `layers` layers (per-layer lists cut alike), for a card the preset does not fit. architecture: read
    the shapes as another architecture of the same family (e.g. Qwen3-Next's as a Qwen3.5 vision-language model's
    language side, which adds interleaved mRoPE)."""
    from transformers import AutoConfig

    spec = dict(PRESETS[preset])
    if architecture:
        spec["architectures"] = [architecture]
    if layers:
        spec["num_hidden_layers"] = layers
        for k in ("layer_types", "mlp_layer_types", "indexer_types"):
            if k in spec:
                spec[k] = spec[k][:layers]
    model_type = spec.pop("model_type")
    try:
        hf = AutoConfig.for_model(model_type, **spec)
    except ValueError:  # a transformers that predates the family: a plain config carries the same fields
        from transformers import PretrainedConfig

        hf = PretrainedConfig(**spec)
    return config_from_hf(hf)


def random_models(preset: str, dtype: torch.dtype, device: torch.device, max_positions: int, seed: int = 0,
                  layers: int = 0, architecture: str | None = None):
    """Target and MTP draft with random weights, made on the device (nothing to carry); layers, architecture:
    preset_config's."""
    cfg = preset_config(preset, layers, architecture)
    with torch.device("meta"):
        target = model_class(cfg.architecture)(cfg, max_positions)
    target = materialize(target, cfg, dtype, device, max_positions)  # a 30B model has no room for float32
    target.tie_weights()
    random_init(target, seed)
    return target, random_draft(cfg, target, dtype, device, max_positions, seed + 1), cfg


def random_token_map(vocab_size: int, size: int, seed: int = 0) -> torch.Tensor:
    """`size` random target ids, ascending: a --speculative-token-map for timing (its coverage means nothing)."""
    return torch.sort(torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:size]).values


def meta_models(preset: str, max_positions: int, dtype: torch.dtype = torch.bfloat16):
    """Target and MTP draft of a preset on the meta device in `dtype`: their shapes and caches, no memory
    (bench/floors.py)."""
    cfg = preset_config(preset)
    with torch.device("meta"):
        target = model_class(cfg.architecture)(cfg, max_positions).to(dtype)
        draft = MTPDraftModel(cfg, max_positions).to(dtype)
    target.tie_weights()
    draft.share_target(target.embed_tokens, target.lm_head)
    return target, draft


@dataclass
class Pair:
    plain: ModelRunner
    spec: ModelRunner


def make_runners(target, draft, cfg: ModelConfig, dtype, device, num_steps: int, max_bs: int, context_len: int,
                 disable_graphs: bool, attention_backend: str = "auto", capture_bs: list[int] | None = None,
                 prefill_graph_tokens: int = 0, decode_gemv: str = "auto", adaptive: bool | None = None,
                 spec_prefill_graph_tokens: int = 0, indexer_cache_dtype: str = "auto",
                 kv_cache_dtype: str = "auto") -> Pair:
    """capture_bs: the batch sizes to capture (default: the engine's ladder up to max_bs). prefill_graph_tokens:
    the plain runner's prefill graphs up to this many tokens (0: none); spec_prefill_graph_tokens: the spec runner's
    (its prefills and the draft's catch-ups after plain steps).
    adaptive: the spec runner's adaptive speculation (its plain steps; None: the engine's default, on on a GPU)."""
    if attention_backend == "torch" and {s.kind for s in target.cache_specs()} & {CacheKind.MLA, CacheKind.INDEX_KEYS}:
        prefill_graph_tokens = spec_prefill_graph_tokens = 0  # the MLA / indexer reference backends: eager prefill
    tokens = max_bs * (context_len + num_steps + 2) + 1024
    common = dict(max_total_tokens=tokens, max_running_requests=max_bs, cuda_graph_max_bs=max_bs,
                  cuda_graph_bs=capture_bs, disable_cuda_graph=disable_graphs, attention_backend=attention_backend,
                  context_length=context_len, decode_gemv=decode_gemv, indexer_cache_dtype=indexer_cache_dtype,
                  kv_cache_dtype=kv_cache_dtype)
    plain = ModelRunner(ServerArgs(cuda_graph_max_prefill_tokens=prefill_graph_tokens, **common), target, cfg, None,
                        device, dtype, context_len)
    spec = ModelRunner(ServerArgs(speculative_algorithm="MTP", speculative_num_steps=num_steps,
                                  cuda_graph_max_prefill_tokens=spec_prefill_graph_tokens,
                                  speculative_adaptive=adaptive, **common), target,
                       cfg, draft, device, dtype, context_len)
    plain.capture_graphs()
    spec.capture_graphs()
    return Pair(plain, spec)


def fake_requests(mr: ModelRunner, bs: int, prefix: int, seed: int = 0) -> list[Req]:
    """bs running greedy requests with `prefix` tokens of (random) KV, owning slots for the next step."""
    g = torch.Generator().manual_seed(seed)
    hi = min(1000, mr.cfg.vocab_size)  # token ids 10..hi-1 (any real vocabulary is larger)
    reqs = []
    for i in range(bs):
        r = Req(f"bench{i}", torch.randint(10, hi, (prefix,), generator=g).tolist(),
                SamplingParams(max_new_tokens=1 << 30, temperature=0.0, ignore_eos=True), seed=i)
        r.kv = KVHandle()
        assert mr.kv.assign_row(r.kv) and mr.kv.ensure([r.kv], [prefix + mr.num_steps + 2])
        r.seq_len = prefix
        r.prefill_len = prefix
        reqs.append(r)
    for caches in (mr.caches, mr.spec.caches if mr.spec else None):
        if caches is not None:
            randomize_token_caches(caches)
    rows = torch.tensor([r.kv.row for r in reqs], device=mr.device)
    mr.last_token[rows] = torch.randint(10, hi, (bs,), device=mr.device)
    if mr.spec is not None:
        st = mr.spec.state
        st.draft_token[rows] = torch.randint(10, hi, (bs,), device=mr.device)
        st.draft_hidden[rows] = torch.randn(bs, mr.cfg.hidden_size, device=mr.device).to(st.draft_hidden.dtype)
    return reqs


def randomize_token_caches(caches) -> None:
    """Normal(0, 1) rows in every token-indexed cache (MHA K/V, MLA latents, indexer keys; 8-bit ones through a
    bfloat16 draw), so attention and the indexer's top-k see spread scores rather than all-equal zeros."""
    for kind, pool in caches.pools.items():
        if kind is CacheKind.MHA:
            for t in (*pool.k, *pool.v):
                if t.dtype.itemsize == 1:  # fp8 K/V: a bfloat16 draw (normal_ has no 8-bit kernel), unit scales
                    t.copy_(torch.randn(t.shape, device=t.device, dtype=torch.bfloat16))
                else:
                    t.normal_()
        elif kind.token_indexed:
            for t in pool.rows:
                if t.dtype.itemsize == 1:
                    t.copy_(torch.randn(t.shape, device=t.device, dtype=torch.bfloat16))
                else:
                    t.normal_()
            for t in getattr(pool, "scales", None) or ():  # fp8 rows' scales (index keys: per token; latents: groups)
                t.uniform_(0.5, 1.5)


def release(mr: ModelRunner, reqs: list[Req]) -> None:
    for r in reqs:
        mr.kv.release(r.kv)
