"""mRoPE positions of a Qwen3.5 vision-language prompt: 3 rows (time, height, width) per token, and the delta that
places the tokens generated after it.

Why: the language model's rotary turns some frequency bands with row 0, some with row 1, some with row 2 (mRoPE), so
an image's tokens carry their place in the image, while text tokens carry equal rows. A prompt's positions are then
no longer its token indices; generated tokens (text) continue at `seq_len + mrope_delta` on all rows (the engine's
Request.mrope_delta). The semantics are transformers' `Qwen3_5Model.get_rope_index` (Qwen3.5-MoE's is the same):
  * text runs count up from the running position `p`, equal on the 3 rows;
  * an image with grid (t, h, w) in patches has t * (h / m) * (w / m) placeholder tokens (m = spatial_merge_size),
    in raster order over (frame, merged row, merged column); its token at (i, j, k) sits at (p + i, p + j, p + k);
  * after the image, `p` advances by max(h, w) / m, not by its token count nor by t, so the text after an image
    starts at (its start + the longer merged side), on all 3 rows;
  * delta = max position + 1 - number of tokens (0 for a text-only prompt, whose 3 rows are 0..T-1).

Image tokens are recognised by their id (transformers reads the processor's `mm_token_type_ids`, which is 1 exactly
where input_ids == image_token_id); the vision start / end tokens around them are text. Consecutive images with no
text between their placeholders are split by their grids' token counts. Videos are left out: a prompt with the
video placeholder token is refused (NotImplementedError); transformers splits each video into one grid per frame.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def image_grids(image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None) -> list[tuple[int, int, int]]:
    """image_grid_thw [num_images, 3] (tensor or nested lists; None: no image) -> [(t, h, w), ...]."""
    if image_grid_thw is None:
        return []
    rows = image_grid_thw.tolist() if isinstance(image_grid_thw, torch.Tensor) else image_grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def mrope_positions(input_ids: torch.Tensor | Sequence[int],
                    image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None,
                    spatial_merge_size: int, image_token_id: int,
                    video_token_id: int | None = None) -> tuple[torch.Tensor, int]:
    """One prompt's mRoPE positions [3, T] int64 and its mrope_delta (module docstring).

    input_ids [T]: the prompt with each image's placeholder tokens already expanded (t * h * w / m^2 of them, as the
    processor writes them); image_grid_thw: the images' grids in prompt order. ValueError when the placeholders and
    the grids do not match."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)  # [T]
    n = ids.numel()
    grids = image_grids(image_grid_thw)
    m = spatial_merge_size
    if video_token_id is not None and bool((ids == video_token_id).any()):
        raise NotImplementedError("video placeholders: mRoPE positions of videos are not implemented")
    if any(h % m or w % m for _, h, w in grids):
        raise ValueError(f"image grids {grids}: h and w must be multiples of spatial_merge_size={m}")

    # runs of image placeholders: [start, end) token ranges
    edges = torch.diff((ids == image_token_id).to(torch.int8), prepend=ids.new_zeros(1, dtype=torch.int8),
                       append=ids.new_zeros(1, dtype=torch.int8))
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()

    positions = torch.empty(3, n, dtype=torch.long)
    pos = 0  # the running position: where the next text token goes
    cursor = 0  # the next token index to place
    images = iter(enumerate(grids))
    for start, end in zip(starts + [n], ends + [n]):
        positions[:, cursor:start] = torch.arange(pos, pos + start - cursor)  # text: equal rows
        pos += start - cursor
        cursor = start
        while cursor < end:  # one or more images back to back
            index, (t, h, w) = next(images, (None, (0, 0, 0)))
            if index is None:
                raise ValueError(f"the prompt has more image placeholder tokens than its {len(grids)} image grid(s) "
                                 "cover")
            gh, gw = h // m, w // m
            count = t * gh * gw
            if cursor + count > end:
                raise ValueError(f"image {index} (grid {(t, h, w)}) needs {count} placeholder tokens, the prompt has "
                                 f"{end - cursor} at token {cursor}")
            positions[0, cursor:cursor + count] = (torch.arange(t) + pos).repeat_interleave(gh * gw)
            positions[1, cursor:cursor + count] = (torch.arange(gh) + pos).repeat_interleave(gw).repeat(t)
            positions[2, cursor:cursor + count] = (torch.arange(gw) + pos).repeat(t * gh)
            pos += max(gh, gw)
            cursor += count
    left = sum(1 for _ in images)
    if left:
        raise ValueError(f"{left} of {len(grids)} image grid(s) have no placeholder tokens in the prompt")
    delta = int(positions.max()) + 1 - n if n else 0
    return positions, delta
