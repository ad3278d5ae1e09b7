"""Decoded images -> what a Qwen3.5 vision-language model takes: `pixel_values`, `image_grid_thw`, and the number
of placeholder tokens each image stands for in the prompt; and the prompt's placeholders expanded to that many.

Why transformers' processor rather than our own: the vision encoder was trained on its exact resizing (smart_resize:
each side a multiple of patch_size * merge_size, the area within [min_pixels, max_pixels], the aspect kept), its
normalisation and its patch layout (merge blocks of m x m patches, row-major; models/qwen3_5_vision.py relies on the
order). The checkpoint's preprocessor_config.json configures it. The class is `Qwen2VLImageProcessorPil`, the
Pillow/NumPy backend (transformers 5 maps qwen3_5 and qwen3_5_moe to it when torchvision is absent, and torchvision is
not a dependency here; under transformers 4 the slow `Qwen2VLImageProcessor` is that backend). Checkpoints name the
torchvision class (`Qwen2VLImageProcessorFast`), whose bicubic resize can differ from Pillow's in the last bits of some
pixels: pixel values may differ slightly from a torchvision setup, never the grids or token counts (smart_resize is
the same function).

The prompt side: the chat template writes `<|vision_start|><|image_pad|><|vision_end|>` per image; each `<|image_pad|>`
becomes t * h * w / merge^2 copies (the grid in patches, merge = spatial_merge_size), one per merged block the
encoder emits; models/mrope_positions.py reads the expanded prompt with the same grids.

Synchronous and CPU-bound (resizing, normalising): the routes run it on a worker thread.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from specserve.multimodal.image_inputs import ImageInput, ImageInputError

try:  # transformers 5: the Pillow/NumPy backend is its own class (Qwen2VLImageProcessor needs torchvision there)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as _HFProcessor
except ImportError:  # transformers 4: the slow class is the Pillow/NumPy one
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as _HFProcessor

MAX_ASPECT_RATIO = 200  # smart_resize refuses longer / shorter above this (ValueError): checked first for a clear 400
_PROCESSOR_TYPES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")


@dataclass(frozen=True)
class ProcessedImages:
    """One prompt's images, ready for the vision encoder."""

    pixel_values: torch.Tensor  # [N, C * Tp * P * P] float32: every image's patches, image after image
    image_grid_thw: torch.Tensor  # [num_images, 3] int64: (frames, patch rows, patch columns) of each image
    num_tokens: tuple[int, ...]  # placeholder tokens of each image: t * h * w / merge^2


class QwenImageProcessor:
    """The checkpoint's image processor (module docstring). `config`: its preprocessor_config.json as a dict, or a
    transformers image processor already built."""

    def __init__(self, config: Mapping | _HFProcessor):
        if isinstance(config, Mapping):
            kind = config.get("image_processor_type")
            if kind is not None and kind not in _PROCESSOR_TYPES:
                raise ValueError(f"image_processor_type {kind!r}: only Qwen2-VL's image processor (Qwen2-VL, "
                                 "Qwen2.5-VL, Qwen3-VL, Qwen3.5) is supported")
            config = _HFProcessor.from_dict(dict(config))
        self.hf = config
        self.merge_size = int(config.merge_size)  # = the vision config's spatial_merge_size
        self.patch_size = int(config.patch_size)
        self.temporal_patch_size = int(config.temporal_patch_size)

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike) -> QwenImageProcessor:
        """From a checkpoint folder: preprocessor_config.json, else processor_config.json's "image_processor"."""
        pre = os.path.join(path, "preprocessor_config.json")
        if os.path.isfile(pre):
            with open(pre) as f:
                return cls(json.load(f))
        proc = os.path.join(path, "processor_config.json")
        if os.path.isfile(proc):
            with open(proc) as f:
                sub = json.load(f).get("image_processor")
            if isinstance(sub, dict):
                return cls(sub)
        raise FileNotFoundError(f"{path}: no preprocessor_config.json (nor processor_config.json with an "
                                "image_processor) to configure the image processor from")

    def num_tokens_for(self, width: int, height: int) -> int:
        """The placeholder tokens an image of this size stands for, without processing it."""
        patches = self.hf.get_number_of_image_patches(height, width)  # grid_h * grid_w after smart_resize
        return patches // (self.merge_size ** 2)

    def __call__(self, images: Sequence[ImageInput | Image.Image]) -> ProcessedImages:
        """One prompt's images (decoded by image_inputs, in prompt order) -> ProcessedImages. 400 for an image whose
        aspect ratio the processor refuses."""
        pils = []
        for k, x in enumerate(images):
            img = x.image if isinstance(x, ImageInput) else x
            where = x.where if isinstance(x, ImageInput) else f"image {k}"
            w, h = img.size
            if max(w, h) > MAX_ASPECT_RATIO * min(w, h):
                raise ImageInputError(f"{where} is {w}x{h}: an aspect ratio above {MAX_ASPECT_RATIO}:1 is not "
                                      "supported",
                                  param=where)
            if img.mode != "RGB":
                raise ValueError(f"{where}: images must be RGB (image_inputs decodes them so), got {img.mode}")
            pils.append(img)
        if not pils:
            dim = 3 * self.temporal_patch_size * self.patch_size ** 2
            return ProcessedImages(torch.zeros(0, dim), torch.zeros(0, 3, dtype=torch.long), ())
        out = self.hf(pils, return_tensors="pt")
        pixel_values = out["pixel_values"].to(torch.float32)
        grid = out["image_grid_thw"].to(torch.long)
        m2 = self.merge_size ** 2
        counts = tuple(int(t * h * w) // m2 for t, h, w in grid.tolist())
        return ProcessedImages(pixel_values, grid, counts)


def expand_image_placeholders(token_ids: Sequence[int], image_token_id: int, num_tokens: Sequence[int],
                              param: str | None = None) -> list[int]:
    """A prompt with one `image_token_id` (<|image_pad|>) per image -> each replaced by that image's num_tokens
    copies, images in order. 400 when the prompt's placeholders and the images differ in number (a client that typed
    the placeholder into its text, or sent images the template did not place)."""
    where = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(where) != len(num_tokens):
        raise ImageInputError(f"the prompt has {len(where)} image placeholders but the request carries "
                              f"{len(num_tokens)} "
                          "images: each image needs exactly one", param=param)
    out: list[int] = []
    prev = 0
    for pos, n in zip(where, num_tokens):
        if n < 1:
            raise ValueError(f"an image must stand for at least one token, got {n}")
        out.extend(token_ids[prev:pos])
        out.extend([image_token_id] * n)
        prev = pos + 1
    out.extend(token_ids[prev:])
    return out
