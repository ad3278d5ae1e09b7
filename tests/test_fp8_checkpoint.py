"""FP8 block-scaled checkpoints (weights/fp8.py): the dequantization against a block-by-block reference, the
pairing of weights and scales as they stream, the config checks, and a tiny DeepSeek-V3 with its MTP layer saved
in FP8 that loads (target and draft) into exactly the parameters of the same checkpoint saved dequantized — which
the other tests hold to transformers; compressed-tensors channel / tensor checkpoints (a Llama, a Qwen3-MoE whose
routed experts stay FP8 with a scale per row) likewise, and the expert stack's per-channel loading piece by piece."""

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
from specserve.weights.fp8 import Fp8Format, Fp8Weight, dequantize, fp8_format, pair_stream

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


def _plain(tensors, fmt: Fp8Format) -> list[tuple[str, torch.Tensor]]:
    """pair_stream with each FP8 weight dequantized to float32: the checkpoint as a plain one."""
    return [(n, t.dequantize(torch.float32, None) if isinstance(t, Fp8Weight) else t)
            for n, t in pair_stream(tensors, fmt)]


def test_stream_pairs_weights_and_scales_in_any_order():
    fmt = Fp8Format((16, 16))
    w1, s1 = _quantize(torch.randn(20, 20), (16, 16))
    w2, s2 = _quantize(torch.randn(16, 32), (16, 16))
    plain = torch.randn(3)
    stream = [("a.weight", w1), ("b.weight_scale_inv", s2), ("norm.weight", plain), ("a.weight_scale_inv", s1),
              ("b.weight", w2)]
    out = dict(_plain(stream, fmt))
    assert set(out) == {"a.weight", "b.weight", "norm.weight"}
    assert torch.equal(out["a.weight"], dequantize(w1, s1, fmt))
    assert torch.equal(out["b.weight"], dequantize(w2, s2, fmt))
    assert out["norm.weight"] is plain
    with pytest.raises(ValueError, match="without their scale"):
        _plain([("a.weight", w1)], fmt)
    with pytest.raises(ValueError, match="without their"):
        _plain([("a.weight_scale_inv", s1)], fmt)


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


def _quantize_rows(w: torch.Tensor, per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] -> (float8 [O, I], scale [O, 1]): compressed-tensors' per-channel layout; per_tensor: its tensor
    strategy, scale [1]."""
    amax = w.abs().amax().reshape(1) if per_tensor else w.abs().amax(dim=1, keepdim=True)  # [1] or [O, 1]
    s = amax.clamp_min(1e-12) / torch.finfo(FP8).max
    return (w / s).to(FP8), s


COMPRESSED_TENSORS_FP8 = {  # llm-compressor's FP8_DYNAMIC scheme: per-channel weights, per-token dynamic inputs
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {"targets": ["Linear"],
                                  "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                              "dynamic": False, "symmetric": True},
                                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                        "dynamic": True, "symmetric": True}}}}


def _compressed_tensors_config(per_tensor: bool) -> dict:
    """COMPRESSED_TENSORS_FP8, or with per_tensor the same with the weights' tensor strategy."""
    config = json.loads(json.dumps(COMPRESSED_TENSORS_FP8))
    if per_tensor:
        config["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    return config


def _fp8_copies(src: str, root: str, block: tuple[int, int] | None, plain: tuple[str, ...] = (),
                per_tensor: bool = False) -> tuple[str, str]:
    """The checkpoint at src twice: its projection and expert weights in FP8 with block scales (and the config's
    quantization_config; block None: compressed-tensors' per-channel `weight_scale`, or with per_tensor its tensor
    strategy, one scale a weight), those whose name holds one of `plain` left as they are, and the same FP8 values
    dequantized into a plain checkpoint."""
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
                    q, s = _quantize_rows(t.float(), per_tensor)
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
    c["quantization_config"] = (_compressed_tensors_config(per_tensor) if block is None else
                                {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": list(block)})
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(c, f)
    return fp8_dir, ref_dir


def plain_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """model's state dict with every FP8 weight dequantized (float32) and its scales dropped: what it computes
    with, comparable to a plain checkpoint's parameters."""
    from specserve.kernels.reference_fp8 import dequantize_weight
    from specserve.kernels.reference_moe_fp8 import dequantize_experts
    from specserve.layers.linear import Linear
    from specserve.layers.moe import FusedMoE

    sd = dict(model.state_dict())
    for name, m in model.named_modules():
        p = f"{name}." if name else ""
        if isinstance(m, Linear) and m.is_fp8:
            sd[p + "weight"] = dequantize_weight(m.weight, m.weight_scale, m.fp8_block)
            del sd[p + "weight_scale"]
        elif isinstance(m, FusedMoE) and m.is_fp8:
            sd[p + "w13"] = dequantize_experts(m.w13, m.w13_scale, m.fp8_block)
            sd[p + "w2"] = dequantize_experts(m.w2, m.w2_scale, m.fp8_block)
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


@pytest.mark.parametrize("family,per_tensor", [("llama", False), ("qwen3_moe", False), ("qwen3_moe", True)])
def test_compressed_tensors_per_channel_checkpoint_loads_in_fp8(tmp_path, family, per_tensor):
    """llm-compressor's FP8_DYNAMIC layout (`weight_scale` [O, 1], quant_method compressed-tensors) and its tensor
    strategy (`weight_scale` [1]): the linear layers keep FP8 with a scale per row, the MTP layer too, and so do
    the routed experts (float8 w13 / w2, a scale per row: a tensor's scale on each of its rows, gate and up their
    own); what every layer holds equals the plain copy."""
    from helpers import build_tiny_model

    src = build_tiny_model(str(tmp_path / "m"), family, seed=3, mtp_layout="deepseek")
    fp8_dir, ref_dir = _fp8_copies(src, str(tmp_path), None, per_tensor=per_tensor)
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
        assert linears >= 2 and experts == (family == "qwen3_moe") * len(_moe_layers(a_model))
    layer = dict(got.model.named_modules())["model.layers.0.self_attn.qkv_proj"]
    assert layer.is_fp8 and layer.fp8_block is None and layer.weight_scale.shape == (layer.weight.shape[0],)
    if family == "qwen3_moe":
        _check_fp8_experts_compute_as_dequantized(got.model, want.model, per_tensor)


def _moe_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from specserve.layers.moe import SparseMoEBlock

    return {n: m for n, m in model.named_modules() if isinstance(m, SparseMoEBlock)}


def _check_fp8_experts_compute_as_dequantized(fp8_model: torch.nn.Module, plain_model: torch.nn.Module,
                                              per_tensor: bool) -> None:
    """Each MoE block of the FP8 model keeps per-channel FP8 experts (float8 w13 [E, 2I, H] with w13_scale [E, 2I],
    w2 with [E, H]; per_tensor: one value over each projection's rows) and its output on random x is the plain
    copy's within 0.10 relative error by norm: the two differ by the activations' per-token e4m3 rounding (x and
    the act, 3 mantissa bits each; measured 0.041-0.050 here, float32 model)."""
    plain_blocks = _moe_layers(plain_model)
    g = torch.Generator().manual_seed(0)
    for name, block in _moe_layers(fp8_model).items():
        experts = block.experts
        e, i, h = experts.num_experts, experts.intermediate_size, experts.hidden_size
        assert experts.w13.dtype == FP8 and experts.w2.dtype == FP8 and experts.fp8_per_channel
        assert experts.w13_scale.shape == (e, 2 * i) and experts.w2_scale.shape == (e, h)
        if per_tensor:  # one scale per projection: gate rows, up rows, down rows each constant
            for part in (experts.w13_scale[:, :i], experts.w13_scale[:, i:], experts.w2_scale):
                assert torch.equal(part, part[:, :1].expand_as(part))
        x = torch.randn((5, h), generator=g)
        got, want = block(x), plain_blocks[name](x)
        err = ((got - want).norm() / want.norm()).item()
        assert err < 0.10, f"{name}: relative error {err:.3f}"


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


def test_per_channel_experts_made_fp8_on_meta_and_loaded_in_fp8():
    """The loader's path for per-channel / per-tensor FP8 experts, piece by piece: convert_fp8_holders makes a MoE
    block's expert stack (a fused gated shared expert as expert E included) FP8 on the meta device, so the stack is
    never allocated in the model dtype; each checkpoint piece (paired by weights/fp8.py: a per-tensor scale becomes
    one per row) is kept in FP8, gate and up of an expert with their own per-tensor scales; the stack dequantizes
    to the pieces' values exactly, also after to_plain; a tensor-parallel stack keeps its slice in FP8 where the
    blocks fit it."""
    from torch import nn

    from specserve.distributed.tp import TPGroup
    from specserve.kernels.reference_moe_fp8 import dequantize_experts
    from specserve.layers.moe import FusedMoE, SparseMoEBlock
    from specserve.models.tensor_loading import convert_fp8_holders, load_fp8_weight
    from specserve.weights.fp8 import paired

    h, i, e = 32, 16, 4
    with torch.device("meta"):
        block = SparseMoEBlock(h, i, e, 2, renormalize=True, shared_expert_intermediate_size=i,
                               shared_expert_gated=True)
    assert block.fused_shared
    root = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"mlp": block})])})
    projs = ("gate_proj", "up_proj", "down_proj")
    names = ([f"layers.0.mlp.experts.{j}.{p}.weight" for j in range(e) for p in projs]
             + [f"layers.0.mlp.shared_expert.{p}.weight" for p in projs])
    assert convert_fp8_holders(root, names, None) == 1
    experts = block.experts
    assert experts.w13.is_meta and experts.w13.dtype == FP8 and experts.w2.dtype == FP8 and experts.fp8_per_channel
    assert experts.w13_scale.shape == (e + 1, 2 * i) and experts.w2_scale.shape == (e + 1, h)
    root.to_empty(device="cpu")
    g = torch.Generator().manual_seed(2)
    fmt = Fp8Format(None, "_scale")
    want13, want2 = torch.empty((e + 1, 2 * i, h)), torch.empty((e + 1, h, i))
    for name in names:
        parts = name.split(".")
        j = e if parts[3] == "shared_expert" else int(parts[4])
        proj = parts[-2]
        w = torch.randn((h, i) if proj == "down_proj" else (i, h), generator=g) * (1 + j + projs.index(proj))
        fw = paired(*_quantize_rows(w, per_tensor=True), fmt)
        assert load_fp8_weight(root, name, fw) == name
        target = want2[j] if proj == "down_proj" else want13[j, :i] if proj == "gate_proj" else want13[j, i:]
        target.copy_(fw.dequantize(torch.float32))
    assert experts.loaded_param_names() == {"w13", "w2"}
    assert experts.w13_scale[0, 0] != experts.w13_scale[0, i]  # gate and up: their own per-tensor scales
    assert torch.equal(dequantize_experts(experts.w13, experts.w13_scale, None), want13)
    assert torch.equal(dequantize_experts(experts.w2, experts.w2_scale, None), want2)
    experts.to_plain()
    assert experts.w13.dtype == torch.float32 and not hasattr(experts, "w13_scale")
    assert torch.equal(experts.w13, want13) and torch.equal(experts.w2, want2)
    # an intermediate slice per rank: per-channel always kept in FP8; blocks only where the slice is on them
    assert FusedMoE(e, h, i, TPGroup(1, 2)).accepts_fp8(None)
    assert FusedMoE(e, h, 32, TPGroup(1, 2)).accepts_fp8((16, 16))
    assert not FusedMoE(e, h, 32, TPGroup(1, 2)).accepts_fp8((32, 16))
    assert experts.quantize_fp8(None) and experts.fp8_per_channel  # online FP8 may ask for per-row scales too
    back = dequantize_experts(experts.w13, experts.w13_scale, None)  # [E, 2I, H]
    assert ((back - want13).abs() <= want13.abs().amax(-1, keepdim=True) / 16).all()  # e4m3: within 1/16 of amax
