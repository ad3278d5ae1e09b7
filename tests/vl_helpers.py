"""A tiny random Qwen3.5 vision-language checkpoint (vision tower, MTP layer, Qwen3.5-style preprocessor config) and
the images the VL tests feed it; shared by tests/test_vl_engine.py and tests/test_server_images.py."""

from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
from hybrid_helpers import build_tiny_hybrid
from PIL import Image

IMAGE, VIDEO, VSTART, VEND = 200, 201, 202, 203  # inside the tiny vocabulary (256)
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
