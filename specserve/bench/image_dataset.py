"""The image dataset of `specserve bench` (SGLang bench_serving's `--dataset-name image`, same flags and defaults):
each request carries `--image-count` freshly generated images of `--image-resolution` (random noise or blank white,
encoded as `--image-format`, sent as base64 data URLs) and a random text of `--random-input-len` tokens, and asks
for `--random-output-len` tokens.

How each backend sends it (as SGLang's bench does): /generate gets the chat template applied to one user turn of
image parts and the text (so the prompt holds one image placeholder per image) plus `image_data`; the chat route gets
`image_url` parts before the text part and applies its own template. /v1/completions has no image field.

Counts: a request's prompt length is its templated text plus the image tokens the checkpoint's image processor gives
each image (when its preprocessor config is readable here); the count the server reports replaces it either way.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from specserve.bench.datasets import BenchRequest, uniform_lengths, usable_token_ids

RESOLUTION_PRESETS = {"4k": (3840, 2160), "1080p": (1920, 1080), "720p": (1280, 720), "360p": (640, 360)}  # (w, h)
IMAGE_FORMATS = ("jpeg", "png", "webp")
IMAGE_CONTENTS = ("random", "blank")


def parse_resolution(text: str) -> tuple[int, int]:
    """A preset (4k, 1080p, 720p, 360p) or "HEIGHTxWIDTH" (SGLang's order: "1080x1920" is 1920 wide) -> (width,
    height)."""
    t = text.strip().lower()
    if t in RESOLUTION_PRESETS:
        return RESOLUTION_PRESETS[t]
    parts = t.split("x")
    if len(parts) == 2 and all(p.isdigit() and int(p) > 0 for p in parts):
        return int(parts[1]), int(parts[0])
    raise ValueError(f"--image-resolution {text!r}: use one of {', '.join(RESOLUTION_PRESETS)} or HEIGHTxWIDTH "
                     "(e.g. 1080x1920)")


@dataclass(frozen=True)
class ImageSpec:
    count: int  # images per request
    width: int
    height: int
    fmt: str  # one of IMAGE_FORMATS
    content: str  # one of IMAGE_CONTENTS

    def __post_init__(self):
        if self.count < 1:
            raise ValueError(f"--image-count must be >= 1, got {self.count}")
        if self.fmt not in IMAGE_FORMATS:
            raise ValueError(f"--image-format must be one of {IMAGE_FORMATS}, got {self.fmt!r}")
        if self.content not in IMAGE_CONTENTS:
            raise ValueError(f"--image-content must be one of {IMAGE_CONTENTS}, got {self.content!r}")


def image_data_url(rng: np.random.Generator, spec: ImageSpec) -> str:
    """One generated image, encoded, as a data URL."""
    if spec.content == "blank":
        pixels = np.full((spec.height, spec.width, 3), 255, dtype=np.uint8)  # [h, w, 3]
    else:
        pixels = rng.integers(0, 256, size=(spec.height, spec.width, 3), dtype=np.uint8)  # [h, w, 3]
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=spec.fmt.upper(), quality=85)  # PNG ignores quality
    return f"data:image/{spec.fmt};base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def templated_prompt(tokenizer, text: str, num_images: int) -> str:
    """The chat template over one user turn of `num_images` image parts then `text`: what /generate is sent. The
    template must write an image placeholder per image (Qwen-VL templates write <|vision_start|><|image_pad|>...)."""
    parts = [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": text}]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                           add_generation_prompt=True)
    no_images = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": text}]}],
                                              tokenize=False, add_generation_prompt=True)
    if prompt == no_images:
        raise ValueError("the tokenizer's chat template writes nothing for image parts: it is not a "
                         "vision-language model's template (pass --tokenizer with the model's own)")
    return prompt


def image_requests(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                   spec: ImageSpec, seed: int, image_tokens: int | None = None) -> list[BenchRequest]:
    """`num_prompts` requests of `spec.count` new images each (no two requests share an image: the prefix cache
    gives nothing past the template's first tokens) and random text of lengths uniform in [input_len * range_ratio,
    input_len]. image_tokens: the placeholder tokens one image of this size expands to, when known (prompt_len then
    counts them; the server's count replaces ours anyway). The text never holds a special token (the image
    placeholders are special tokens), and a placeholder spelled out in text stays text on our server."""
    rng = np.random.default_rng(seed)
    in_lens = uniform_lengths(rng, num_prompts, input_len, range_ratio)  # [num_prompts]
    out_lens = uniform_lengths(rng, num_prompts, output_len, range_ratio)  # [num_prompts]
    vocab = usable_token_ids(tokenizer)
    reqs = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist(), strict=True):
        text = tokenizer.decode(rng.choice(vocab, size=n_in).tolist())
        urls = [image_data_url(rng, spec) for _ in range(spec.count)]
        prompt = templated_prompt(tokenizer, text, spec.count)
        n_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
        if image_tokens is not None:
            n_prompt += spec.count * (image_tokens - 1)  # each placeholder becomes the image's tokens
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
        reqs.append(BenchRequest(prompt=prompt, prompt_len=n_prompt, output_len=n_out,
                                 messages=[{"role": "user", "content": parts}], image_data=urls))
    return reqs
