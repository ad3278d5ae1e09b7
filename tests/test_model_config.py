"""Family-owned model configs and the lazy architecture registry (models/config.py, models/registry.py).

config_from_hf picks the family by `architectures` and lets it parse; the family's fields follow the
transformers config (biases, q/k norm, MoE shapes, head_dim default, eos ids); each family lists the
architectures it parses with their fixed features (no name-prefix guessing). Both rope layouts (top-level
rope_theta / rope_scaling and transformers 5's rope_parameters) give the same inverse frequencies, scaled ropes
included, from a transformers config or a plain object. A sliding window bounds the context served (attention here
is full attention). A config the engine cannot serve is a ValueError that says why, never an AttributeError.
"""

import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from specserve.layers.rotary import inv_freq_from_config
from specserve.models.config import ModelConfig
from specserve.models.dense import DENSE_ARCHITECTURES, DenseConfig, DenseForCausalLM
from specserve.models.qwen3_moe import Qwen3MoeConfig as OurQwen3MoeConfig
from specserve.models.qwen3_moe import Qwen3MoeForCausalLM
from specserve.models.registry import MODEL_REGISTRY, architecture_of, config_from_hf, model_class

SHAPE = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
             vocab_size=300, max_position_embeddings=1024, rms_norm_eps=1e-5)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=False, decoder_sparse_step=2,
           mlp_only_layers=[0])

_HF = {
    "LlamaForCausalLM": (LlamaConfig, {}),
    "MistralForCausalLM": (MistralConfig, {}),
    "Qwen2ForCausalLM": (Qwen2Config, {}),
    "Qwen3ForCausalLM": (Qwen3Config, dict(head_dim=16)),
    "Qwen3MoeForCausalLM": (Qwen3MoeConfig, MOE),
}


@pytest.fixture(autouse=True)
def _quiet_transformers():
    # transformers warns about rope fields of hand-made configs; the tests check the numbers, not the log
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def _hf(arch: str, **kw):
    cls, extra = _HF[arch]
    cfg = cls(**{**SHAPE, **extra, **kw})
    cfg.architectures = [arch]
    return cfg


# ---------------------------------------------------------------------------------------------- families
@pytest.mark.parametrize("arch,qkv_bias,o_bias,qk_norm", [
    ("LlamaForCausalLM", False, False, False),
    ("Qwen2ForCausalLM", True, False, False),
    ("Qwen3ForCausalLM", False, False, True),
    ("Qwen3MoeForCausalLM", False, False, True),
])
def test_from_hf_returns_the_family_config(arch, qkv_bias, o_bias, qk_norm):
    hf = _hf(arch, eos_token_id=[7, 9], tie_word_embeddings=True)
    cfg = config_from_hf(hf)
    family = OurQwen3MoeConfig if "Moe" in arch else DenseConfig
    assert type(cfg) is family
    assert cfg.architecture == arch and cfg.hf_config is hf
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm) == (qkv_bias, o_bias, qk_norm)
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.intermediate_size) == (96, 3, 300, 160)
    assert (cfg.num_heads, cfg.num_kv_heads) == (6, 2)
    assert cfg.head_dim == (16 if arch == "Qwen3ForCausalLM" else 96 // 6)
    assert cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 1024
    assert cfg.eos_token_ids == [7, 9]
    assert cfg.tie_word_embeddings is True
    assert cfg.partial_rotary_factor == 1.0 and cfg.mrope_section is None
    assert cfg.num_nextn_predict_layers == 0


def test_moe_fields():
    cfg = config_from_hf(_hf("Qwen3MoeForCausalLM", eos_token_id=5))
    assert isinstance(cfg, OurQwen3MoeConfig) and isinstance(cfg, DenseConfig)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 40)
    assert cfg.norm_topk_prob is False and cfg.decoder_sparse_step == 2 and cfg.mlp_only_layers == [0]
    assert [cfg.is_sparse(i) for i in range(4)] == [False, True, False, True]  # step 2, layer 0 forced dense
    assert cfg.eos_token_ids == [5]
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        config_from_hf(_hf("Qwen3MoeForCausalLM", num_experts_per_tok=9))


def test_attention_bias_switches():
    # Llama / Qwen3: attention_bias covers q, k, v and o; Qwen2 always has q/k/v biases and never an o bias
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        cfg = config_from_hf(_hf(arch, attention_bias=True))
        assert cfg.qkv_bias and cfg.o_bias
    cfg = config_from_hf(_hf("Qwen2ForCausalLM", attention_bias=True))
    assert cfg.qkv_bias and not cfg.o_bias


def test_head_dim_defaults_to_hidden_over_heads():
    ns = _namespace("Qwen3ForCausalLM")
    del ns.head_dim
    assert config_from_hf(ns).head_dim == 96 // 6
    ns.head_dim = 40  # an explicit head_dim wins (Qwen3 checkpoints often have heads * head_dim != hidden)
    assert config_from_hf(ns).head_dim == 40


@pytest.mark.parametrize("eos,expected", [(None, []), (3, [3]), ([4, 8], [4, 8]), ((1, 2), [1, 2])])
def test_eos_ids_are_a_list(eos, expected):
    ns = _namespace("LlamaForCausalLM")
    ns.eos_token_id = eos
    ids = config_from_hf(ns).eos_token_ids
    assert ids == expected and isinstance(ids, list)


def test_model_type_gives_the_architecture_without_architectures():
    for model_type, arch in (("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                             ("qwen3_moe", "Qwen3MoeForCausalLM")):
        hf = _HF[arch][0](**{**SHAPE, **_HF[arch][1]})
        assert not hf.architectures and hf.model_type == model_type
        assert config_from_hf(hf).architecture == arch
    with pytest.raises(ValueError, match="architecture"):
        architecture_of(SimpleNamespace(model_type="gpt2"))


# ---------------------------------------------------------------------------------------------- rope
def _namespace(arch: str, **kw) -> SimpleNamespace:
    """A plain config-like object (not a transformers config): the fields of `arch`'s transformers config."""
    d = _hf(arch).to_dict()
    d.pop("rope_parameters", None)
    if "num_local_experts" in d:
        d["num_experts"] = d.pop("num_local_experts")  # the checkpoint's name (transformers maps it)
    d.update(kw)
    return SimpleNamespace(**d)


def _closed_form(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def test_default_rope_top_level_theta_and_rope_parameters_agree():
    old = _namespace("LlamaForCausalLM", rope_theta=250000.0)
    new = _namespace("LlamaForCausalLM", rope_parameters={"rope_type": "default", "rope_theta": 250000.0})
    mixed = _namespace("LlamaForCausalLM", rope_theta=250000.0, rope_parameters={"rope_type": "default"})
    (a, sa), (b, sb), (c, sc) = (inv_freq_from_config(x, 16) for x in (old, new, mixed))
    assert torch.equal(a, b) and torch.equal(a, c) and sa == sb == sc == 1.0
    torch.testing.assert_close(a, _closed_form(250000.0, 16).float(), rtol=1e-6, atol=0)
    assert not torch.allclose(a, inv_freq_from_config(_namespace("LlamaForCausalLM", rope_theta=1e4), 16)[0])
    # and through the family: the same rotary tables
    tables = [DenseForCausalLM.make_rotary(config_from_hf(x), 64).cos_sin_cache for x in (old, new)]
    assert torch.equal(tables[0], tables[1])


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize("arch,scaling,theta", [("LlamaForCausalLM", LLAMA3, 500000.0),
                                                ("Qwen3ForCausalLM", YARN, 1e6),
                                                ("Qwen2ForCausalLM", {"rope_type": "linear", "factor": 2.0}, 1e6)])
def test_scaled_rope_both_layouts_agree_with_transformers(arch, scaling, theta):
    old = _hf(arch, rope_theta=theta, rope_scaling=dict(scaling))
    new = _hf(arch, rope_parameters=dict(scaling, rope_theta=theta))
    head_dim = config_from_hf(old).head_dim
    (a, sa), (b, sb) = inv_freq_from_config(old, head_dim), inv_freq_from_config(new, head_dim)
    assert torch.equal(a, b) and sa == sb
    unscaled = _closed_form(theta, head_dim).float()
    assert not torch.allclose(a, unscaled)  # the scaling was applied
    # transformers' own rotary module for this family is the oracle
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ref, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](new, torch.device("cpu"))
    torch.testing.assert_close(a, ref.float(), rtol=0, atol=0)
    assert sa == pytest.approx(ref_scale)
    if scaling["rope_type"] == "yarn":
        assert sa > 1.0


YARN_FULL = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 16.0,
             "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 0.6}  # the old `type` key, DeepSeek's mscale pair


@pytest.mark.parametrize("arch,scaling,theta", [("LlamaForCausalLM", LLAMA3, 500000.0),
                                                ("Qwen3ForCausalLM", YARN, 1e6),
                                                ("Qwen3ForCausalLM", YARN_FULL, 1e6),
                                                ("Qwen2ForCausalLM", {"type": "linear", "factor": 2.0}, 1e6),
                                                ("Qwen3MoeForCausalLM", {"rope_type": "linear", "factor": 4.0}, 1e4)])
def test_scaled_rope_from_a_plain_old_style_config(arch, scaling, theta):
    """A plain config object (not a transformers config: what a GGUF or an old config.json gives) with top-level
    rope_theta + rope_scaling gives the same table as a transformers config with rope_parameters."""
    old = _namespace(arch, rope_theta=theta, rope_scaling=dict(scaling))
    params = {("rope_type" if k == "type" else k): v for k, v in scaling.items()}
    new = _hf(arch, rope_parameters=dict(params, rope_theta=theta))
    head_dim = config_from_hf(old).head_dim
    (a, sa), (b, sb) = inv_freq_from_config(old, head_dim), inv_freq_from_config(new, head_dim)
    assert torch.equal(a, b) and sa == sb
    assert not torch.allclose(a, _closed_form(theta, head_dim).float())  # the scaling was applied
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ref, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](new, torch.device("cpu"))
    torch.testing.assert_close(a, ref.float(), rtol=0, atol=0)
    assert sa == pytest.approx(ref_scale)
    family = model_class(arch)
    tables = [family.make_rotary(config_from_hf(x), 64).cos_sin_cache for x in (old, new)]
    assert torch.equal(tables[0], tables[1])


def test_yarn_original_context_defaults_as_transformers_does():
    """yarn / llama3 without original_max_position_embeddings in the rope parameters: the top-level field when the
    config has one, else max_position_embeddings (transformers' standardize_rope_params)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "yarn", "factor": 4.0}
    old = _namespace("Qwen3ForCausalLM", rope_theta=1e6, rope_scaling=dict(scaling))
    new = _hf("Qwen3ForCausalLM", rope_parameters=dict(scaling, rope_theta=1e6))
    assert new.rope_parameters["original_max_position_embeddings"] == 1024  # max_position_embeddings
    ref = ROPE_INIT_FUNCTIONS["yarn"](new, torch.device("cpu"))[0]
    assert torch.equal(inv_freq_from_config(old, 16)[0], ref) and torch.equal(inv_freq_from_config(new, 16)[0], ref)
    top = _namespace("Qwen3ForCausalLM", rope_theta=1e6, original_max_position_embeddings=64,
                     rope_scaling=dict(scaling, original_max_position_embeddings=256))
    want = _namespace("Qwen3ForCausalLM", rope_theta=1e6,
                      rope_scaling=dict(scaling, original_max_position_embeddings=64))
    assert torch.equal(inv_freq_from_config(top, 16)[0], inv_freq_from_config(want, 16)[0])
    assert not torch.equal(inv_freq_from_config(top, 16)[0], ref)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "proportional", "made_up"])
@pytest.mark.parametrize("style", ["old", "new"])
def test_an_unsupported_rope_type_is_a_value_error(rope_type, style):
    """dynamic NTK and longrope change their frequencies with the sequence length; a static table cannot."""
    scaling = {"rope_type": rope_type, "factor": 2.0}
    cfg = (_namespace("LlamaForCausalLM", rope_theta=1e4, rope_scaling=scaling) if style == "old"
           else _namespace("LlamaForCausalLM", rope_parameters=dict(scaling, rope_theta=1e4)))
    with pytest.raises(ValueError, match=f"rope type {rope_type!r}"):
        inv_freq_from_config(cfg, 16)
    with pytest.raises(ValueError, match="rope type"):
        DenseForCausalLM.make_rotary(config_from_hf(cfg), 64)


@pytest.mark.parametrize("scaling,missing", [({"type": "linear"}, "factor"),
                                             ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
                                              "high_freq_factor"),
                                             ({"rope_type": "yarn"}, "factor")])
def test_a_scaled_rope_missing_a_parameter_is_a_value_error_naming_it(scaling, missing):
    with pytest.raises(ValueError, match=missing):
        inv_freq_from_config(_namespace("LlamaForCausalLM", rope_theta=1e4, rope_scaling=scaling), 16)


def test_partial_rotary_factor_is_read_from_either_place():
    top = _namespace("LlamaForCausalLM", partial_rotary_factor=0.5)
    nested = _namespace("LlamaForCausalLM", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                             "partial_rotary_factor": 0.25})
    assert ModelConfig.core_fields(top, "LlamaForCausalLM")["partial_rotary_factor"] == 0.5
    assert ModelConfig.core_fields(nested, "LlamaForCausalLM")["partial_rotary_factor"] == 0.25
    assert ModelConfig.core_fields(_namespace("LlamaForCausalLM"), "LlamaForCausalLM")["partial_rotary_factor"] == 1.0
    hf = _hf("Qwen3ForCausalLM")
    hf.rope_parameters = dict(hf.rope_parameters, partial_rotary_factor=0.5)
    assert ModelConfig.core_fields(hf, "Qwen3ForCausalLM")["partial_rotary_factor"] == 0.5


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_partial_rotary_is_rejected_with_a_value_error(arch, where):
    if where == "top":
        cfg = _namespace(arch, partial_rotary_factor=0.5)
    else:
        cfg = _namespace(arch, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        config_from_hf(cfg)


# ---------------------------------------------------------------------------------------------- errors
def test_unsupported_architecture_lists_the_supported_ones():
    hf = _hf("LlamaForCausalLM")
    hf.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError) as e:
        config_from_hf(hf)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    assert all(arch in msg for arch in MODEL_REGISTRY)
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM"):
        model_class("MixtralForCausalLMNextN")


DENSE_REQUIRED = ["hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "intermediate_size"]
MOE_REQUIRED = DENSE_REQUIRED + ["num_experts", "num_experts_per_tok", "moe_intermediate_size"]


@pytest.mark.parametrize("arch,name", [("LlamaForCausalLM", n) for n in DENSE_REQUIRED]
                         + [("Qwen2ForCausalLM", "num_attention_heads")]
                         + [("Qwen3MoeForCausalLM", n) for n in MOE_REQUIRED])
def test_a_missing_required_field_is_a_value_error_naming_it(arch, name):
    ns = _namespace(arch)
    config_from_hf(ns)  # complete: parses
    delattr(ns, name)
    with pytest.raises(ValueError, match=repr(name)):
        config_from_hf(ns)
    # the same with a transformers config object that lacks the field (a generic PreTrainedConfig: the family
    # classes fill in defaults for every field)
    hf = PretrainedConfig(**vars(ns))
    assert not hasattr(hf, name) and hf.architectures == [arch]
    with pytest.raises(ValueError, match=repr(name)):
        config_from_hf(hf)
    setattr(hf, name, getattr(_namespace(arch), name))
    assert config_from_hf(hf).num_layers == 3


def test_a_vision_language_config_reads_its_text_config():
    text = _namespace("Qwen3ForCausalLM", eos_token_id=None)
    outer = SimpleNamespace(architectures=["Qwen3ForCausalLM"], text_config=text, eos_token_id=11)
    cfg = config_from_hf(outer)
    assert (cfg.hidden_size, cfg.num_heads, cfg.head_dim) == (96, 6, 16) and cfg.eos_token_ids == [11]
    del text.num_attention_heads
    with pytest.raises(ValueError, match="'num_attention_heads'"):
        config_from_hf(outer)


def test_mlp_bias_is_rejected():
    with pytest.raises(ValueError, match="mlp_bias"):
        config_from_hf(_hf("LlamaForCausalLM", mlp_bias=True))
    assert config_from_hf(_hf("LlamaForCausalLM", mlp_bias=False)).intermediate_size == 160


# ---------------------------------------------------------------------------------------------- drafts, registry
@pytest.mark.parametrize("target,cls,family", [("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM, OurQwen3MoeConfig),
                                               ("LlamaForCausalLM", DenseForCausalLM, DenseConfig),
                                               ("Qwen2ForCausalLM", DenseForCausalLM, DenseConfig)])
def test_a_nextn_draft_maps_to_its_targets_family(target, cls, family):
    assert model_class(target + "NextN") is model_class(target) is cls
    hf = _hf(target, num_hidden_layers=1)
    hf.architectures = [target + "NextN"]
    cfg = config_from_hf(hf)
    assert type(cfg) is family and cfg.architecture == target + "NextN"
    ref = config_from_hf(_hf(target, num_hidden_layers=1))
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm) == (ref.qkv_bias, ref.o_bias, ref.qk_norm)
    if family is OurQwen3MoeConfig:
        assert cfg.num_experts == ref.num_experts == 8


def test_registry_imports_a_family_only_when_asked():
    code = "\n".join([
        "import sys",
        "import specserve.models.registry as reg",
        "loaded = lambda: sorted(m for m in sys.modules if m.startswith('specserve.models.'))",
        "assert 'specserve.models.qwen3_moe' not in sys.modules, loaded()",
        "assert 'specserve.models.dense' not in sys.modules, loaded()",
        "cls = reg.model_class('Qwen3MoeForCausalLM')",
        "assert 'specserve.models.qwen3_moe' in sys.modules, loaded()",
        "assert cls is sys.modules['specserve.models.qwen3_moe'].Qwen3MoeForCausalLM",
        "reg.model_class('LlamaForCausalLM')",
        "assert 'specserve.models.dense' in sys.modules",
    ])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------------------------------------- architecture features
def test_every_dense_architecture_of_the_registry_has_its_features():
    """The features of each architecture (and of its NextN draft) are listed by the family that parses it; each
    family's table lists only architectures the registry sends to it."""
    dense_families = set()
    for arch in MODEL_REGISTRY:
        config_class = model_class(arch).config_class
        if issubclass(config_class, DenseConfig):
            dense_families.add(config_class)
            assert arch in config_class.arch_features and arch + "NextN" in config_class.arch_features, arch
    assert dense_families == {DenseConfig, OurQwen3MoeConfig}
    for config_class in dense_families:
        for arch in config_class.arch_features:
            assert model_class(arch).config_class is config_class, arch
    assert set(DENSE_ARCHITECTURES) == {f"{a}{s}" for a in ("LlamaForCausalLM", "MistralForCausalLM",
                                                              "Qwen2ForCausalLM", "Qwen3ForCausalLM")
                                        for s in ("", "NextN")}


def test_mistral_is_a_plain_dense_block():
    cfg = config_from_hf(_hf("MistralForCausalLM", attention_bias=False))
    assert type(cfg) is DenseConfig and (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm) == (False, False, False)


def test_a_family_config_refuses_an_architecture_it_does_not_list():
    with pytest.raises(ValueError, match="'Qwen3MoeForCausalLM'"):
        DenseConfig.from_hf(_hf("Qwen3MoeForCausalLM"), "Qwen3MoeForCausalLM")
    with pytest.raises(ValueError, match="'LlamaForCausalLM'"):
        OurQwen3MoeConfig.from_hf(_hf("Qwen3MoeForCausalLM"), "LlamaForCausalLM")


ALL_DENSE = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]


@pytest.mark.parametrize("arch", ALL_DENSE)
def test_hidden_act_other_than_silu_is_a_value_error(arch):
    for act in ("gelu", "relu"):
        with pytest.raises(ValueError, match=f"hidden_act={act!r}"):
            config_from_hf(_namespace(arch, hidden_act=act))
        hf = _hf(arch, num_hidden_layers=1, hidden_act=act)
        hf.architectures = [arch + "NextN"]  # a draft checkpoint too
        with pytest.raises(ValueError, match="hidden_act"):
            config_from_hf(hf)
    for act in ("silu", "swish"):  # transformers' two names of SiLU
        assert config_from_hf(_namespace(arch, hidden_act=act)).num_layers == 3


# ---------------------------------------------------------------------------------------------- sliding window
@pytest.mark.parametrize("arch,fields,window", [
    ("MistralForCausalLM", dict(sliding_window=64), 64),
    ("MistralForCausalLM", dict(sliding_window=None), None),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=64), 64),
    ("Qwen2ForCausalLM", dict(use_sliding_window=False, sliding_window=64), None),
    ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=64), 64),
    ("Qwen3ForCausalLM", dict(use_sliding_window=False, sliding_window=64), None),
    ("Qwen3MoeForCausalLM", dict(use_sliding_window=True, sliding_window=64), 64),
    ("Qwen3MoeForCausalLM", dict(use_sliding_window=False, sliding_window=64), None),
    ("LlamaForCausalLM", dict(sliding_window=64), None),  # Llama has no sliding window: transformers ignores it
])
def test_a_sliding_window_bounds_the_context(arch, fields, window):
    """Attention here is full attention, which equals a sliding window's only while the context fits in it: the
    context defaults to the window, and a longer --context-length is a ValueError naming the field."""
    for hf in (_namespace(arch, **fields), _hf(arch, **fields)):  # a plain config object and a transformers one
        cfg = config_from_hf(hf)
        assert cfg.sliding_window == window
        if window is None:
            assert cfg.context_len(None) == 1024 and cfg.context_len(5000) == 5000
            continue
        assert cfg.context_len(None) == 64 and cfg.context_len(48) == 48 and cfg.context_len(64) == 64
        with pytest.raises(ValueError, match="sliding_window=64"):
            cfg.context_len(65)


def test_a_window_longer_than_the_model_leaves_its_context():
    cfg = config_from_hf(_hf("MistralForCausalLM"))  # transformers' default window: 4096 > 1024 positions
    assert cfg.sliding_window == 4096
    assert cfg.context_len(None) == 1024 and cfg.context_len(4096) == 4096
    with pytest.raises(ValueError, match="sliding_window=4096"):
        cfg.context_len(4097)


def test_the_engine_serves_a_sliding_window_model_within_its_window(tmp_path):
    """A Mistral checkpoint with a 24-token window: the engine's context is the window, a longer --context-length
    is refused before any weight is read, and within the window greedy tokens equal transformers'."""
    from spec_fixtures import build_scheduler, run_greedy
    from test_spec_greedy import _hf_greedy
    from transformers import AutoModelForCausalLM

    from specserve.engine.engine import load_models
    from specserve.server_args import ServerArgs

    hf_cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, sliding_window=24,
                           architectures=["MistralForCausalLM"], eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).save_pretrained(str(tmp_path))
    path, cpu = str(tmp_path), torch.device("cpu")
    with pytest.raises(ValueError, match="sliding_window=24"):
        load_models(ServerArgs(model_path=path, context_length=25), cpu)
    assert load_models(ServerArgs(model_path=path), cpu).context_len == 24
    assert load_models(ServerArgs(model_path=path, context_length=16), cpu).context_len == 16
    prompts, new = [[5, 9, 13, 4, 77], [3] + list(range(40, 50))], 10  # at most 21 tokens: inside the window
    sched, _ = build_scheduler(path, context_length=24, max_total_tokens=512)
    assert [r.output_ids for r in run_greedy(sched, prompts, new)] == _hf_greedy(path, prompts, new)
