"""Image inputs (server/image_inputs.py, server/image_processing.py), CPU only: client references decode to the
pixels that were sent, or are refused with a 400 naming the problem (never fetched, never read outside the allowed
directory, never decoded past the limits); the processor's output is transformers' own, laid out as the encoder
expects; placeholders expand to the processor's token counts."""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import struct
import sys
import time
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from specserve.server.errors import APIError
from specserve.server.image_inputs import (
    ImageLimits,
    ImageRef,
    chat_image_refs,
    decode_image_bytes,
    generate_image_refs,
    load_chat_images,
    load_generate_images,
    load_image,
    pixel_hash,
)
from specserve.server.image_processing import QwenImageProcessor, expand_image_placeholders
from specserve.server.protocol import ChatCompletionRequest
from specserve.server_args import PILLOW_MAX_PIXELS, ServerArgs

LIMITS = ImageLimits()
INTERNALS = ("Traceback", "PIL", "Pillow", "Error", 'File "', "site-packages", " at 0x", "Errno")

# Qwen3-VL / Qwen3.5's preprocessor_config.json (patch 16, merge 2, mean = std = 0.5)
QWEN35_PREPROCESSOR = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                       "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                       "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                       "image_processor_type": "Qwen2VLImageProcessorFast"}


# ---------------------------------------------------------------------------------------------------- helpers
def noise(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def smooth(w: int, h: int) -> Image.Image:
    """A gradient picture: JPEG keeps it within a few levels."""
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) * 255 // max(w + h - 2, 1)], -1)
    return Image.fromarray(a.astype(np.uint8))


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def pixels(x) -> np.ndarray:
    return np.asarray(x.image if hasattr(x, "image") else x)


def refused(fn, *args, needles=()) -> str:
    """fn(*args) raises a 400 APIError whose message holds every needle and no library internals; the message."""
    with pytest.raises(APIError) as e:
        fn(*args)
    err = e.value
    assert err.status == 400, (err.status, err.message)
    for n in needles:
        assert n in err.message, (n, err.message)
    for bad in INTERNALS:
        assert bad not in err.message, (bad, err.message)
    return err.message


def png_claiming(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose IHDR (CRC fixed up) claims width x height: its pixel data is a 1x1 image's, so a decode
    would fail as truncated; a pixel-cap refusal proves nothing was decoded."""
    png = bytearray(encode(Image.new("RGB", (1, 1), (9, 9, 9)), "PNG"))
    assert png[12:16] == b"IHDR"
    png[16:24] = struct.pack(">II", width, height)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    return bytes(png)


# ---------------------------------------------------------------------------------------------------- decoding
def test_png_data_url_decodes_to_the_same_pixels():
    src = noise(37, 23)
    out = load_image(data_url(encode(src, "PNG")), LIMITS)
    assert (out.width, out.height, out.format, out.image.mode) == (37, 23, "PNG", "RGB")
    assert np.array_equal(pixels(out), np.asarray(src))
    assert out.hash == pixel_hash(src)


@pytest.mark.parametrize("fmt, media_type, kw, tol", [
    ("JPEG", "image/jpeg", {"quality": 95}, 4.0),
    ("JPEG", "image/jpg", {"quality": 95}, 4.0),
    ("WEBP", "image/webp", {"lossless": True}, 0.0),
    ("WEBP", "image/webp", {"quality": 90}, 6.0),
])
def test_jpeg_and_webp_data_urls(fmt, media_type, kw, tol):
    src = smooth(64, 48)
    out = load_image(data_url(encode(src, fmt, **kw), media_type), LIMITS)
    assert (out.width, out.height, out.format) == (64, 48, fmt)
    diff = np.abs(pixels(out).astype(np.int16) - np.asarray(src).astype(np.int16))
    assert diff.mean() <= tol, diff.mean()
    if tol == 0:
        assert out.hash == pixel_hash(src)


def test_bare_base64_and_its_variants():
    src = noise(20, 20, seed=1)
    png = encode(src, "PNG")
    b64 = base64.b64encode(png).decode()
    want = pixel_hash(src)
    wrapped = "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76))  # MIME-style line breaks
    for text in (b64, wrapped, b64.rstrip("="), base64.urlsafe_b64encode(png).decode(), "  " + b64 + "\n"):
        assert load_image(text, LIMITS).hash == want


def test_still_gif_is_taken_animated_images_are_not():
    src = Image.new("RGB", (10, 6), (200, 30, 30))
    src.paste((10, 200, 10), (0, 0, 5, 3))
    out = load_image(data_url(encode(src, "GIF"), "image/gif"), LIMITS)
    assert out.format == "GIF" and np.array_equal(pixels(out), np.asarray(src))
    frames = [Image.new("RGB", (8, 8), (40 * i, 0, 0)) for i in range(3)]
    for fmt, name in (("GIF", "GIF"), ("PNG", "PNG"), ("WEBP", "WebP")):
        data = encode(frames[0], fmt, save_all=True, append_images=frames[1:])
        refused(decode_image_bytes, data, ImageRef("x", "img"), LIMITS, needles=(f"animated {name}", "one frame"))


def test_the_declared_media_type_need_not_match_the_bytes():
    """Clients label any image image/jpeg: the bytes decide, as long as they are an allowed format."""
    src = noise(9, 7, seed=2)
    out = load_image(data_url(encode(src, "PNG"), "image/jpeg"), LIMITS)
    assert out.format == "PNG" and np.array_equal(pixels(out), np.asarray(src))


def test_transparency_goes_onto_white_and_opaque_alpha_changes_nothing():
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[..., 0] = 200
    rgba[:2, :, 3] = 255  # top half opaque red, bottom half fully transparent
    out = load_image(data_url(encode(Image.fromarray(rgba, "RGBA"), "PNG")), LIMITS)
    px = pixels(out)
    assert (px[:2] == [200, 0, 0]).all() and (px[2:] == [255, 255, 255]).all()
    src = noise(6, 5, seed=3)
    opaque = src.convert("RGBA")
    assert load_image(data_url(encode(opaque, "PNG")), LIMITS).hash == pixel_hash(src)


def test_16_bit_greyscale_keeps_its_top_bits():
    grey = (np.arange(12, dtype=np.uint16) * 5000).reshape(3, 4)
    out = load_image(data_url(encode(Image.fromarray(grey), "PNG")), LIMITS)
    assert np.array_equal(pixels(out)[..., 0], (grey >> 8).astype(np.uint8))
    assert np.array_equal(pixels(out)[..., 0], pixels(out)[..., 2])


def test_exif_orientation_is_applied():
    src = smooth(40, 24)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    out = load_image(data_url(encode(src, "JPEG", quality=95, exif=exif), "image/jpeg"), LIMITS)
    assert (out.width, out.height) == (24, 40)
    want = np.asarray(src.transpose(Image.Transpose.ROTATE_270)).astype(np.int16)
    assert np.abs(pixels(out).astype(np.int16) - want).mean() < 4


# ---------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("case", ["random", "truncated", "corrupt-idat", "bmp", "tiff", "ico", "empty-b64", "text"])
def test_bad_bytes_are_a_400(case):
    png = encode(noise(64, 64, seed=4), "PNG")
    data, needles = {
        "random": (bytes(np.random.default_rng(5).integers(0, 256, 500, dtype=np.uint8)), ("is not a PNG, JPEG",)),
        "truncated": (png[:len(png) // 2], ("truncated",)),
        "corrupt-idat": (png[:len(png) // 2] + bytes(64) + png[len(png) // 2 + 64:], ("corrupt PNG",)),
        "bmp": (encode(noise(8, 8), "BMP"), ("is not a PNG, JPEG, WebP or GIF image",)),
        "tiff": (encode(noise(8, 8), "TIFF"), ("is not a PNG, JPEG, WebP or GIF image",)),
        "ico": (encode(noise(16, 16), "ICO"), ("is not a PNG, JPEG, WebP or GIF image",)),
        "empty-b64": (b"", ("empty",)),
        "text": (b"just some text, not an image\n" * 4, ("is not a PNG",)),
    }[case]
    refused(load_image, ImageRef(data_url(data), "messages[0].content[1].image_url"), LIMITS,
            needles=("messages[0].content[1].image_url", *needles))


@pytest.mark.parametrize("url, needle", [
    ("", "is empty"),
    ("   ", "is empty"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:image/png;base64,AAAAA", "not valid base64"),  # a length no base64 has (padding is added for others)
    ("data:image/png;base64,é" + "A" * 7, "not valid base64"),
    ("data:text/plain;base64,aGVsbG8=", "media type 'text/plain'"),
    ("data:image/svg+xml;base64,PHN2Zz4=", "media type 'image/svg+xml'"),
    ("data:image/png,%89PNG", "base64-encoded"),
    ("data:image/png;base64", "not a data URL"),
    ("not base64 at all!", "neither a URL nor valid base64"),
])
def test_bad_references_are_a_400(url, needle):
    refused(load_image, ImageRef(url, "image_data"), LIMITS, needles=("image_data", needle))


def test_pixel_cap_refuses_from_the_header_before_decoding():
    ref = ImageRef("x", "img")
    t = time.perf_counter()
    # 10^10 pixels: Pillow's own bomb check fires at open (far above ours); the same message either way
    refused(decode_image_bytes, png_claiming(100_000, 100_000), ref, LIMITS,
            needles=("more pixels", "33,554,432", "--max-image-pixels"))
    # 36 M pixels: under Pillow's limit, over ours (2**25): our check, with the size
    refused(decode_image_bytes, png_claiming(6000, 6000), ref, LIMITS,
            needles=("more pixels (6000x6000 = 36,000,000) than the 33,554,432",))
    assert time.perf_counter() - t < 2.0
    # the same crafted file under the cap gets as far as the decode, which finds it truncated: the refusal above
    # came before any decode
    refused(decode_image_bytes, png_claiming(64, 64), ref, LIMITS, needles=("truncated",))
    # the boundary, with a real image
    img = encode(noise(64, 64), "PNG")
    assert decode_image_bytes(img, ref, ImageLimits(max_pixels=64 * 64)).width == 64
    refused(decode_image_bytes, img, ref, ImageLimits(max_pixels=64 * 64 - 1), needles=("(64x64 = 4,096)",))
    # and through a data URL
    refused(load_image, data_url(png_claiming(100_000, 100_000)), LIMITS, needles=("more pixels",))


def test_byte_cap_refuses_before_decoding(tmp_path):
    png = encode(noise(40, 40, seed=6), "PNG")
    url = data_url(png)
    assert load_image(url, ImageLimits(max_bytes=len(png))).width == 40  # exactly at the cap
    msg = refused(load_image, url, ImageLimits(max_bytes=len(png) - 1), needles=("is larger", "--max-encoded-image-mb"))
    assert f"({len(png) / (1 << 20):g} MiB)" in msg
    refused(load_image, base64.b64encode(png).decode(), ImageLimits(max_bytes=len(png) - 1), needles=("is larger",))
    # far over: refused from the text's length alone (this is not even base64, and never gets decoded)
    refused(load_image, "data:image/png;base64," + "!" * 10_000, ImageLimits(max_bytes=1000), needles=("is larger",))
    # local files: from the file's size, before it is read
    (tmp_path / "big.png").write_bytes(png)
    refused(load_image, str(tmp_path / "big.png"), ImageLimits(max_bytes=len(png) - 1, local_root=str(tmp_path)),
            needles=("is larger",))


def test_too_many_images_is_refused_before_any_is_read():
    """33 references the server would refuse one by one: the count is what the 400 names (checked first)."""
    parts = [{"type": "image_url", "image_url": {"url": "https://example.invalid/x.png"}} for _ in range(33)]
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]
    refused(load_chat_images, messages, LIMITS, needles=("33 images", "at most 32", "--max-images-per-request"))
    refused(load_generate_images, ["https://x.invalid/a.png"] * 33, None, LIMITS, needles=("33 images",))
    # a batch counts every prompt's images; a broadcast reference counts once per prompt
    refused(load_generate_images, "https://x.invalid/a.png", 33, LIMITS, needles=("33 images",))
    refused(load_generate_images, [["https://x.invalid/a.png"] * 20, ["https://x.invalid/a.png"] * 13], 2, LIMITS,
            needles=("33 images",))
    # 32 real ones pass
    url = data_url(encode(noise(4, 4), "PNG"))
    ok = load_chat_images([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}] * 32}],
                          LIMITS)
    assert len(ok) == 32


# ---------------------------------------------------------------------------------------------------- URLs
class _SocketEvents:
    """Records the interpreter's socket audit events (sys.addaudithook: no module is patched) while on; a hook
    cannot be removed, so it stays installed and records nothing when off."""

    on = False
    seen: list[str] = []

    @classmethod
    def hook(cls, event: str, _args) -> None:
        if cls.on and event.startswith("socket."):
            cls.seen.append(event)


sys.addaudithook(_SocketEvents.hook)


def test_urls_are_refused_without_opening_a_socket():
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.3)
    port = listener.getsockname()[1]
    urls = [f"http://127.0.0.1:{port}/a.png", f"https://127.0.0.1:{port}/a.png", f"ftp://127.0.0.1:{port}/a.png",
            "HTTPS://example.invalid/cat.jpg", "  http://example.invalid/cat.jpg", "s3://bucket/cat.png",
            "gs://bucket/cat.png", "http://10.255.255.1/slow.png"]
    try:
        _SocketEvents.seen.clear()
        _SocketEvents.on = True
        t = time.perf_counter()
        for url in urls:
            refused(load_image, ImageRef(url, "image_data"), LIMITS, needles=("does not fetch URLs", "data URL"))
        refused(load_chat_images, [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": urls[0], "detail": "high"}}]}], LIMITS, needles=("messages[0].content[0].image_url",))
        refused(load_generate_images, [urls[1]], 1, LIMITS, needles=("image_data[0]", "does not fetch URLs"))
        elapsed = time.perf_counter() - t
        _SocketEvents.on = False
        assert _SocketEvents.seen == [], _SocketEvents.seen  # no socket made, no name looked up
        assert elapsed < 1.0
        with pytest.raises(TimeoutError):  # and nothing connected to the listener
            listener.accept()
    finally:
        _SocketEvents.on = False
        listener.close()
    # the hook does see sockets (the test can fail)
    _SocketEvents.on = True
    socket.socket().close()
    _SocketEvents.on = False
    assert "socket.__new__" in _SocketEvents.seen


# ---------------------------------------------------------------------------------------------------- local files
@pytest.fixture
def media(tmp_path):
    """tmp/media (the allowed directory) with a.png and sub/b.png; tmp/outside.png next to it."""
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    img = noise(12, 9, seed=7)
    (root / "a.png").write_bytes(encode(img, "PNG"))
    (root / "sub" / "b.png").write_bytes(encode(img, "PNG"))
    (tmp_path / "outside.png").write_bytes(encode(noise(12, 9, seed=8), "PNG"))
    return root, img


def test_local_files_inside_the_allowed_directory(media):
    root, img = media
    limits = ImageLimits(local_root=str(root))
    want = pixel_hash(img)
    (root / "link.png").symlink_to(root / "sub" / "b.png")  # a symlink that stays inside
    for ref in (str(root / "a.png"), f"file://{root / 'a.png'}", f"file://localhost{root / 'sub' / 'b.png'}",
                "a.png", "sub/b.png", "sub/../a.png", "file:a.png", str(root / "link.png"),
                f"file://{str(root / 'a.png').replace('/', '%2F').replace('%2F', '/', 1)}"):
        out = load_image(ref, limits)
        assert out.hash == want and np.array_equal(pixels(out), np.asarray(img)), ref


def test_local_files_outside_or_not_allowed(media, tmp_path):
    root, _ = media
    limits = ImageLimits(local_root=str(root))
    (root / "escape.png").symlink_to(tmp_path / "outside.png")
    (root / "dirlink").symlink_to(tmp_path, target_is_directory=True)
    for ref in (str(tmp_path / "outside.png"), "../outside.png", "sub/../../outside.png", "escape.png",
                "dirlink/outside.png", f"file://{tmp_path / 'outside.png'}", "/etc/passwd.png",
                str(root) + "-sibling/a.png"):
        msg = refused(load_image, ImageRef(ref, "image_data"), limits, needles=("outside the allowed local media",))
        if not os.path.isabs(ref) and not ref.startswith("file:"):
            assert str(root) not in msg and str(tmp_path) not in msg  # the server's directory is not shown
    # no allowed directory: no local file at all, not even an existing one
    for ref in (str(root / "a.png"), f"file://{root / 'a.png'}", "a.png"):
        refused(load_image, ref, LIMITS, needles=("local files are not allowed", "--allowed-local-media-path"))


def test_local_file_problems(media):
    root, _ = media
    limits = ImageLimits(local_root=str(root))
    (root / "notes.png").write_text("not an image at all\n")
    (root / "empty.png").write_bytes(b"")
    os.mkfifo(root / "pipe.png")  # opening must not block waiting for a writer
    (root / "photo.bmp").write_bytes(encode(noise(8, 8), "BMP"))
    for ref, needle in (("notes.png", "is not a PNG, JPEG"), ("missing.png", "does not exist"),
                        ("file:sub", "not name a regular file"), ("pipe.png", "not name a regular file"),
                        ("empty.png", "empty file"), ("photo.bmp", "is not a PNG, JPEG"),
                        ("file://otherhost/a.png", "another host"), ("a\x00.png", "not a valid file path")):
        refused(load_image, ImageRef(ref, "image_data"), limits, needles=(needle,))
    with pytest.raises(ValueError, match="not a directory"):
        ImageLimits(local_root=str(root / "a.png"))


# ---------------------------------------------------------------------------------------------------- hashes
def test_hash_depends_on_pixels_and_size_only(media):
    root, img = media
    limits = ImageLimits(local_root=str(root))
    png = encode(img, "PNG")
    same = [load_image(data_url(png), limits), load_image(base64.b64encode(png).decode(), limits),
            load_image("a.png", limits), load_image(data_url(encode(img, "WEBP", lossless=True), "image/webp"), limits),
            load_image(data_url(encode(img.convert("RGBA"), "PNG")), limits)]
    assert len({x.hash for x in same}) == 1 and len(same[0].hash) == 64
    other = noise(12, 9, seed=99)
    assert load_image(data_url(encode(other, "PNG")), limits).hash != same[0].hash
    # the same bytes in another shape are another picture
    flat = np.asarray(img).reshape(-1)
    a = Image.fromarray(flat[:2 * 3 * 3].reshape(2, 3, 3))
    b = Image.fromarray(flat[:2 * 3 * 3].reshape(3, 2, 3))
    assert a.tobytes() == b.tobytes() and pixel_hash(a) != pixel_hash(b)


# ---------------------------------------------------------------------------------------------------- references
def test_chat_references_in_order_from_parsed_requests():
    body = {"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "image_url", "image_url": {"url": "data:1", "detail": "low"}},
                                     {"type": "image_url", "image_url": "data:2"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:3"}}]}]}
    for messages in (body["messages"], ChatCompletionRequest.model_validate(body).messages):
        refs = chat_image_refs(messages)
        assert [(r.url, r.where, r.detail) for r in refs] == [
            ("data:1", "messages[1].content[1].image_url", "low"), ("data:2", "messages[1].content[2].image_url", None),
            ("data:3", "messages[3].content[0].image_url", None)]
    for bad, needle in (({"detail": "low"}, "string 'url'"), ({"url": 5}, "string 'url'"), (7, "string 'url'"),
                        ({"url": "data:x", "detail": "ultra"}, "detail must be one of auto, low, high")):
        refused(chat_image_refs, [{"role": "user", "content": [{"type": "image_url", "image_url": bad}]}],
                needles=("messages[0].content[0].image_url", needle))


def test_generate_image_data_shapes():
    def urls(per_prompt):
        return [[(r.url, r.where) for r in p] for p in per_prompt]

    assert urls(generate_image_refs("A", None)) == [[("A", "image_data")]]
    assert urls(generate_image_refs(["A", "B"], None)) == [[("A", "image_data[0]"), ("B", "image_data[1]")]]
    assert urls(generate_image_refs(None, None)) == [[]]
    assert urls(generate_image_refs({"url": "A"}, None)) == [[("A", "image_data")]]
    assert urls(generate_image_refs(["A", None, ["B", "C"]], 3)) == [
        [("A", "image_data[0]")], [], [("B", "image_data[2][0]"), ("C", "image_data[2][1]")]]
    assert urls(generate_image_refs("A", 2)) == [[("A", "image_data")], [("A", "image_data")]]
    assert urls(generate_image_refs(None, 2)) == [[], []]
    refused(generate_image_refs, ["A", "B"], 3, needles=("2 entries for 3 prompts",))
    refused(generate_image_refs, [["A"]], None, needles=("image_data[0] must be a string",))
    refused(generate_image_refs, 5, None, needles=("image_data must be a string",))
    # a broadcast image is decoded once and shared
    url = data_url(encode(noise(5, 5), "PNG"))
    a, b = load_generate_images(url, 2, LIMITS)
    assert a[0] is b[0]


# ---------------------------------------------------------------------------------------------------- flags
def test_flags_defaults_and_validation(tmp_path):
    from specserve.server.launch import parse_args

    args = ServerArgs()
    assert (args.max_images_per_request, args.max_image_pixels, args.max_encoded_image_mb,
            args.allowed_local_media_path) == (32, 1 << 25, 20.0, None)
    limits = ImageLimits.from_args(args)
    assert (limits.max_images, limits.max_pixels, limits.max_bytes, limits.local_root) == (32, 1 << 25, 20 << 20, None)
    a = parse_args(["--max-images-per-request", "4", "--max-image-pixels", "1000", "--max-encoded-image-mb", "0.5",
                    "--allowed-local-media-path", str(tmp_path)])
    limits = ImageLimits.from_args(a)
    assert (limits.max_images, limits.max_pixels, limits.max_bytes) == (4, 1000, 1 << 19)
    assert limits.local_root == os.path.realpath(tmp_path)
    for kw, needle in (({"max_images_per_request": 0}, "--max-images-per-request"),
                       ({"max_image_pixels": 0}, "--max-image-pixels"),
                       ({"max_image_pixels": PILLOW_MAX_PIXELS + 1}, "decompression bombs"),
                       ({"max_encoded_image_mb": 0}, "--max-encoded-image-mb"),
                       ({"allowed_local_media_path": " "}, "--allowed-local-media-path")):
        with pytest.raises(ValueError, match=needle):
            ServerArgs(**kw)
    with pytest.raises(ValueError, match="not a directory"):
        ImageLimits.from_args(ServerArgs(allowed_local_media_path=str(tmp_path / "nope")))


# ---------------------------------------------------------------------------------------------------- processing
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen35")
    (d / "preprocessor_config.json").write_text(json.dumps(QWEN35_PREPROCESSOR))
    return d


def test_processor_equals_transformers(model_dir):
    from transformers import AutoImageProcessor

    ours = QwenImageProcessor.from_model_dir(model_dir)
    ref = AutoImageProcessor.from_pretrained(str(model_dir))  # what transformers builds from the same folder
    assert (ours.merge_size, ours.patch_size, ours.temporal_patch_size) == (2, 16, 2)
    images = [load_image(data_url(encode(noise(w, h, seed=w), "PNG")), LIMITS) for w, h in ((60, 40), (480, 330),
                                                                                          (256, 256))]
    out = ours(images)
    want = ref([x.image for x in images], return_tensors="pt")
    assert torch.equal(out.pixel_values, want["pixel_values"]) and out.pixel_values.dtype == torch.float32
    assert torch.equal(out.image_grid_thw, want["image_grid_thw"]) and out.image_grid_thw.dtype == torch.int64
    # smart_resize by hand (sides rounded to multiples of 32, at least 65536 pixels): 60x40 is scaled up by
    # sqrt(65536 / 2400) to 320x224; 480x330 rounds to 480x320; 256x256 stays
    assert out.image_grid_thw.tolist() == [[1, 14, 20], [1, 20, 30], [1, 16, 16]]
    assert out.num_tokens == (70, 150, 64)
    assert out.pixel_values.shape == (sum(t * h * w for t, h, w in out.image_grid_thw.tolist()), 3 * 2 * 16 * 16)
    assert list(out.num_tokens) == [ours.num_tokens_for(x.width, x.height) for x in images]
    # the same from the config dict, and from the transformers object
    assert torch.equal(QwenImageProcessor(QWEN35_PREPROCESSOR)(images).pixel_values, out.pixel_values)
    assert QwenImageProcessor(ref)(images).num_tokens == out.num_tokens
    # no image: empty tensors of the right widths
    empty = ours([])
    assert empty.pixel_values.shape == (0, 1536) and empty.image_grid_thw.shape == (0, 3) and empty.num_tokens == ()


def test_processor_patch_layout_by_hand():
    """A 64x64 image at its own size (no resize): patches in merge-block order, each (channel, frame, row, column),
    normalised as (x / 255 - 0.5) / 0.5 and repeated over the 2 frames."""
    proc = QwenImageProcessor({**QWEN35_PREPROCESSOR, "size": {"longest_edge": 1 << 20, "shortest_edge": 64 * 64}})
    src = noise(64, 64, seed=11)
    out = proc([src])
    assert out.image_grid_thw.tolist() == [[1, 4, 4]] and out.num_tokens == (4,)
    x = (np.asarray(src).astype(np.float32) / 255 - 0.5) / 0.5  # [H, W, C]

    def patch(r, c):  # the patch at patch-row r, patch-column c, flattened (C, Tp, P, P)
        p = x[16 * r:16 * r + 16, 16 * c:16 * c + 16].transpose(2, 0, 1)  # [C, P, P]
        return np.stack([p, p], axis=1).reshape(-1)

    # merge block (0, 0) holds patches (0,0) (0,1) (1,0) (1,1); block (0, 1) starts at patch (0, 2)
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 0)]
    for k, (r, c) in enumerate(order):
        assert np.allclose(out.pixel_values[k].numpy(), patch(r, c), atol=1e-6), (k, r, c)


def test_processor_refuses_extreme_aspect_ratios_and_other_processors():
    proc = QwenImageProcessor(QWEN35_PREPROCESSOR)
    img = load_image(ImageRef(data_url(encode(noise(201, 1), "PNG")), "messages[0].content[0].image_url"), LIMITS)
    refused(proc, [img], needles=("messages[0].content[0].image_url is 201x1", "aspect ratio above 200:1"))
    assert proc([noise(200, 1)]).num_tokens  # 200:1 is still taken
    with pytest.raises(ValueError, match="only Qwen2-VL's image processor"):
        QwenImageProcessor({**QWEN35_PREPROCESSOR, "image_processor_type": "CLIPImageProcessor"})


def test_expand_image_placeholders():
    pad = 151655  # <|image_pad|>
    ids = [1, 151652, pad, 151653, 2, 3, 151652, pad, 151653, 4]
    assert expand_image_placeholders(ids, pad, [3, 2]) == [1, 151652, pad, pad, pad, 151653, 2, 3, 151652, pad, pad,
                                                            151653, 4]
    assert expand_image_placeholders([5, 6], pad, []) == [5, 6]
    refused(expand_image_placeholders, ids, pad, [3], needles=("2 image placeholders", "carries 1 images"))
    refused(expand_image_placeholders, [1, 2], pad, [4], needles=("0 image placeholders", "carries 1 images"))
    refused(expand_image_placeholders, [pad, pad, pad], pad, [1, 1], needles=("3 image placeholders",))
    # with the processor's counts: the expanded prompt holds exactly sum(t * h * w / merge^2) placeholders
    proc = QwenImageProcessor(QWEN35_PREPROCESSOR)
    out = proc([noise(60, 40), noise(90, 300, seed=3)])
    expanded = expand_image_placeholders(ids, pad, out.num_tokens)
    m2 = proc.merge_size ** 2
    assert expanded.count(pad) == sum(out.num_tokens) == sum(t * h * w // m2 for t, h, w in
                                                            out.image_grid_thw.tolist())
    assert len(expanded) == len(ids) - 2 + sum(out.num_tokens)
    first = expanded.index(pad)
    assert expanded[first:first + out.num_tokens[0]] == [pad] * out.num_tokens[0]
    assert expanded[first + out.num_tokens[0]] == 151653
