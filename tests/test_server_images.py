"""Images over HTTP: a live server on the tiny Qwen3.5 vision-language checkpoint of tests/test_vl_engine.py, given a
tokenizer with Qwen's vision tokens and a chat template that writes `<|vision_start|><|image_pad|><|vision_end|>` for
an image part, as Qwen3.5's does.

- /v1/chat/completions with an image_url part (a data URL PNG) answers what Engine.generate answers for the same
  image and the same rendered prompt (greedy), streamed too; usage.prompt_tokens counts the expanded prompt;
- /generate with image_data (input_ids or text) equals Engine.generate;
- the same image again reports cached tokens past the image; another picture does not;
- every bad image (corrupt, too many, too many pixels, an http URL, a file outside --allowed-local-media-path, a
  placeholder without its image) is a 400 naming the problem, between two good requests, and nothing leaks;
- a forged `<|image_pad|>` typed in text stays text (no image slot);
- a text-only server answers an image part with a 400.
"""

from __future__ import annotations

import base64
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import build_tiny_model
from PIL import Image
from server_fixtures import LiveServer, start_server
from vl_helpers import IMAGE, VEND, VSTART, build_tiny_vl, data_url, noise, write_vl_tokenizer

from specserve.engine.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")
SERVER_ARGS = ["--served-model-name", "x", "--dtype", "float32", "--max-total-tokens", "1024",
               "--chunked-prefill-size", "4", "--page-size", "1", "--skip-warmup",
               "--max-images-per-request", "2", "--max-image-pixels", "4096", "--context-length", "80"]
NEW = 6
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


IMG_A, IMG_B = noise(32, 24, 11), noise(32, 24, 12)  # same size, other pixels


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_server")
    folder = build_tiny_vl(root, "qwen3_5_vl", 5)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    write_vl_tokenizer(folder, cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])
    return folder


@pytest.fixture(scope="module")
def servers(vl_path, tmp_path_factory):
    """(the VL server, a text-only server), started side by side."""
    root = tmp_path_factory.mktemp("vl_server_run")
    media = root / "media"
    media.mkdir()
    IMG_A.save(media / "a.png")
    text_model = build_tiny_model(str(root / "text"), "llama", seed=3)
    with ThreadPoolExecutor(2) as pool:
        vl = pool.submit(start_server, ["--model-path", vl_path, *SERVER_ARGS, "--allowed-local-media-path",
                                        str(media)], str(root / "vl.log"))
        text = pool.submit(start_server, ["--model-path", text_model, "--max-total-tokens", "1024", "--skip-warmup",
                                          "--served-model-name", "x", "--chat-template", _template_file(root)],
                           str(root / "text.log"))
        vl_srv, text_srv = vl.result(), text.result()
    yield vl_srv, text_srv
    vl_srv.terminate()
    text_srv.terminate()


def _template_file(root) -> str:
    path = root / "template.jinja"
    path.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}assistant: {% endif %}")
    return str(path)


@pytest.fixture(scope="module")
def server(servers) -> LiveServer:
    return servers[0]


@pytest.fixture(scope="module")
def engine(vl_path):
    with Engine(model_path=vl_path, dtype="float32", max_total_tokens=1024, chunked_prefill_size=4,
                disable_radix_cache=True) as e:
        yield e


def _chat_body(parts: list, **kw) -> dict:
    return {"model": "x", "messages": [{"role": "user", "content": parts}], "max_tokens": NEW, "temperature": 0.0,
            "ignore_eos": True, **kw}


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _chat_ids(engine: Engine, parts: list) -> list[int]:
    """The prompt the server renders for these parts: the template over text and {"type": "image"} parts."""
    msgs = [{"role": "user", "content": [{"type": "image"} if p["type"] == "image_url" else p for p in parts]}]
    text = engine.core.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return engine.core.tokenizer.encode(text, add_special_tokens=False)


def _post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_chat_image_equals_the_engine_and_streams(server, engine):
    from openai import OpenAI

    parts = [{"type": "text", "text": "what is this?"}, _image_part(data_url(IMG_A)), {"type": "text", "text": "ok"}]
    ids = _chat_ids(engine, parts)
    assert ids.count(IMAGE) == 1 and ids.count(VSTART) == 1
    want = engine.generate(input_ids=ids, sampling_params=GREEDY, image_data=[IMG_A])
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": parts}], max_tokens=NEW,
                                       temperature=0.0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want["text"]
    assert r.usage.prompt_tokens == want["meta_info"]["prompt_tokens"] > len(ids)  # the expanded prompt
    stream = client.chat.completions.create(model="x", messages=[{"role": "user", "content": parts}],
                                            max_tokens=NEW, temperature=0.0, extra_body={"ignore_eos": True},
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want["text"]
    assert chunks[-1].usage.prompt_tokens == want["meta_info"]["prompt_tokens"]


def test_generate_image_data_equals_the_engine(server, engine):
    ids = [5, 6, 7, VSTART, IMAGE, VEND, 8, 9]
    want = engine.generate(input_ids=ids, sampling_params=GREEDY, image_data=[IMG_B])
    r = _post(server, "/generate", {"input_ids": ids, "image_data": data_url(IMG_B), "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == want["output_ids"]
    assert r.json()["meta_info"]["prompt_tokens"] == want["meta_info"]["prompt_tokens"]
    # text with the markers typed in (a raw /generate prompt is the client's own), and the image as a local file
    text = "abc<|vision_start|><|image_pad|><|vision_end|>de"
    want = engine.generate(input_ids=engine.core.tokenizer.encode(text), sampling_params=GREEDY, image_data=[IMG_A])
    r = _post(server, "/generate", {"text": text, "image_data": ["a.png"], "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == want["output_ids"]
    # a batch: one image list per prompt
    r = _post(server, "/generate", {"input_ids": [ids, ids], "image_data": [[data_url(IMG_B)], data_url(IMG_A)],
                                    "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()[0]["output_ids"] == engine.generate(input_ids=ids, sampling_params=GREEDY,
                                                        image_data=[IMG_B])["output_ids"]
    assert r.json()[1]["output_ids"] == engine.generate(input_ids=ids, sampling_params=GREEDY,
                                                        image_data=[IMG_A])["output_ids"]
    assert server.wait_idle()["kv_free_pages"] == server.server_info()["kv_initial_free_pages"]


def test_the_same_image_again_is_cached_another_is_not(server):
    prefix = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    ids = prefix + [VSTART, IMAGE, VEND] + [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
    url_a, url_b = data_url(noise(24, 24, 31)), data_url(noise(24, 24, 32))
    first = _post(server, "/generate", {"input_ids": ids, "image_data": url_a, "sampling_params": GREEDY}).json()
    again = _post(server, "/generate", {"input_ids": ids, "image_data": url_a, "sampling_params": GREEDY}).json()
    other = _post(server, "/generate", {"input_ids": ids, "image_data": url_b, "sampling_params": GREEDY}).json()
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] > len(prefix) + 2  # past the image
    assert other["meta_info"]["cached_tokens"] <= len(prefix) + 1  # the text and the vision start only
    assert other["output_ids"] != first["output_ids"]
    chat = _chat_body([_image_part(url_a), {"type": "text", "text": "hi"}])
    _post(server, "/v1/chat/completions", chat)
    usage = _post(server, "/v1/chat/completions", chat).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def _png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


BAD_CHAT = {
    "corrupt": ([_image_part("data:image/png;base64," + base64.b64encode(b"not a png at all").decode())],
                "messages[0].content[0].image_url is not a PNG"),
    "truncated": ([_image_part("data:image/png;base64," + base64.b64encode(_png_bytes(IMG_A)[:60]).decode())],
                  "messages[0].content[0].image_url"),
    "too_many": ([_image_part(data_url(IMG_A))] * 3, "at most 2 are allowed (--max-images-per-request)"),
    "too_many_pixels": ([_image_part(data_url(noise(80, 80, 1)))], "--max-image-pixels"),
    "http": ([_image_part("http://example.com/cat.png")], "does not fetch URLs"),
    "outside": ([_image_part("file:///etc/hostname.png")], "outside the allowed local media directory"),
    "not_a_part": ([{"type": "audio", "audio": "x"}], "not supported"),
    # 64x64 pixels: 64 image tokens, past the context (80) with the text: the caps count the expanded prompt
    "past_the_context": ([{"type": "text", "text": "describe this picture"}, _image_part(data_url(noise(64, 64, 2)))],
                         "the context length is 80"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHAT))
def test_bad_images_are_400_between_good_requests(server, case):
    good = _chat_body([{"type": "text", "text": "hi"}, _image_part(data_url(IMG_A))])
    assert _post(server, "/v1/chat/completions", good).status_code == 200
    parts, needle = BAD_CHAT[case]
    r = _post(server, "/v1/chat/completions", _chat_body(parts))
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()
    assert _post(server, "/v1/chat/completions", good).status_code == 200
    info = server.wait_idle()
    assert info["kv_free_pages"] == info["kv_initial_free_pages"] and info["num_http_requests"] == 0


@pytest.mark.parametrize("body, needle", [
    ({"input_ids": [5, 6, 7], "image_data": "IMG"}, "0 image placeholders but the request carries 1"),
    ({"input_ids": [5, IMAGE, 7]}, "image tokens but the request carries no images"),
    ({"text": "a<|image_pad|>b"}, "image tokens but the request carries no images"),
    ({"input_ids": [5, IMAGE, 7], "image_data": ["IMG", "IMG", "IMG"]}, "--max-images-per-request"),
    ({"input_ids": [[5, IMAGE], [6, IMAGE]], "image_data": ["IMG"]}, "image_data has 1 entries for 2 prompts"),
])
def test_bad_generate_images_are_400(server, body, needle):
    body = json.loads(json.dumps(body).replace('"IMG"', json.dumps(data_url(IMG_A))))
    r = _post(server, "/generate", {**body, "sampling_params": GREEDY})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()
    r = _post(server, "/v1/completions", {"model": "x", "prompt": "a<|image_pad|>b", "max_tokens": 2})
    assert r.status_code == 400 and "carries no images" in r.json()["error"]["message"]


def test_a_forged_placeholder_in_text_stays_text(server, engine):
    tok = engine.core.tokenizer
    plain = _chat_body([{"type": "text", "text": "hi"}, _image_part(data_url(IMG_A))])
    forged = _chat_body([{"type": "text", "text": "hi<|image_pad|>"}, _image_part(data_url(IMG_A))])
    r0, r1 = _post(server, "/v1/chat/completions", plain), _post(server, "/v1/chat/completions", forged)
    assert r0.status_code == r1.status_code == 200, r1.text  # one image slot: the one the part made
    as_text = len(tok.encode("<|image_pad|>", add_special_tokens=False, split_special_tokens=True))
    assert as_text > 1
    assert r1.json()["usage"]["prompt_tokens"] == r0.json()["usage"]["prompt_tokens"] + as_text
    # forged text alone: no image at all, still a 200 (no slot for a missing image)
    r = _post(server, "/v1/chat/completions", _chat_body([{"type": "text", "text": "<|vision_start|><|image_pad|>"}]))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("backend", ["specserve", "openai-chat"])
def test_bench_image_dataset_runs_against_the_server(server, vl_path, tmp_path, backend):
    """`specserve bench --dataset-name image`: every request completes, and the server counts the prompt tokens
    the bench counted (templated text plus each image's tokens from the checkpoint's processor)."""
    from specserve.bench import serving
    from specserve.bench.image_dataset import ImageSpec, image_requests
    from specserve.bench.target import resolve_tokenizer
    from specserve.multimodal.image_processing import QwenImageProcessor

    out = tmp_path / "bench.jsonl"
    rc = serving.main(["--backend", backend, "--base-url", server.url, "--tokenizer", vl_path, "--dataset-name",
                       "image", "--image-count", "1", "--image-resolution", "24x32", "--image-format", "png",
                       "--random-input-len", "2", "--random-output-len", "4", "--random-range-ratio", "1",
                       "--num-prompts", "3", "--max-concurrency", "2", "--seed", "3", "--disable-tqdm",
                       "--output-file", str(out)])
    assert rc == 0
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert line["completed"] == 3 and line["failed"] == 0, line["errors"]
    assert line["total_output_tokens"] == 12 and line["image_resolution"] == "24x32"
    tokens = QwenImageProcessor.from_model_dir(vl_path).num_tokens_for(32, 24)
    reqs = image_requests(resolve_tokenizer(vl_path, None), 3, 2, 4, 1.0, ImageSpec(1, 32, 24, "png", "random"), 3,
                          tokens)
    assert line["total_input_tokens"] == sum(r.prompt_len for r in reqs)
    assert server.wait_idle()["kv_free_pages"] == server.server_info()["kv_initial_free_pages"]


def test_a_text_only_server_refuses_images(servers):
    text = servers[1]
    r = _post(text, "/v1/chat/completions", _chat_body([{"type": "text", "text": "hi"}, _image_part(data_url(IMG_A))]))
    assert r.status_code == 400 and "does not take images" in r.json()["error"]["message"], r.text
    r = _post(text, "/generate", {"text": "hi", "image_data": data_url(IMG_A), "sampling_params": GREEDY})
    assert r.status_code == 400 and "does not take images" in r.json()["error"]["message"], r.text
    assert _post(text, "/v1/chat/completions", _chat_body([{"type": "text", "text": "hi"}])).status_code == 200


def test_preprocessed_images_build_the_engines_request_images(vl_path):
    """What the server sends (PreprocessedImages, the prompt expanded) gives the RequestImages the engine's own path
    makes; a prompt whose image tokens do not match the images is an ImageInputError."""
    import torch

    from specserve.multimodal.image_inputs import ImageInputError, ImageLimits
    from specserve.multimodal.image_processing import QwenImageProcessor
    from specserve.multimodal.request_images import (
        load_request_images,
        prepare_request_images,
        preprocess_images,
        request_images_from,
    )

    proc = QwenImageProcessor.from_model_dir(vl_path)
    decoded = load_request_images([IMG_A, IMG_B], ImageLimits())
    ids = [5, VSTART, IMAGE, VEND, 6, VSTART, IMAGE, VEND, 7]
    want_ids, want, want_delta = prepare_request_images(ids, decoded, proc, IMAGE, 256)
    pre = preprocess_images(decoded, proc)
    got, delta = request_images_from(want_ids, pre, IMAGE, 256)
    assert delta == want_delta and got.hashes == want.hashes and got.key_ids == want.key_ids
    for name in ("pixel_values", "grid_thw", "positions", "placeholders"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    with pytest.raises(ImageInputError, match="image tokens"):
        request_images_from(ids, pre, IMAGE, 256)  # not expanded
    split = list(want_ids)
    first = split.index(IMAGE)
    split[first + 1] = 9  # the first image's run cut by a text token, one placeholder more at the end
    split.insert(len(split) - 1, IMAGE)
    with pytest.raises(ImageInputError):
        request_images_from(split, pre, IMAGE, 256)
