"""`specserve bench --dataset-name image` (bench/image_dataset.py): SGLang's resolutions, generated images of the
asked size, format and content, one placeholder per image in the templated prompt, image_url parts before the text
in the chat form, prompt lengths counting the checkpoint's image tokens, and the payload each backend sends. The
run against a live vision-language server is in tests/test_server_images.py."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image
from vl_helpers import IMAGE, PREPROCESSOR, write_vl_tokenizer

from specserve.bench import serving
from specserve.bench.backends import BACKENDS
from specserve.bench.image_dataset import ImageSpec, image_requests, parse_resolution, templated_prompt
from specserve.multimodal.image_processing import QwenImageProcessor


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vl_tok")
    write_vl_tokenizer(str(folder), 256)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return str(folder)


@pytest.fixture(scope="module")
def tokenizer(vl_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vl_dir)


def _decode(url: str) -> tuple[str, Image.Image]:
    head, b64 = url.split(",", 1)
    return head, Image.open(io.BytesIO(base64.b64decode(b64)))


def test_resolutions_presets_and_sglangs_height_by_width():
    assert parse_resolution("1080p") == (1920, 1080) and parse_resolution("720P") == (1280, 720)
    assert parse_resolution("4k") == (3840, 2160) and parse_resolution("360p") == (640, 360)
    assert parse_resolution("1080x1920") == (1920, 1080)  # HEIGHTxWIDTH
    for bad in ("", "1080", "0x10", "axb", "10x10x10", "-5x3"):
        with pytest.raises(ValueError, match="--image-resolution"):
            parse_resolution(bad)


def test_spec_refuses_bad_values():
    with pytest.raises(ValueError, match="--image-count"):
        ImageSpec(0, 8, 8, "png", "random")
    with pytest.raises(ValueError, match="--image-format"):
        ImageSpec(1, 8, 8, "bmp", "random")
    with pytest.raises(ValueError, match="--image-content"):
        ImageSpec(1, 8, 8, "png", "photo")


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_requests_carry_new_images_of_the_asked_kind(tokenizer, vl_dir, fmt):
    spec = ImageSpec(2, 40, 24, fmt, "random")
    tokens = QwenImageProcessor.from_model_dir(vl_dir).num_tokens_for(40, 24)
    reqs = image_requests(tokenizer, 3, 6, 5, 0.5, spec, seed=4, image_tokens=tokens)
    urls = [u for r in reqs for u in r.image_data]
    assert len(urls) == 6 and len(set(urls)) == 6  # no image shared between or within requests
    for r in reqs:
        assert 1 <= r.output_len <= 5
        for u in r.image_data:
            head, img = _decode(u)
            assert head == f"data:image/{fmt};base64" and img.format.lower() == fmt and img.size == (40, 24)
        ids = tokenizer.encode(r.prompt, add_special_tokens=False)
        assert ids.count(IMAGE) == 2  # one placeholder per image
        assert r.prompt_len == len(ids) + 2 * (tokens - 1)
        (msg,) = r.messages
        parts = msg["content"]
        assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]
        assert [p["image_url"]["url"] for p in parts[:2]] == r.image_data
        assert IMAGE not in tokenizer.encode(parts[2]["text"], add_special_tokens=False)  # text holds no image token
    again = image_requests(tokenizer, 3, 6, 5, 0.5, spec, seed=4, image_tokens=tokens)
    assert [r.image_data for r in again] == [r.image_data for r in reqs]  # the seed decides everything


def test_blank_images_are_white_and_unknown_token_counts_count_text_only(tokenizer):
    (r,) = image_requests(tokenizer, 1, 4, 2, 1.0, ImageSpec(1, 16, 8, "png", "blank"), seed=1)
    _, img = _decode(r.image_data[0])
    assert np.asarray(img.convert("RGB")).min() == 255
    assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))


def test_a_text_only_template_is_refused(tmp_path):
    from transformers import AutoTokenizer

    write_vl_tokenizer(str(tmp_path), 256)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tok.chat_template = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
                         "{% endif %}{% endfor %}{% endfor %}")
    with pytest.raises(ValueError, match="writes nothing for image parts"):
        templated_prompt(tok, "hi", 1)


def test_payloads_native_image_data_and_chat_parts(tokenizer):
    (r,) = image_requests(tokenizer, 1, 4, 3, 1.0, ImageSpec(1, 16, 16, "png", "random"), seed=2)
    native = BACKENDS["sglang"].payload(r, None, True, {})
    assert native["text"] == r.prompt and native["image_data"] == r.image_data and "input_ids" not in native
    chat = BACKENDS["openai-chat"].payload(r, "m", True, {})
    assert chat["messages"] == r.messages and "image_data" not in chat


def test_completions_backend_is_refused_for_images():
    args = serving.build_parser().parse_args(["--dataset-name", "image", "--backend", "openai"])
    with pytest.raises(ValueError, match="needs a backend that sends images"):
        serving._check_args(args)
