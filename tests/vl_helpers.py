"""A tiny random Qwen3.5 vision-language checkpoint (vision tower, MTP layer, Qwen3.5-style preprocessor config) and
the images the VL tests feed it, and a tokenizer with Qwen's vision tokens and an image-aware chat template; shared by
tests/test_vl_engine.py, tests/test_server_images.py and tests/test_bench_image.py."""

from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
from hybrid_helpers import build_tiny_hybrid
from PIL import Image

IMAGE, VIDEO, VSTART, VEND = 200, 201, 202, 203  # inside the tiny vocabulary (256)
VISION_TOKENS = {IMAGE: "<|image_pad|>", VIDEO: "<|video_pad|>", VSTART: "<|vision_start|>", VEND: "<|vision_end|>"}
# Qwen3.5's rule for content parts: an image part becomes the vision markers around one placeholder
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for c in m['content'] %}{% if c['type'] == 'image' or 'image' in c or 'image_url' in c %}"
            "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
            "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
PREPROCESSOR = {"size": {"longest_edge": 64 * 64, "shortest_edge": 8 * 8}, "patch_size": 4, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                "image_processor_type": "Qwen2VLImageProcessorFast"}


def build_tiny_vl(root, kind: str, seed: int) -> str:
    """build_tiny_hybrid's `kind` (with MTP) under root/kind, its config given the vision token ids and a
    preprocessor_config.json next to it; returns the folder."""
    folder = str(root / kind)
    build_tiny_hybrid(folder, kind, seed=seed, mtp=True, logit_scale=3.0)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump(PREPROCESSOR, f)
    return folder


def noise(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def write_vl_tokenizer(folder: str, vocab_size: int) -> None:
    """tests/helpers.py's tiny word tokenizer with the vision ids renamed to Qwen's special tokens, and TEMPLATE."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    for p in letters + list("0123456789 .,!?'\":;-()|<>_"):
        vocab.setdefault(p, len(vocab))
    while len(vocab) < vocab_size:
        n = len(vocab)
        vocab[VISION_TOKENS.get(n, f"<extra_{n}>")] = n
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS.values()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
