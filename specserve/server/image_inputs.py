"""The server's face of specserve/multimodal/image_inputs.py: the same functions, every ImageInputError answered as
an APIError 400 (message and param kept). The decoding and its rules are documented there."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from specserve.multimodal import image_inputs as _mm
from specserve.multimodal.image_inputs import (  # noqa: F401  re-exported: the server's names stay where they were
    DATA_URL_TYPES,
    DETAILS,
    FORMAT_NAMES,
    FORMATS,
    ImageInput,
    ImageInputError,
    ImageLimits,
    ImageRef,
    pixel_hash,
)
from specserve.server.errors import APIError, bad_request

F = TypeVar("F", bound=Callable[..., Any])


def as_400(fn: F) -> F:
    """fn with ImageInputError raised as APIError(400, its message, its param)."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ImageInputError as e:
            raise to_api_error(e) from None

    return wrapped  # type: ignore[return-value]


def to_api_error(e: ImageInputError) -> APIError:
    return bad_request(e.message, param=e.param)


chat_image_refs = as_400(_mm.chat_image_refs)
generate_image_refs = as_400(_mm.generate_image_refs)
check_image_count = as_400(_mm.check_image_count)
load_chat_images = as_400(_mm.load_chat_images)
load_generate_images = as_400(_mm.load_generate_images)
load_image = as_400(_mm.load_image)
decode_image_bytes = as_400(_mm.decode_image_bytes)
