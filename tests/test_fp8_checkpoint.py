"""FP8 block-scaled checkpoints (weights/fp8.py): the dequantization against a block-by-block reference, the
pairing of weights and scales as they stream, the config checks, and a tiny DeepSeek-V3 with its MTP layer saved
in FP8 that loads (target and draft) into exactly the parameters of the same checkpoint saved dequantized — which
the other tests hold to transformers."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from deepseek_helpers import build_tiny_deepseek
from hybrid_helpers import build_tiny_hybrid
from safetensors.torch import load_file, save_file

from specserve.models.loader import ModelSource, load_mtp_draft, load_target
from specserve.weights.fp8 import Fp8Format, dequantize, dequantize_stream, fp8_format

FP8 = torch.float8_e4m3fn


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] -> (float8 [O, I], scale_inv [ceil(O/bo), ceil(I/bi)]): each block's max to the format's max."""
    bo, bi = block
    o, i = w.shape
    scale = torch.empty((-(-o // bo), -(-i // bi)))
    q = torch.empty((o, i), dtype=FP8)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            blk = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]
            s = blk.abs().max().clamp_min(1e-12) / torch.finfo(FP8).max
            scale[r, c] = s
            q[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = (blk / s).to(FP8)
    return q, scale


def _dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bo, bi = block
    out = q.float()
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            out[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] *= scale[r, c]
    return out


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((40, 24), (16, 16)), ((33, 70), (16, 24))])
def test_dequantize_matches_blockwise_reference(shape, block):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])) * 3
    q, s = _quantize(w, block)
    got = dequantize(q, s, Fp8Format(block))
    assert torch.equal(got, _dequantize_blockwise(q, s, block))
    torch.testing.assert_close(got, w, rtol=0.07, atol=1e-3 * w.abs().max().item())  # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match="does not fit"):
        dequantize(q, s[:, :-1], Fp8Format(block))
    assert torch.equal(dequantize(q, torch.tensor(0.5), Fp8Format(None)), q.float() * 0.5)  # one scale a tensor


def test_stream_pairs_weights_and_scales_in_any_order():
    fmt = Fp8Format((16, 16))
    w1, s1 = _quantize(torch.randn(20, 20), (16, 16))
    w2, s2 = _quantize(torch.randn(16, 32), (16, 16))
    plain = torch.randn(3)
    stream = [("a.weight", w1), ("b.weight_scale_inv", s2), ("norm.weight", plain), ("a.weight_scale_inv", s1),
              ("b.weight", w2)]
    out = dict(dequantize_stream(stream, fmt))
    assert set(out) == {"a.weight", "b.weight", "norm.weight"}
    assert torch.equal(out["a.weight"], dequantize(w1, s1, fmt))
    assert torch.equal(out["b.weight"], dequantize(w2, s2, fmt))
    assert out["norm.weight"] is plain
    with pytest.raises(ValueError, match="without their scale"):
        list(dequantize_stream([("a.weight", w1)], fmt))
    with pytest.raises(ValueError, match="without their"):
        list(dequantize_stream([("a.weight_scale_inv", s1)], fmt))


def test_format_from_config():
    cfg = lambda q: SimpleNamespace(quantization_config=q)  # noqa: E731
    assert fp8_format(SimpleNamespace()) is None and fp8_format(cfg(None)) is None
    fmt = fp8_format(cfg({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}))
    assert fmt == Fp8Format((128, 128))
    assert fp8_format(cfg({"quant_method": "fp8"})) == Fp8Format(None)
    with pytest.raises(ValueError, match="'awq' is not supported"):
        fp8_format(cfg({"quant_method": "awq"}))
    with pytest.raises(ValueError, match="activation scheme 'static'"):
        fp8_format(cfg({"quant_method": "fp8", "activation_scheme": "static"}))


def _quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] -> (float8 [O, I], scale [O, 1]): compressed-tensors' per-channel layout."""
    s = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / torch.finfo(FP8).max  # [O, 1]
    return (w / s).to(FP8), s


COMPRESSED_TENSORS_FP8 = {  # llm-compressor's FP8_DYNAMIC scheme: per-channel weights, per-token dynamic inputs
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {"targets": ["Linear"],
                                  "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                              "dynamic": False, "symmetric": True},
                                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                        "dynamic": True, "symmetric": True}}}}


def _fp8_copies(src: str, root: str, block: tuple[int, int] | None, plain: tuple[str, ...] = ()) -> tuple[str, str]:
    """The checkpoint at src twice: its projection and expert weights in FP8 with block scales (and the config's
    quantization_config; block None: compressed-tensors' per-channel `weight_scale`), those whose name holds one of
    `plain` left as they are, and the same FP8 values dequantized into a plain checkpoint."""
    suffix = "_scale_inv" if block is not None else "_scale"
    fp8_dir, ref_dir = os.path.join(root, "fp8"), os.path.join(root, "dequantized")
    for d in (fp8_dir, ref_dir):
        shutil.copytree(src, d)
    quantized = 0
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            continue
        tensors = load_file(os.path.join(src, name))
        fp8, ref = {}, {}
        for k, t in tensors.items():
            if t.dim() == 2 and k.endswith("proj.weight") and "embed" not in k and not any(p in k for p in plain):
                if block is None:
                    q, s = _quantize_rows(t.float())
                    ref[k] = (q.float() * s).to(t.dtype)
                else:
                    q, s = _quantize(t.float(), block)
                    ref[k] = _dequantize_blockwise(q, s, block).to(t.dtype)
                fp8[k], fp8[k + suffix] = q, s
                quantized += 1
            else:
                fp8[k] = ref[k] = t
        save_file(fp8, os.path.join(fp8_dir, name))
        save_file(ref, os.path.join(ref_dir, name))
    assert quantized > 20  # attention, dense MLP, routed and shared experts, the MTP layer
    index = os.path.join(fp8_dir, "model.safetensors.index.json")
    if os.path.exists(index):  # scales live in the shard of their weight
        with open(index) as f:
            idx = json.load(f)
        idx["weight_map"].update({k + suffix: v for k, v in list(idx["weight_map"].items())
                                  if k.endswith("proj.weight") and "embed" not in k
                                  and not any(p in k for p in plain)})
        with open(index, "w") as f:
            json.dump(idx, f)
    with open(os.path.join(fp8_dir, "config.json")) as f:
        c = json.load(f)
    c["quantization_config"] = (COMPRESSED_TENSORS_FP8 if block is None else
                                {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": list(block)})
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(c, f)
    return fp8_dir, ref_dir


def plain_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """model's state dict with every FP8 weight dequantized (float32) and its scales dropped: what it computes
    with, comparable to a plain checkpoint's parameters."""
    from specserve.kernels.reference_fp8 import dequantize_weight
    from specserve.kernels.reference_moe_fp8 import dequantize_blocks
    from specserve.layers.linear import Linear
    from specserve.layers.moe import FusedMoE

    sd = dict(model.state_dict())
    for name, m in model.named_modules():
        p = f"{name}." if name else ""
        if isinstance(m, Linear) and m.is_fp8:
            sd[p + "weight"] = dequantize_weight(m.weight, m.weight_scale, m.fp8_block)
            del sd[p + "weight_scale"]
        elif isinstance(m, FusedMoE) and m.is_fp8:
            sd[p + "w13"] = dequantize_blocks(m.w13, m.w13_scale, m.fp8_block)
            sd[p + "w2"] = dequantize_blocks(m.w2, m.w2_scale, m.fp8_block)
            del sd[p + "w13_scale"], sd[p + "w2_scale"]
    return sd


def fp8_modules(model: torch.nn.Module) -> tuple[int, int]:
    """(linear layers, expert stacks) of model holding FP8 weights."""
    from specserve.layers.linear import Linear
    from specserve.layers.moe import FusedMoE

    mods = list(model.modules())
    return (sum(isinstance(m, Linear) and m.is_fp8 for m in mods),
            sum(isinstance(m, FusedMoE) and m.is_fp8 for m in mods))


@pytest.mark.parametrize("block", [(16, 16), (16, 24)])
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])
def test_fp8_checkpoint_loads_as_its_dequantized_copy(tmp_path, family, block):
    """DeepSeek-V3 (MLA, MoE with per-expert tensors, MTP at layer L) and Qwen3-Next (the fused interleaved
    in_proj_qkvz / in_proj_ba de-interleaved at load, a gated shared expert fused into the routed ones, mtp.*).
    16 x 16 blocks: the linear layers and the experts keep FP8 values and scales (target and MTP draft), and what
    they hold dequantizes to the plain copy's parameters exactly; 16 x 24 blocks (no FP8 kernel takes a 24-wide
    block): every weight is dequantized at load, the plain copy's parameters bit for bit."""
    if family == "deepseek_v3":
        src = build_tiny_deepseek(str(tmp_path / "m"), seed=3, mtp=True)
    else:
        src = build_tiny_hybrid(str(tmp_path / "m"), "qwen3_next", seed=3, mtp=True)
    fp8_dir, ref_dir = _fp8_copies(src, str(tmp_path), block)
    dev = torch.device("cpu")
    got, want = (load_target(ModelSource.resolve(d), torch.float32, dev, 64) for d in (fp8_dir, ref_dir))
    assert got.fp8 == Fp8Format(block) and want.fp8 is None
    assert sorted(got.mtp_names) == sorted(want.mtp_names + [n + "_scale_inv" for n in want.mtp_names
                                                             if n.endswith("proj.weight")])
    drafts = [load_mtp_draft(t, None, torch.float32, dev, 64) for t in (got, want)]
    for a_model, b_model in ((got.model, want.model), (drafts[0], drafts[1])):
        a_sd, b_sd = plain_state(a_model), b_model.state_dict()
        assert sorted(a_sd) == sorted(b_sd)
        for name, b in b_sd.items():
            assert torch.equal(a_sd[name], b), name
        linears, experts = fp8_modules(a_model)
        if block == (16, 16):
            assert linears >= 2 and experts >= 1, (linears, experts)  # the draft's layer too: never dropped
        else:
            assert (linears, experts) == (0, 0)


@pytest.mark.parametrize("plain", [("in_proj_ba", "experts.0."), ("in_proj_qkvz", "experts.7.up_proj")])
def test_fp8_checkpoint_with_plain_parts(tmp_path, plain):
    """A checkpoint whose publisher kept some parts of a fused projection (a gated delta net's gate rows) or some
    expert pieces in bf16: a plain part before its FP8 siblings has them dequantized as they come, one after them
    turns the loaded FP8 parts back into plain values; either way the layer computes in the model dtype with the
    plain copy's parameters exactly, and the other layers keep FP8."""
    src = build_tiny_hybrid(str(tmp_path / "m"), "qwen3_next", seed=3, mtp=True)
    fp8_dir, ref_dir = _fp8_copies(src, str(tmp_path), (16, 16), plain)
    dev = torch.device("cpu")
    got, want = (load_target(ModelSource.resolve(d), torch.float32, dev, 64) for d in (fp8_dir, ref_dir))
    a_sd, b_sd = plain_state(got.model), want.model.state_dict()
    assert sorted(a_sd) == sorted(b_sd)
    for name, b in b_sd.items():
        assert torch.equal(a_sd[name], b), name
    mods = dict(got.model.named_modules())
    assert not mods["model.layers.0.linear_attn.in_proj"].is_fp8  # one of its parts came plain
    assert not mods["model.layers.0.mlp.experts"].is_fp8  # one expert piece came plain
    assert mods["model.layers.0.linear_attn.out_proj"].is_fp8 and mods["model.layers.3.self_attn.qkv_proj"].is_fp8


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_compressed_tensors_per_channel_checkpoint_loads_in_fp8(tmp_path, family):
    """llm-compressor's FP8_DYNAMIC layout (`weight_scale` [O, 1], quant_method compressed-tensors): the linear
    layers keep FP8 with a scale per row, the MTP layer too; per-channel experts (no block: the fused MoE kernel is
    block-scaled) come dequantized; what every layer holds equals the plain copy."""
    from helpers import build_tiny_model

    src = build_tiny_model(str(tmp_path / "m"), family, seed=3, mtp_layout="deepseek")
    fp8_dir, ref_dir = _fp8_copies(src, str(tmp_path), None)
    dev = torch.device("cpu")
    got, want = (load_target(ModelSource.resolve(d), torch.float32, dev, 64) for d in (fp8_dir, ref_dir))
    assert got.fp8 == Fp8Format(None, "_scale")
    drafts = [load_mtp_draft(t, None, torch.float32, dev, 64) for t in (got, want)]
    for a_model, b_model in ((got.model, want.model), (drafts[0], drafts[1])):
        a_sd, b_sd = plain_state(a_model), b_model.state_dict()
        assert sorted(a_sd) == sorted(b_sd)
        for name, b in b_sd.items():
            assert torch.equal(a_sd[name], b), name
        linears, experts = fp8_modules(a_model)
        assert linears >= 2 and experts == 0
    layer = dict(got.model.named_modules())["model.layers.0.self_attn.qkv_proj"]
    assert layer.is_fp8 and layer.fp8_block is None and layer.weight_scale.shape == (layer.weight.shape[0],)


def test_compressed_tensors_configs_refused_clearly():
    def cfg(q):
        return SimpleNamespace(quantization_config=q)

    base = json.loads(json.dumps(COMPRESSED_TENSORS_FP8))
    assert fp8_format(cfg(base)) == Fp8Format(None, "_scale")
    block = json.loads(json.dumps(base))
    block["config_groups"]["group_0"]["weights"].update(strategy="block", block_structure=[128, 128])
    assert fp8_format(cfg(block)) == Fp8Format((128, 128), "_scale")
    int4 = json.loads(json.dumps(base))
    int4["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int")
    with pytest.raises(ValueError, match="only 8-bit float"):
        fp8_format(cfg(int4))
    static = json.loads(json.dumps(base))
    static["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    with pytest.raises(ValueError, match="static activation scales"):
        fp8_format(cfg(static))
    with pytest.raises(ValueError, match="format 'pack-quantized'"):
        fp8_format(cfg({**base, "format": "pack-quantized"}))
