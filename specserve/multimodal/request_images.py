"""One request's images as the engine carries them (`RequestImages`, on `Req.images`), and how a prompt with
`<|image_pad|>` placeholders and its images become one (`prepare_request_images`).

The engine (engine/engine.py make_request) decodes the caller's images (image_inputs.py), preprocesses them with the
checkpoint's processor (image_processing.py), expands each placeholder to the image's token count, and computes the
prompt's mRoPE positions [3, prompt_len] and delta (models/mrope_positions.py). The prefill (engine/steps.py) feeds
the chunk's slice of those positions and the token embeddings with the placeholder rows replaced by the encoder's
rows (`image_rows`); the encoder runs once per request and its output stays here (`embeds`), so chunked prefill and a
retraction's re-prefill reuse it.

Prefix cache: the placeholder ids of an image are the same token whatever the picture, so the cache key of a request
with images replaces each image's placeholders by an id derived from the image's pixel hash, outside the vocabulary
(`cache_key`): the same picture at the same place hits, a different one never shares its pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from specserve.models.mrope_positions import mrope_positions
from specserve.multimodal.image_inputs import (
    ImageInput,
    ImageInputError,
    ImageLimits,
    ImageRef,
    check_image_count,
    load_image,
    pixel_hash,
)
from specserve.multimodal.image_processing import QwenImageProcessor, expand_image_placeholders

_KEY_SPACE = 1 << 40  # image key ids: vocab_size + (hash mod this): never a token id, distinct per picture in practice


@dataclass(eq=False)
class RequestImages:
    """The images of one request, ready for its prefill."""

    pixel_values: torch.Tensor  # [N, patch_dim] float32: every image's patches (the processor's), image after image
    grid_thw: torch.Tensor  # [num_images, 3] int64
    hashes: tuple[str, ...]  # each image's pixel hash (image_inputs.pixel_hash)
    positions: torch.Tensor  # [3, prompt_len] int64 mRoPE positions of the expanded prompt (CPU)
    placeholders: torch.Tensor  # [num_image_tokens] int64: the prompt index of each image token, in order (CPU)
    num_tokens: tuple[int, ...]  # image tokens of each image
    key_ids: tuple[int, ...]  # each image's id in the prefix cache's key (outside the vocabulary)
    embeds: torch.Tensor | None = field(default=None, repr=False)  # [num_image_tokens, H]: the encoder's, once run

    def release(self) -> None:
        """Drop the pixels and the encoder's rows (the request finished: it is never prefilled again)."""
        self.pixel_values = self.pixel_values[:0]
        self.embeds = None

    @property
    def prompt_len(self) -> int:
        return self.positions.shape[1]

    def chunk_rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The image tokens inside sequence indices [start, end): (their indices minus start [k], their rows of
        `embeds` [k]), both int64 on the CPU."""
        lo = int(torch.searchsorted(self.placeholders, start))
        hi = int(torch.searchsorted(self.placeholders, end))
        return self.placeholders[lo:hi] - start, torch.arange(lo, hi, dtype=torch.int64)

    def chunk_positions(self, start: int, end: int, delta: int) -> torch.Tensor:
        """mRoPE positions [3, end - start] of sequence indices [start, end): the prompt's rows, then (outputs
        re-prefilled after a retraction) text at index + delta on all three rows."""
        n = self.prompt_len
        parts = []
        if start < n:
            parts.append(self.positions[:, start:min(end, n)])
        if end > n:
            tail = torch.arange(max(start, n), end, dtype=torch.int64) + delta
            parts.append(tail[None].expand(3, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def cache_key(self, fill_ids: Sequence[int]) -> list[int]:
        """fill_ids with each image's tokens replaced by that image's key id (module docstring)."""
        key = list(fill_ids)
        start = 0
        for n, kid in zip(self.num_tokens, self.key_ids):
            for i in self.placeholders[start:start + n].tolist():
                key[i] = kid
            start += n
        return key


def image_from_pil(img: Image.Image, where: str) -> ImageInput:
    """A caller's PIL image -> ImageInput (RGB as image_inputs decodes them: transparency onto white)."""
    from specserve.multimodal.image_inputs import _to_rgb

    try:
        img.load()
        rgb = _to_rgb(img)
    except Exception:
        raise ImageInputError(f"{where} could not be converted to RGB", param=where) from None
    return ImageInput(image=rgb, width=rgb.width, height=rgb.height, hash=pixel_hash(rgb), format=img.format or "PIL",
                      where=where)


def load_request_images(images: Sequence[Any], limits: ImageLimits, where: str = "image_data") -> list[ImageInput]:
    """The caller's images (PIL images, data URLs, base64 or local paths, image_inputs.load_image) -> decoded."""
    check_image_count(len(images), limits, param=where)
    out = []
    for k, x in enumerate(images):
        here = f"{where}[{k}]"
        if isinstance(x, ImageInput):
            out.append(x)
        elif isinstance(x, Image.Image):
            out.append(image_from_pil(x, here))
        elif isinstance(x, str):
            out.append(load_image(ImageRef(x, here), limits))
        else:
            raise ImageInputError(f"{here} must be a PIL image or a string (a data URL, base64 or a local file path), "
                                  f"got {type(x).__name__}", param=here)
    return out


def prepare_request_images(input_ids: Sequence[int], images: Sequence[ImageInput], processor: QwenImageProcessor,
                           image_token_id: int, vocab_size: int) -> tuple[list[int], RequestImages, int]:
    """A prompt with one image_token_id per image and its decoded images -> (the expanded prompt, its
    RequestImages, its mrope_delta). ImageInputError when the placeholders and the images differ in number."""
    pre = preprocess_images(images, processor)
    ids = expand_image_placeholders(list(input_ids), image_token_id, pre.num_tokens, param="image_data")
    images_, delta = request_images_from(ids, pre, image_token_id, vocab_size)
    return ids, images_, delta


@dataclass(frozen=True, eq=False)
class PreprocessedImages:
    """A prompt's images decoded and preprocessed, as the HTTP process hands them to the engine process (plain data,
    no tensors, so the pipe pickles bytes): the prompt that goes with them is already expanded."""

    pixel_values: np.ndarray  # [N, patch_dim] float32: every image's patches, image after image
    grid_thw: tuple[tuple[int, int, int], ...]  # each image's (t, h, w) in patches
    num_tokens: tuple[int, ...]  # image tokens of each image (t * h * w / merge^2)
    hashes: tuple[str, ...]  # each image's pixel hash
    merge_size: int

    def __len__(self) -> int:
        return len(self.hashes)


def preprocess_images(images: Sequence[ImageInput], processor: QwenImageProcessor) -> PreprocessedImages:
    """Decoded images -> PreprocessedImages (the processor's pixels and grids, the images' hashes)."""
    processed = processor(images)
    grid = tuple(tuple(int(v) for v in row) for row in processed.image_grid_thw.tolist())
    return PreprocessedImages(processed.pixel_values.numpy().astype(np.float32, copy=False), grid,
                              tuple(processed.num_tokens), tuple(x.hash for x in images), processor.merge_size)


def request_images_from(expanded_ids: Sequence[int], pre: PreprocessedImages, image_token_id: int,
                        vocab_size: int) -> tuple[RequestImages, int]:
    """An expanded prompt and its PreprocessedImages -> (RequestImages, mrope_delta). ImageInputError when the
    prompt's image tokens are not the images' (a run of num_tokens placeholders per image, in order), or the pixels
    do not fit the grids."""
    ids = torch.tensor(list(expanded_ids), dtype=torch.int64)
    placeholders = (ids == image_token_id).nonzero().flatten()
    n_img = len(pre.hashes)
    if len(pre.grid_thw) != n_img or len(pre.num_tokens) != n_img:
        raise ImageInputError("the request's images are inconsistent (grids, token counts and hashes differ in "
                              "number)", param="image_data")
    m2 = pre.merge_size ** 2
    if any(t * h * w != n * m2 for (t, h, w), n in zip(pre.grid_thw, pre.num_tokens)):
        raise ImageInputError("the request's images are inconsistent (a token count is not its grid's)",
                              param="image_data")
    if pre.pixel_values.ndim != 2 or pre.pixel_values.shape[0] != sum(t * h * w for t, h, w in pre.grid_thw):
        raise ImageInputError("the request's image pixels do not fit their grids", param="image_data")
    if len(placeholders) != sum(pre.num_tokens):
        raise ImageInputError(f"the prompt has {len(placeholders)} image tokens but its {n_img} images stand for "
                              f"{sum(pre.num_tokens)}", param="image_data")
    # each image's tokens must be one contiguous run (the expansion writes them so; a run split by text is forged)
    start = 0
    for n in pre.num_tokens:
        run = placeholders[start:start + n]
        if n and int(run[-1] - run[0]) != n - 1:
            raise ImageInputError("the prompt's image tokens do not form one run per image", param="image_data")
        start += n
    grid = torch.tensor(pre.grid_thw, dtype=torch.int64).reshape(-1, 3)
    positions, delta = mrope_positions(ids.tolist(), grid, pre.merge_size, image_token_id)
    key_ids = tuple(vocab_size + int(h[:16], 16) % _KEY_SPACE for h in pre.hashes)
    return RequestImages(torch.from_numpy(np.ascontiguousarray(pre.pixel_values, dtype=np.float32)), grid,
                         pre.hashes, positions, placeholders, pre.num_tokens, key_ids), delta
