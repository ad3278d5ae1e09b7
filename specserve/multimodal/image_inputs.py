"""Client image references -> decoded, checked RGB images (`ImageInput`), or a 400 that says what is wrong.

What a request may send (the routes call these; nothing here touches the engine):
  * OpenAI chat content parts `{"type": "image_url", "image_url": {"url": ..., "detail": ...}}` (chat_image_refs);
  * SGLang's /generate `image_data`: one reference or a list of them for a prompt, one entry per prompt for a batch
    (generate_image_refs).
Every refusal raises ImageInputError (a ValueError); the server turns it into a 400 (server/image_inputs.py).
A reference is
  * a data URL `data:image/(png|jpeg|jpg|webp|gif);base64,...`;
  * bare base64 (SGLang's convention: a string with no URL scheme and no "." is base64; "." never occurs in base64);
  * a local file, as a `file://` URL or a plain path (a string with a "." and no scheme; SGLang's test is "ends in an
    image extension", which this includes): read only inside --allowed-local-media-path, once symlinks are resolved;
    a relative path is taken relative to that directory;
  * any other URL (http, https, ftp, s3, ...): refused. The server never fetches anything: the scheme is looked at
    before anything else, so no name is resolved and no socket is opened for such a reference.

Why so strict: a decode is the costliest thing a client can make the HTTP server do, so every limit is checked
before the work it bounds. The count (--max-images-per-request) before any image is read; the encoded size
(--max-encoded-image-mb) before base64 is decoded (from the text's length) or a file is read (from its size); the
pixel count (--max-image-pixels) from the header that `Image.open` parses, before `load()` decodes the pixels (Pillow's
own decompression-bomb check, at twice Image.MAX_IMAGE_PIXELS, refuses the most absurd headers even earlier).

Formats: PNG, JPEG, WebP and GIF, the ones OpenAI's vision API takes; `Image.open(formats=...)` never even tries the
other decoders (BMP, TIFF, ICO, ... get a 400). Animated images (GIF, WebP, APNG) are refused rather than cut to their
first frame, as OpenAI refuses animated GIFs: the model would answer about a frame the client did not choose. A JPEG
carrying extra pictures (MPO, as phone cameras write) is its primary picture. The EXIF orientation is applied (as
transformers' load_image does), so the model sees the picture the way viewers show it. Transparency is composited
onto white, as transformers' convert_to_rgb does; 16-bit greyscale is scaled to 8 bits (Pillow's "RGB" conversion
would clip it to white).

Every Pillow error becomes a 400 naming the problem in our words (not a library message, never a traceback); the
image's place in the request (`where`, e.g. "messages[1].content[0].image_url") leads the message and is its param.

The public functions are synchronous and CPU-bound (Pillow releases the GIL while decoding): the routes run them on a
worker thread, never on the event loop.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

if TYPE_CHECKING:
    from specserve.server_args import ServerArgs

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # Pillow's names of the formats we decode
FORMAT_NAMES = "PNG, JPEG, WebP or GIF"
DATA_URL_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")
DETAILS = ("auto", "low", "high")  # OpenAI's image_url.detail values (accepted; the checkpoint's processor decides)
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")  # RFC 3986 scheme; base64 never has ":", a plain path rarely
_WHITESPACE = re.compile(rb"\s+")
_DATA_HEADER_MAX = 256  # "data:<type>;<params>;base64," is short; don't scan a 20 MiB string for its comma
_SHOWN_CHARS = 120  # a client's path is quoted in messages up to this many characters


class ImageInputError(ValueError):
    """A client's image (or image list) is unusable: `str(e)` says why in words fit for a client (never a library
    message), `param` names where in the request. The server answers it with a 400 (server/image_inputs.py)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class ImageLimits:
    """The per-request image limits (ServerArgs' flags); `local_root` is the real path (symlinks resolved) of
    --allowed-local-media-path, None when local files are not allowed."""

    max_images: int = 32
    max_pixels: int = 1 << 25
    max_bytes: int = 20 << 20
    local_root: str | None = None

    def __post_init__(self) -> None:
        if self.local_root is not None:
            root = os.path.realpath(self.local_root)
            if not os.path.isdir(root):
                raise ValueError(f"--allowed-local-media-path {self.local_root!r} is not a directory")
            object.__setattr__(self, "local_root", root)

    @classmethod
    def from_args(cls, args: ServerArgs) -> ImageLimits:
        """The limits the flags set (ValueError at startup when --allowed-local-media-path is not a directory)."""
        return cls(max_images=args.max_images_per_request, max_pixels=args.max_image_pixels,
                   max_bytes=int(args.max_encoded_image_mb * (1 << 20)), local_root=args.allowed_local_media_path)


@dataclass(frozen=True)
class ImageRef:
    """One image reference as the client sent it, and where in the request (messages' and params' prefix)."""

    url: str
    where: str
    detail: str | None = None


@dataclass(frozen=True, eq=False)
class ImageInput:
    """A decoded image: RGB, EXIF orientation applied, pixels loaded.

    `hash`: sha256 (hex) of the size and the RGB pixels, so the same picture hashes the same whatever its encoding
    (PNG or lossless WebP, data URL or file) and the prefix cache can key image tokens on it."""

    image: Image.Image
    width: int
    height: int
    hash: str
    format: str  # the encoding it came in (PNG, JPEG, WEBP, GIF)
    where: str


# ---------------------------------------------------------------------------------------------- collecting references
def _part_field(part: Any, name: str) -> Any:
    """A content part's field, from a dict or a pydantic model (protocol.ContentPart keeps unknown fields)."""
    if isinstance(part, dict):
        return part.get(name)
    return getattr(part, name, None)


def _ref_from_image_url(value: Any, where: str) -> ImageRef:
    """OpenAI's image_url object {"url", "detail"}; a bare string is taken as the url (some clients send that)."""
    if isinstance(value, str):
        return ImageRef(value, where)
    if not isinstance(value, dict) or not isinstance(value.get("url"), str):
        raise ImageInputError(f"{where} must be an object with a string 'url' (a data URL such as "
                          "data:image/png;base64,...)", param=where)
    detail = value.get("detail")
    if detail is not None and detail not in DETAILS:
        raise ImageInputError(f"{where}.detail must be one of {', '.join(DETAILS)}", param=f"{where}.detail")
    return ImageRef(value["url"], where, detail)


def chat_image_refs(messages: Sequence[Any]) -> list[ImageRef]:
    """The image references of a chat request's messages (protocol.ChatMessage objects or dicts), in order: the
    order the chat template writes their placeholders in. Parts of other types are not looked at."""
    refs = []
    for i, msg in enumerate(messages):
        content = _part_field(msg, "content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if _part_field(part, "type") == "image_url":
                where = f"messages[{i}].content[{j}].image_url"
                refs.append(_ref_from_image_url(_part_field(part, "image_url"), where))
    return refs


def _generate_item(item: Any, where: str) -> ImageRef:
    if isinstance(item, str):
        return ImageRef(item, where)
    if isinstance(item, dict) and isinstance(item.get("url"), str):  # {"url": ...}, as OpenAI's image_url
        return _ref_from_image_url(item, where)
    raise ImageInputError(f"{where} must be a string: a data URL (data:image/png;base64,...), base64 or a local file "
                      "path", param=where)


def _generate_prompt_refs(value: Any, where: str) -> list[ImageRef]:
    """One prompt's image_data: None, one reference, or a list of them."""
    if value is None:
        return []
    if isinstance(value, list):
        return [_generate_item(x, f"{where}[{k}]") for k, x in enumerate(value)]
    return [_generate_item(value, where)]


def generate_image_refs(image_data: Any, num_prompts: int | None) -> list[list[ImageRef]]:
    """SGLang's /generate `image_data` -> each prompt's references.

    num_prompts None: the request has one prompt (text or input_ids not a batch), and image_data is one reference or
    a list of them. num_prompts k (a batch): a list of k entries, one per prompt (each None, a reference or a list of
    them); a single reference (not a list) is every prompt's image, as SGLang broadcasts it."""
    if num_prompts is None:
        return [_generate_prompt_refs(image_data, "image_data")]
    if image_data is None:
        return [[] for _ in range(num_prompts)]
    if not isinstance(image_data, list):
        return [_generate_prompt_refs(image_data, "image_data")] * num_prompts
    if len(image_data) != num_prompts:
        raise ImageInputError(f"image_data has {len(image_data)} entries for {num_prompts} prompts: give one per "
                              "prompt "
                          "(None, an image or a list of images)", param="image_data")
    return [_generate_prompt_refs(x, f"image_data[{k}]") for k, x in enumerate(image_data)]


def check_image_count(count: int, limits: ImageLimits, param: str | None = None) -> None:
    """`count` images within --max-images-per-request (raises 400); called before any image is read."""
    if count > limits.max_images:
        raise ImageInputError(f"the request has {count} images; at most {limits.max_images} are allowed "
                          "(--max-images-per-request)", param=param)


# ------------------------------------------------------------------------------------------------------ loading
def load_chat_images(messages: Sequence[Any], limits: ImageLimits) -> list[ImageInput]:
    """A chat request's images, decoded in message order (400 for the first bad one, or too many)."""
    refs = chat_image_refs(messages)
    check_image_count(len(refs), limits, param="messages")
    return [load_image(r, limits) for r in refs]


def load_generate_images(image_data: Any, num_prompts: int | None, limits: ImageLimits) -> list[list[ImageInput]]:
    """/generate's images, decoded per prompt (generate_image_refs). Every prompt's images count towards
    --max-images-per-request (each is encoded with its prompt); a reference shared by several prompts is decoded
    once."""
    per_prompt = generate_image_refs(image_data, num_prompts)
    check_image_count(sum(len(p) for p in per_prompt), limits, param="image_data")
    decoded: dict[int, ImageInput] = {}
    out = []
    for refs in per_prompt:
        images = []
        for r in refs:
            if id(r) not in decoded:  # the same ImageRef object: the broadcast of one reference to every prompt
                decoded[id(r)] = load_image(r, limits)
            images.append(decoded[id(r)])
        out.append(images)
    return out


def load_image(ref: ImageRef | str, limits: ImageLimits) -> ImageInput:
    """One reference -> its decoded image (module docstring); ImageInputError for anything wrong with it."""
    if isinstance(ref, str):
        ref = ImageRef(ref, "image")
    url = ref.url.strip()
    if not url:
        raise _bad(ref, "is empty: send a data URL (data:image/png;base64,...)")
    # The scheme first, before any other look at the string: a URL we do not read is refused here, so no name is
    # ever resolved and no connection ever opened for it.
    m = _SCHEME.match(url, 0, 64)  # a scheme is short; don't scan a long base64 string for a ":" it cannot hold
    if m is not None:
        scheme = m.group(1).lower()
        if scheme == "data":
            return decode_image_bytes(_data_url_bytes(url, ref, limits), ref, limits)
        if scheme == "file":
            return decode_image_bytes(_read_local(_file_url_path(url, ref), ref, limits), ref, limits)
        raise _bad(ref, f"is a {scheme}: URL, and this server does not fetch URLs: send the image inline as a data URL "
                        "(data:image/png;base64,...)")
    if "." in url:  # never in base64: a path with an extension
        return decode_image_bytes(_read_local(url, ref, limits), ref, limits)
    return decode_image_bytes(_b64decode(url, ref, limits, "is neither a URL nor valid base64 (a local path needs a "
                                                          "file extension or a file:// URL)"), ref, limits)


def _bad(ref: ImageRef, problem: str) -> ImageInputError:
    return ImageInputError(f"{ref.where} {problem}", param=ref.where)


def _shown(text: str) -> str:
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


def _too_large(ref: ImageRef, limits: ImageLimits, size: int | None = None) -> ImageInputError:
    has = "" if size is None else f" ({_mib(size)})"
    return _bad(ref, f"is larger{has} than the {_mib(limits.max_bytes)} an image may have (--max-encoded-image-mb)")


def _data_url_bytes(url: str, ref: ImageRef, limits: ImageLimits) -> bytes:
    comma = url.find(",", 0, _DATA_HEADER_MAX)
    if comma < 0:
        raise _bad(ref, "is not a data URL of the form data:image/png;base64,...")
    params = [p.strip().lower() for p in url[len("data:"):comma].split(";")]
    media_type = params[0]
    if media_type not in DATA_URL_TYPES:
        raise _bad(ref, f"has media type {_shown(media_type)}: send image/png, image/jpeg, image/webp or image/gif")
    if "base64" not in params[1:]:
        raise _bad(ref, "must be base64-encoded (data:image/png;base64,...)")
    # The declared type is not held against the bytes: clients often label any image image/jpeg; the bytes
    # themselves must be one of the allowed formats.
    return _b64decode(url[comma + 1:], ref, limits, "is not valid base64 after 'base64,'")


def _b64decode(text: str, ref: ImageRef, limits: ImageLimits, invalid: str) -> bytes:
    """Base64 text -> bytes, refused before decoding when the bytes would exceed the cap. Whitespace (line breaks
    of MIME-style base64) is dropped, missing padding added, the URL-safe alphabet taken too."""
    max_chars = 4 * -(-limits.max_bytes // 3)
    if len(text) > 2 * max_chars + 1024:  # more than whitespace could account for: refuse before copying it
        raise _too_large(ref, limits)
    try:
        raw = text.encode("ascii")
    except UnicodeEncodeError:
        raise _bad(ref, invalid) from None
    if _WHITESPACE.search(raw):
        raw = _WHITESPACE.sub(b"", raw)
    padding = len(raw[-2:]) - len(raw[-2:].rstrip(b"="))
    size = (len(raw) - padding) * 3 // 4  # the decoded length (what valid base64 of this length holds)
    if size > limits.max_bytes:
        raise _too_large(ref, limits, size)
    if b"-" in raw or b"_" in raw:
        raw = raw.translate(bytes.maketrans(b"-_", b"+/"))
    raw += b"=" * (-len(raw) % 4)
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(ref, invalid) from None
    if not data:
        raise _bad(ref, "is empty: it holds no image bytes")
    return data


def _file_url_path(url: str, ref: ImageRef) -> str:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _bad(ref, "is a file URL naming another host: only local files (file:///path) can be read")
    return unquote(parts.path)


def _read_local(path: str, ref: ImageRef, limits: ImageLimits) -> bytes:
    """A file's bytes, if it lies inside --allowed-local-media-path once every symlink is resolved (a relative path
    is taken relative to that directory)."""
    root = limits.local_root
    if root is None:
        raise _bad(ref, "names a local file, and local files are not allowed (the server was started without "
                        "--allowed-local-media-path): send the image inline as a data URL (data:image/png;base64,...)")
    if not path or "\x00" in path:
        raise _bad(ref, "is not a valid file path")
    real = os.path.realpath(os.path.join(root, path))  # an absolute path replaces root in the join
    if os.path.commonpath([real, root]) != root:
        raise _bad(ref, f"names a file outside the allowed local media directory: {_shown(path)}")
    # O_NOFOLLOW: the checked path has no symlink left, so one that appears now (swapped in) is refused, not followed.
    # O_NONBLOCK: opening a FIFO must not wait for a writer (it is then refused as not a regular file).
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise _bad(ref, f"names a file that does not exist: {_shown(path)}") from None
    except PermissionError:
        raise _bad(ref, f"names a file the server may not read: {_shown(path)}") from None
    except OSError:
        raise _bad(ref, f"names a file that could not be opened: {_shown(path)}") from None
    try:
        st = os.fstat(fd)  # before fdopen, which raises on a directory
        if not stat.S_ISREG(st.st_mode):
            raise _bad(ref, f"does not name a regular file: {_shown(path)}")
        if st.st_size > limits.max_bytes:
            raise _too_large(ref, limits, st.st_size)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limits.max_bytes + 1)
    except OSError:
        raise _bad(ref, f"names a file that could not be read: {_shown(path)}") from None
    finally:
        os.close(fd)
    if len(data) > limits.max_bytes:  # it grew after fstat
        raise _too_large(ref, limits)
    if not data:
        raise _bad(ref, f"names an empty file: {_shown(path)}")
    return data


# ------------------------------------------------------------------------------------------------------ decoding
def decode_image_bytes(data: bytes, ref: ImageRef, limits: ImageLimits) -> ImageInput:
    """An encoded image (PNG, JPEG, WebP, GIF) -> ImageInput, every limit checked before the pixels are decoded."""
    if len(data) > limits.max_bytes:
        raise _too_large(ref, limits, len(data))
    try:
        img = Image.open(io.BytesIO(data), formats=list(FORMATS))  # parses the header only
    except Image.DecompressionBombError:  # Pillow's own cap (twice Image.MAX_IMAGE_PIXELS), far above ours
        raise _too_many_pixels(ref, limits, None) from None
    except UnidentifiedImageError:
        raise _bad(ref, f"is not a {FORMAT_NAMES} image") from None
    except Exception:  # a header Pillow cannot parse (SyntaxError, struct.error, ValueError, ...)
        raise _bad(ref, f"is not a readable {FORMAT_NAMES} image (its header is corrupt)") from None
    # No `with img`: closing an image frees its pixels, and the RGB image returned may be this very object. The
    # bytes are in memory (BytesIO): no file to close, and a loaded single-frame image lets go of them.
    width, height = img.size
    if width * height > limits.max_pixels:
        raise _too_many_pixels(ref, limits, (width, height))
    if width < 1 or height < 1:
        raise _bad(ref, f"has no pixels ({width}x{height})")
    fmt = "JPEG" if img.format == "MPO" else img.format  # MPO: a JPEG with extra pictures, the first is the photo
    shown = "WebP" if fmt == "WEBP" else fmt
    if img.format != "MPO" and _is_animated(img):
        raise _bad(ref, f"is an animated {shown} image: animated images are not supported, send one frame as PNG, "
                        "JPEG or WebP")
    try:
        img.load()  # the decode: the only step whose cost the pixel cap bounds
    except Image.DecompressionBombError:
        raise _too_many_pixels(ref, limits, None) from None
    except Exception as e:  # OSError (truncated, broken data stream), SyntaxError, zlib errors, ...
        problem = "is truncated" if "truncated" in str(e).lower() else "could not be decoded"
        raise _bad(ref, f"{problem} (a corrupt {shown} image)") from None
    try:
        _upright(img)
        rgb = _to_rgb(img)
    except Exception:
        raise _bad(ref, f"could not be converted to RGB (a corrupt or unusual {shown} image)") from None
    width, height = rgb.size  # a quarter turn (EXIF orientation) swaps them
    return ImageInput(image=rgb, width=width, height=height, hash=pixel_hash(rgb), format=fmt, where=ref.where)


def _too_many_pixels(ref: ImageRef, limits: ImageLimits, size: tuple[int, int] | None) -> ImageInputError:
    has = "" if size is None else f" ({size[0]}x{size[1]} = {size[0] * size[1]:,})"
    return _bad(ref, f"has more pixels{has} than the {limits.max_pixels:,} an image may have (--max-image-pixels)")


def _is_animated(img: Image.Image) -> bool:
    try:
        return bool(getattr(img, "is_animated", False))  # GIF: looks for a second frame without decoding the first
    except Exception:  # a frame table Pillow cannot follow: the decode will say what is wrong
        return False


def _upright(img: Image.Image) -> None:
    """Turns the (loaded) image in place as its EXIF orientation says; EXIF that cannot be read is ignored (it is
    metadata, the pixels are fine)."""
    with contextlib.suppress(Exception):
        ImageOps.exif_transpose(img, in_place=True)


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        return img
    if img.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):  # 16-bit greyscale (PNG): keep the top 8 bits
        grey = np.clip(np.asarray(img, dtype=np.int64), 0, 65535) >> 8
        return Image.fromarray(grey.astype(np.uint8), "L").convert("RGB")
    if "A" in img.getbands() or "transparency" in img.info:  # onto white, as transformers' convert_to_rgb
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def pixel_hash(img: Image.Image) -> str:
    """sha256 (hex) of an RGB image's size and pixels: equal exactly when the model would see the same picture."""
    if img.mode != "RGB":
        raise ValueError(f"pixel_hash takes an RGB image, got mode {img.mode}")
    h = hashlib.sha256(f"RGB {img.width}x{img.height}\n".encode())
    h.update(img.tobytes())
    return h.hexdigest()
