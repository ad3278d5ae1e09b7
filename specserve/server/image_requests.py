"""A request's images on the HTTP side: whether the model takes images, decoding and preprocessing them off the event
loop, and expanding their placeholders in the prompt (TokenizerManager.images). Errors are 400s."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from specserve.multimodal.request_images import PreprocessedImages, preprocess_images
from specserve.server.errors import bad_request
from specserve.server.image_inputs import ImageInput, ImageLimits, as_400, load_chat_images
from specserve.server.image_processing import QwenImageProcessor, expand_image_placeholders
from specserve.server.messages import EngineInfo
from specserve.server.request_caps import RequestCaps
from specserve.server_args import ServerArgs


class ImageRequests:
    def __init__(self, args: ServerArgs, info: EngineInfo, caps: RequestCaps):
        self.info = info
        self.caps = caps
        self.limits = ImageLimits.from_args(args)
        self._processor = None  # the checkpoint's, built at the first image (server/image_processing.py)
        # Images are decoded and preprocessed on threads of their own (Pillow and NumPy release the GIL), so a
        # large image does not hold up the tokenising of other requests.
        self._worker = ThreadPoolExecutor(max_workers=2, thread_name_prefix="images")

    async def off_loop(self, fn: Callable, *args):
        """fn(*args) on an image worker thread (decoding and preprocessing images)."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    @property
    def takes_images(self) -> bool:
        return self.info.image_token_id is not None

    def check_takes_images(self, param: str) -> None:
        """400 when the model has no vision tower (a text-only model; images are also off under --tp-size > 1)."""
        if not self.takes_images:
            raise bad_request(f"this model does not take images ({self.info.architecture} has no vision tower); "
                              "send text only", param=param)

    def expand_images(self, input_ids: list[int], images: list[ImageInput],
                      param: str) -> tuple[list[int], PreprocessedImages | None]:
        """A prompt with one <|image_pad|> per image and its decoded images -> (the expanded prompt, the images
        preprocessed for the engine); 400 when the placeholders and the images differ in number or an image is
        refused. Synchronous and CPU-bound: run it with off_loop."""
        token = self.info.image_token_id
        if not images:
            if token is not None and token in input_ids:
                raise bad_request(f"the prompt holds {input_ids.count(token)} image placeholders but the request "
                                  "carries no images", param=param)
            return input_ids, None
        self.check_takes_images(param)
        if self._processor is None:
            try:
                self._processor = QwenImageProcessor.from_model_dir(self.info.image_folder)
            except (OSError, ValueError) as e:
                raise bad_request(f"this server cannot preprocess images: {e}", param=param) from None
        pre = as_400(preprocess_images)(images, self._processor)
        ids = expand_image_placeholders(list(input_ids), token, pre.num_tokens, param=param)
        return ids, pre

    def chat_images(self, messages: list, input_ids: list[int]) -> tuple[list[int], PreprocessedImages | None]:
        """A chat request's images (its messages' image_url parts) decoded, preprocessed and their placeholders in
        the rendered prompt expanded; the request caps checked on the expanded prompt. Raises 400."""
        decoded = load_chat_images(messages, self.limits)
        ids, pre = self.expand_images(input_ids, decoded, "messages")
        self.caps.check_prompt_tokens([ids], param="messages")
        return ids, pre
