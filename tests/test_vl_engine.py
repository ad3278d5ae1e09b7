"""Image requests through the offline engine (Engine.generate(image_data=...)), CPU: a tiny random Qwen3.5
vision-language checkpoint saved with its vision tower, a preprocessor_config.json (patch 4, merge 2) and an MTP layer.

- the prompt's logprobs (every prefill position) and greedy tokens of an image request (text + 1 image + text; two
  images of different sizes) == transformers' Qwen3_5ForConditionalGeneration given the processor's pixel values and
  grids and the same expanded ids; images given as PIL images, data URLs or local paths give the same;
- chunked prefill cutting through the images gives the same tokens;
- greedy MTP == greedy plain on a batch mixing image and text requests;
- a retraction (a KV pool too small for the batch) re-prefills image requests to the same tokens;
- the prefix cache: the same image again hits (cached tokens past the image) with equal outputs; another image
  with the same text shares no page past the text before the image;
- a bad image or a placeholder / image count mismatch is a ValueError naming the problem, and the engine serves on.
"""

from __future__ import annotations

import base64
import contextlib

import pytest
import torch
from PIL import Image
from vl_helpers import IMAGE, PREPROCESSOR, VEND, VSTART, build_tiny_vl, data_url, noise

from specserve.engine.engine import Engine
from specserve.multimodal.image_processing import QwenImageProcessor, expand_image_placeholders

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


@contextlib.contextmanager
def encoder_calls(model):
    """A list that gets one entry per run of the model's vision tower (a forward hook) while the block runs."""
    calls: list[int] = []
    handle = model.visual.register_forward_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory):
    return build_tiny_vl(tmp_path_factory.mktemp("vl"), "qwen3_5_vl", 5)


def _hf_model(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf(vl_path):
    return _hf_model(vl_path)


@pytest.fixture(scope="module")
def engine(vl_path):
    with Engine(model_path=vl_path, dtype="float32", max_total_tokens=2048, max_running_requests=8) as e:
        yield e


def text(n: int, seed: int) -> list[int]:
    return torch.randint(3, 190, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def image_prompt(*parts) -> list[int]:
    """parts: an int n -> n text tokens (seeded by position); 'img' -> vision start, one placeholder, vision end."""
    out = []
    for k, p in enumerate(parts):
        out += [VSTART, IMAGE, VEND] if p == "img" else text(p, 100 * k + p)
    return out


IMG_A, IMG_B, IMG_C = noise(24, 16, 1), noise(40, 24, 2), noise(24, 16, 3)  # A, C: same size, other pixels


def hf_expected(hf, ids: list[int], images: list[Image.Image]):
    """transformers on the processor's pixels and the same expanded ids -> (expanded ids, log-softmax [T, V] of the
    prefill, greedy NEW tokens)."""
    proc = QwenImageProcessor(PREPROCESSOR)(images)
    full = expand_image_placeholders(ids, IMAGE, proc.num_tokens)
    x = torch.tensor([full])
    kw = dict(pixel_values=proc.pixel_values, image_grid_thw=proc.image_grid_thw,
              mm_token_type_ids=(x == IMAGE).long())  # image tokens 1 (transformers 5 asks for it)
    with torch.no_grad():
        logits = hf(input_ids=x, **kw).logits[0]
        g = hf.generate(input_ids=x, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
    return full, torch.log_softmax(logits.float(), -1), g[0, len(full):].tolist()


CASES = {"one_image": ((5, "img", 4), [IMG_A]), "two_images": ((3, "img", 2, "img", 3), [IMG_A, IMG_B])}


@pytest.mark.parametrize("case", list(CASES))
def test_image_request_matches_transformers(engine, hf, case):
    parts, images = CASES[case]
    ids = image_prompt(*parts)
    full, want_lp, want_tokens = hf_expected(hf, ids, images)
    out = engine.generate(input_ids=ids, sampling_params=GREEDY, image_data=images, return_logprob=True,
                          logprob_start_len=0)
    assert out["meta_info"]["prompt_tokens"] == len(full)
    got = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
    want = want_lp[torch.arange(len(full) - 1), torch.tensor(full[1:])]
    torch.testing.assert_close(torch.tensor(got), want, rtol=1e-4, atol=1e-4)
    assert out["output_ids"] == want_tokens
    # the image rows matter: the same ids without the pixels (placeholder embeddings) differ
    text_only = engine.generate(input_ids=full, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    other = torch.tensor([lp for lp, _, _ in text_only["meta_info"]["input_token_logprobs"][1:]])
    assert (other - want).abs().max() > 1e-2


def test_moe_image_request_matches_transformers(tmp_path):
    path = build_tiny_vl(tmp_path, "qwen3_5_moe_vl", 6)
    ids = image_prompt(3, "img", 2, "img", 3)
    _, _, want = hf_expected(_hf_model(path), ids, [IMG_A, IMG_B])
    with Engine(model_path=path, dtype="float32", max_total_tokens=1024) as e:
        assert e.generate(input_ids=ids, sampling_params=GREEDY, image_data=[IMG_A, IMG_B])["output_ids"] == want


def test_image_forms_and_chunked_prefill(engine, hf, vl_path, tmp_path):
    ids = image_prompt(3, "img", 2, "img", 3)
    _, _, want = hf_expected(hf, ids, [IMG_A, IMG_B])
    path = tmp_path / "b.png"
    IMG_B.save(path)
    out = engine.generate(input_ids=ids, sampling_params=GREEDY, image_data=[data_url(IMG_A), str(path)])
    assert out["output_ids"] == want
    # chunks of 5 tokens cut through both images (6 and 15 image tokens); the encoder runs once; prefill graphs
    # (static replay on a CPU) serve text batches only, image batches run eagerly
    with Engine(model_path=vl_path, dtype="float32", max_total_tokens=2048, chunked_prefill_size=5,
                disable_radix_cache=True, cuda_graph_max_prefill_tokens=32) as chunked:
        model = chunked.core.model_runner.target
        prefill = chunked.core.model_runner.prefill
        with encoder_calls(model) as enc:
            out = chunked.generate(input_ids=ids, sampling_params=GREEDY, image_data=[IMG_A, IMG_B])
        assert out["output_ids"] == want and len(enc) == 1
        eager, replays = prefill.eager_runs, prefill.replays
        assert eager == 7 and replays == 0  # 33 prompt tokens in chunks of 5
        chunked.generate(input_ids=text(12, 3), sampling_params=GREEDY)
        assert prefill.eager_runs == eager and prefill.replays > replays


def _mixed_batch():
    prompts = [image_prompt(5, "img", 4), text(17, 9), image_prompt(3, "img", 2, "img", 3), image_prompt("img", 6),
               text(11, 8)]
    images = [[IMG_A], None, [IMG_B, IMG_C], [IMG_C], None]
    return prompts, images


def test_mtp_greedy_equals_plain_on_mixed_batch(engine, vl_path):
    prompts, images = _mixed_batch()
    sp = dict(GREEDY, max_new_tokens=12)
    plain = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp, image_data=images)]
    with Engine(model_path=vl_path, dtype="float32", max_total_tokens=2048, speculative_algorithm="MTP",
                speculative_num_steps=2) as spec:
        outs = spec.generate(input_ids=prompts, sampling_params=sp, image_data=images)
        assert spec.scheduler.stats.spec_verify_ct > 0
    assert [o["output_ids"] for o in outs] == plain
    assert all(o["meta_info"]["spec_accept_length"] >= 1 for o in outs)


def test_retraction_gives_the_same_tokens(engine, vl_path):
    prompts, images = _mixed_batch()
    sp = dict(GREEDY, max_new_tokens=24)
    want = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp, image_data=images)]
    kw = dict(context_length=128, chunked_prefill_size=16, max_running_requests=8, schedule_conservativeness=0.0)
    with Engine(model_path=vl_path, dtype="float32", max_total_tokens=150, speculative_algorithm="MTP",
                speculative_num_steps=2, **kw) as tight:
        model = tight.core.model_runner.target
        with encoder_calls(model) as enc:
            outs = tight.generate(input_ids=prompts, sampling_params=sp, image_data=images)
        assert tight.scheduler.stats.num_retractions > 0
        assert len(enc) == 3  # once per image request, re-prefills included
    assert [o["output_ids"] for o in outs] == want


def test_prefix_cache_keys_images_by_their_pixels(vl_path):
    prefix = text(9, 77)
    ids = prefix + [VSTART, IMAGE, VEND] + text(12, 78)
    # chunks of 4: the hybrid's recurrent state is snapshotted at each chunk end, where a later hit may stop
    with Engine(model_path=vl_path, dtype="float32", max_total_tokens=2048, page_size=1, chunked_prefill_size=4,
                speculative_algorithm="MTP", speculative_num_steps=2) as e, \
            Engine(model_path=vl_path, dtype="float32", max_total_tokens=2048, disable_radix_cache=True) as cold:
        first = e.generate(input_ids=ids, sampling_params=GREEDY, image_data=[IMG_A])
        again = e.generate(input_ids=ids, sampling_params=GREEDY, image_data=[IMG_A])
        other = e.generate(input_ids=ids, sampling_params=GREEDY, image_data=[IMG_C])
        want_other = cold.generate(input_ids=ids, sampling_params=GREEDY, image_data=[IMG_C])
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] > len(prefix) + 2  # past the image
    assert other["meta_info"]["cached_tokens"] <= len(prefix) + 1  # the text and vision start only
    assert other["output_ids"] == want_other["output_ids"] != first["output_ids"]


def test_bad_images_are_value_errors_and_the_engine_serves_on(engine):
    ids = image_prompt(3, "img", 3)
    with pytest.raises(ValueError, match="1 image placeholders but the request carries 2 images"):
        engine.generate(input_ids=ids, sampling_params=GREEDY, image_data=[IMG_A, IMG_B])
    with pytest.raises(ValueError, match="0 image placeholders"):
        engine.generate(input_ids=text(5, 1), sampling_params=GREEDY, image_data=[IMG_A])
    with pytest.raises(ValueError, match="is not a PNG, JPEG, WebP or GIF image"):
        engine.generate(input_ids=ids, sampling_params=GREEDY,
                        image_data=["data:image/png;base64," + base64.b64encode(b"not an image").decode()])
    with pytest.raises(ValueError, match="does not fetch URLs"):
        engine.generate(input_ids=ids, sampling_params=GREEDY, image_data=["https://example.com/a.png"])
    with pytest.raises(ValueError, match="must be a PIL image or a string"):
        engine.generate(input_ids=ids, sampling_params=GREEDY, image_data=[3])
    with pytest.raises(ValueError, match="image_data has 1 entries for 2 prompts"):
        engine.generate(input_ids=[ids, ids], sampling_params=GREEDY, image_data=[[IMG_A]])
    two = engine.generate(input_ids=[ids, text(6, 2)], sampling_params=GREEDY, image_data=[[IMG_A], None])
    assert [len(o["output_ids"]) for o in two] == [NEW, NEW]
    out = engine.generate(input_ids=ids, sampling_params=GREEDY, image_data=[IMG_A])
    assert len(out["output_ids"]) == NEW


def test_multimodal_errors_and_the_server_400():
    """multimodal/ raises ImageInputError (a ValueError with param); server/ answers the same as an APIError 400."""
    pytest.importorskip("fastapi")  # (the GPU machine's image has no server dependencies)
    from specserve.multimodal import image_inputs as mm
    from specserve.server import image_inputs as server
    from specserve.server.errors import APIError

    ref = mm.ImageRef("https://example.com/a.png", "messages[0].content[1].image_url")
    with pytest.raises(mm.ImageInputError) as e:
        mm.load_image(ref, mm.ImageLimits())
    assert isinstance(e.value, ValueError) and e.value.param == ref.where and "does not fetch URLs" in str(e.value)
    with pytest.raises(APIError) as a:
        server.load_image(ref, server.ImageLimits())
    assert a.value.status == 400 and a.value.param == ref.where and a.value.message == str(e.value)


def test_request_images_rows_positions_and_cache_key():
    """RequestImages' chunk slices: image rows inside a chunk, positions past the prompt (a retraction's outputs)
    at index + delta, and the cache key (each image's tokens -> its key id, outside the vocabulary)."""
    from specserve.multimodal.image_inputs import ImageLimits
    from specserve.multimodal.request_images import load_request_images, prepare_request_images

    ids = image_prompt(3, "img", 2, "img", 3)
    imgs = load_request_images([IMG_A, IMG_C], ImageLimits())
    full, r, delta = prepare_request_images(ids, imgs, QwenImageProcessor(PREPROCESSOR), IMAGE, 256)
    assert r.num_tokens == (6, 6) and len(full) == len(ids) + 10 and delta < 0
    rows, which = r.chunk_rows(5, 12)  # image 0's tokens sit at 4 .. 9
    assert rows.tolist() == [0, 1, 2, 3, 4] and which.tolist() == [1, 2, 3, 4, 5]
    n = len(full)
    pos = r.chunk_positions(n - 2, n + 2, delta)
    assert torch.equal(pos[:, :2], r.positions[:, n - 2:]) and pos[:, 2:].tolist() == [[n + delta, n + 1 + delta]] * 3
    key = r.cache_key(full + [7])
    assert key[-1] == 7 and all(k >= 256 for i, k in enumerate(key) if full[i:i + 1] == [IMAGE])
    assert key[4] != key[4 + 6 + 4]  # two different pictures: two key ids
    assert [k for k, t in zip(key, full) if t != IMAGE] == [t for t in full if t != IMAGE]
