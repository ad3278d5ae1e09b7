"""The server's face of specserve/multimodal/image_processing.py: the same processor and placeholder expansion, an
ImageInputError answered as an APIError 400."""

from __future__ import annotations

from collections.abc import Sequence

from PIL import Image

from specserve.multimodal import image_processing as _mm
from specserve.multimodal.image_processing import MAX_ASPECT_RATIO, ProcessedImages  # noqa: F401  re-exported
from specserve.server.image_inputs import ImageInput, as_400


class QwenImageProcessor(_mm.QwenImageProcessor):
    """multimodal's processor; a refused image is a 400."""

    def __call__(self, images: Sequence[ImageInput | Image.Image]) -> ProcessedImages:
        return as_400(super().__call__)(images)


expand_image_placeholders = as_400(_mm.expand_image_placeholders)
