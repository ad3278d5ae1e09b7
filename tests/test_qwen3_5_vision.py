"""The Qwen3.5 vision encoder (specserve/models/qwen3_5_vision.py) and the prompt's mRoPE positions
(specserve/models/mrope_positions.py) against transformers on tiny random configs (CPU, float32):
- the encoder loaded from a safetensors checkpoint of transformers' Qwen3_5VisionModel (names `model.visual.*`, read
  back through specserve's safetensors reader, a language-model tensor beside them skipped) == transformers' output
  for 1 image, 2 images of different grids, and a 2-frame grid (attention per frame); its output for 2 images ==
  each image encoded alone (no attention across images); a small weight perturbation is seen (the comparison
  resolves it); pixel values and grids from transformers' PIL image processor on random PIL images;
- loading: the `visual.*` prefix, a missing tensor, a conv weight of the wrong shape; the config read from a
  transformers config and from its config.json dict (Qwen3.5 and Qwen3.5-MoE) alike;
- mRoPE positions and delta == transformers' get_rope_index for text, image, text, image of another grid, text;
  for a prompt ending on an image and for images back to back; text-only (3 equal rows, delta 0); placeholder /
  grid mismatches refused.
"""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from specserve.models.mrope_positions import mrope_positions
from specserve.models.qwen3_5_vision import Qwen3_5VisionConfig, Qwen3_5VisionEncoder, merged_token_counts
from specserve.weights.safetensors_loader import iter_safetensors

pytestmark = pytest.mark.usefixtures("one_thread")

# tiny: head_dim 16 (4 rotary pairs per axis), a 4 x 4 learned position table (grids resample up and down)
VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, in_channels=3, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=40, num_position_embeddings=16)
IMAGE, VIDEO, VSTART, VEND = 90, 91, 92, 93  # small ids: the tiny vocabulary holds them
ATOL, RTOL = 2e-5, 1e-5


def _hf_vision_config():
    from transformers import Qwen3_5VisionConfig as HFVisionConfig

    return HFVisionConfig(**VISION)


def _hf_config(moe: bool = False):
    if moe:
        from transformers import Qwen3_5MoeConfig as Config
        text = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    else:
        from transformers import Qwen3_5Config as Config
        text = dict(intermediate_size=64)
    text.update(vocab_size=128, hidden_size=VISION["out_hidden_size"], num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])
    return Config(text_config=text, vision_config=dict(VISION), image_token_id=IMAGE, video_token_id=VIDEO,
                  vision_start_token_id=VSTART, vision_end_token_id=VEND)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' Qwen3_5VisionModel, ours loaded from its checkpoint file) with the same random weights."""
    from transformers import Qwen3_5VisionModel

    torch.manual_seed(0)
    hf = Qwen3_5VisionModel(_hf_vision_config()).eval()
    with torch.no_grad():  # the init leaves biases at 0 and LayerNorms at 1: randomise all to test every tensor
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("qwen3_5_vision") / "model.safetensors"
    tensors = {f"model.visual.{k}": v.contiguous() for k, v in hf.state_dict().items()}
    tensors["model.language_model.embed_tokens.weight"] = torch.zeros(4, 4)  # not the encoder's: skipped
    save_file(tensors, str(path))
    ours = Qwen3_5VisionEncoder(Qwen3_5VisionConfig.from_hf(_hf_config())).eval()
    loaded = ours.load_weights(iter_safetensors(str(path.parent)))
    assert loaded == set(dict(ours.named_parameters()))
    return hf, ours


def _pixels(grid_thw: list[list[int]], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = sum(t * h * w for t, h, w in grid_thw)
    return torch.randn(n, 3 * 2 * 4 * 4, generator=g)  # [N, C * Tp * P * P]


def _both(pair, pixels: torch.Tensor, grid_thw) -> tuple[torch.Tensor, torch.Tensor]:
    hf, ours = pair
    grid = torch.as_tensor(grid_thw)
    with torch.no_grad():
        return ours(pixels, grid), hf(pixels, grid_thw=grid).pooler_output


@pytest.mark.parametrize("grid_thw", [[[1, 4, 6]], [[1, 6, 4], [1, 2, 8]], [[2, 4, 4]], [[1, 8, 2], [2, 2, 2]]],
                         ids=["one-image", "two-images", "two-frames", "image-and-two-frames"])
def test_encoder_matches_transformers(pair, grid_thw):
    pixels = _pixels(grid_thw, seed=len(grid_thw))
    ours, ref = _both(pair, pixels, grid_thw)
    assert ours.shape == ref.shape == (sum(merged_token_counts(grid_thw, 2)), VISION["out_hidden_size"])
    assert ref.abs().mean() > 0.1  # a real signal, not near-zero outputs that any code would match
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)


def test_images_are_encoded_independently(pair):
    """Two images together == each alone, concatenated: attention never crosses images."""
    grids = [[1, 6, 4], [1, 2, 8]]
    pixels = _pixels(grids, seed=5)
    _, ours = pair
    with torch.no_grad():
        both = ours(pixels, grids)
        first, second = ours(pixels[:24], grids[:1]), ours(pixels[24:], grids[1:])
    torch.testing.assert_close(both, torch.cat([first, second]), atol=1e-6, rtol=1e-6)


def test_a_small_weight_change_is_seen(pair):
    """The comparison resolves a 1e-3 change of one position-table entry: the tolerance is not too loose to fail."""
    hf, ours = pair
    grids = [[1, 4, 6]]
    pixels = _pixels(grids, seed=7)
    with torch.no_grad():
        ours.pos_embed.weight[5, 3] += 1e-3
        try:
            mine, ref = _both(pair, pixels, grids)
        finally:
            ours.pos_embed.weight[5, 3] -= 1e-3
    assert not torch.allclose(mine, ref, atol=ATOL, rtol=RTOL)


def test_encoder_on_processor_output(pair):
    """Random PIL images through transformers' PIL image processor (the Qwen3.5 mapping's `pil` class; the default
    class needs torchvision) -> pixel_values and grids -> ours == transformers."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                    size={"shortest_edge": 8 * 8, "longest_edge": 48 * 48},
                                    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 256, (hh, ww, 3), dtype=np.uint8)) for hh, ww in ((21, 30), (40, 17))]
    out = proc(images=images, return_tensors="pt")
    pixels, grid = out["pixel_values"], out["image_grid_thw"]
    assert grid.tolist() == [[1, 6, 8], [1, 10, 4]]  # rounded to multiples of patch * merge = 8 pixels
    assert pixels.shape == (6 * 8 + 10 * 4, 3 * 2 * 4 * 4)
    ours, ref = _both(pair, pixels, grid)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)


def test_loading_prefixes_and_errors(pair):
    hf, _ = pair
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    cfg = Qwen3_5VisionConfig.from_hf(_hf_config())

    enc = Qwen3_5VisionEncoder(cfg)
    enc.load_weights((f"visual.{k}", v) for k, v in state.items())  # the other layout's prefix
    assert torch.equal(enc.blocks[1].attn.qkv.bias, state["blocks.1.attn.qkv.bias"])
    assert torch.equal(enc.patch_embed.proj.weight, state["patch_embed.proj.weight"].reshape(32, -1))

    with pytest.raises(ValueError, match="lacks 1 vision tensor"):
        Qwen3_5VisionEncoder(cfg).load_weights((f"model.visual.{k}", v) for k, v in state.items()
                                               if k != "merger.norm.bias")
    with pytest.raises(ValueError, match="Conv3d weight"):
        Qwen3_5VisionEncoder(cfg).load_tensor("model.visual.patch_embed.proj.weight", torch.zeros(32, 96))
    with pytest.raises(ValueError, match="no parameter"):
        Qwen3_5VisionEncoder(cfg).load_tensor("model.visual.deepstack_merger_list.0.norm.weight", torch.zeros(32))
    assert Qwen3_5VisionEncoder(cfg).load_tensor("model.language_model.norm.weight", torch.zeros(40)) is None


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_config_from_transformers_config_and_dict(moe):
    hf = _hf_config(moe)
    cfg = Qwen3_5VisionConfig.from_hf(hf)
    assert cfg == Qwen3_5VisionConfig.from_hf(hf.to_dict())
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.patch_size, cfg.out_hidden_size) == (2, 32, 2, 4, 40)
    assert (cfg.hidden_act, cfg.rope_theta, cfg.patch_dim) == ("gelu_pytorch_tanh", 10000.0, 96)
    with pytest.raises(ValueError, match="deepstack"):
        Qwen3_5VisionConfig.from_hf({"vision_config": {**VISION, "deepstack_visual_indexes": [1]}})
    with pytest.raises(ValueError, match="vision_config"):
        Qwen3_5VisionConfig.from_hf(hf.text_config)


# ---- mRoPE positions ----


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Qwen3_5Model

    torch.manual_seed(0)
    return Qwen3_5Model(_hf_config()).eval()


def _prompt(*parts) -> list[int]:
    """parts: an int n -> n text tokens; a grid (t, h, w) -> vision start, its placeholders, vision end."""
    ids, text = [], 1
    for part in parts:
        if isinstance(part, int):
            ids += list(range(text, text + part))
            text += part
        else:
            ids += [VSTART] + [IMAGE] * merged_token_counts([part], 2)[0] + [VEND]
    return ids


def _check_positions(hf_model, ids: list[int], grids: list[list[int]] | None):
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        ref_pos, ref_delta = hf_model.get_rope_index(
            input_ids, mm_token_type_ids=(input_ids == IMAGE).int(),
            image_grid_thw=torch.tensor(grids) if grids else None)
    pos, delta = mrope_positions(ids, grids, spatial_merge_size=2, image_token_id=IMAGE, video_token_id=VIDEO)
    assert pos.dtype == torch.long and pos.shape == (3, len(ids))
    assert torch.equal(pos, ref_pos[:, 0])
    assert delta == int(ref_delta)
    return pos, delta


def test_positions_text_two_images_text(hf_model):
    grids = [[1, 4, 6], [1, 10, 2]]  # merged grids 2 x 3 and 5 x 1: rows and columns each the longer side once
    ids = _prompt(3, grids[0], 2, grids[1], 4)
    pos, delta = _check_positions(hf_model, ids, grids)
    assert delta < 0  # an image advances the position by its longer merged side, less than its token count
    assert not torch.equal(pos[0], pos[1])


@pytest.mark.parametrize("parts", [(5, (1, 8, 4)), ((1, 2, 2), 3), (2, (1, 4, 4), (1, 6, 2), 1), ((2, 4, 4), 2)],
                         ids=["ends-on-image", "starts-on-image", "images-back-to-back", "two-frame-grid"])
def test_positions_other_layouts(hf_model, parts):
    grids = [list(p) for p in parts if not isinstance(p, int)]
    _check_positions(hf_model, _prompt(*parts), grids)


def test_positions_text_only(hf_model):
    ids = _prompt(9)
    pos, delta = mrope_positions(ids, None, spatial_merge_size=2, image_token_id=IMAGE)
    assert delta == 0
    assert torch.equal(pos, torch.arange(9).expand(3, 9))
    _check_positions(hf_model, ids, None)


def test_positions_mismatches_are_refused():
    ids = _prompt(2, (1, 4, 4), 2)
    with pytest.raises(ValueError, match="more image placeholder"):
        mrope_positions(ids, None, 2, IMAGE)
    with pytest.raises(ValueError, match="needs 16 placeholder"):
        mrope_positions(ids, [[1, 8, 8]], 2, IMAGE)
    with pytest.raises(ValueError, match="no placeholder"):
        mrope_positions(ids, [[1, 4, 4], [1, 2, 2]], 2, IMAGE)
    with pytest.raises(NotImplementedError):
        mrope_positions(ids + [VIDEO], [[1, 4, 4]], 2, IMAGE, video_token_id=VIDEO)
