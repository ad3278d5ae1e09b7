"""specserve: LLM serving with lossless MTP/EAGLE speculative decoding, every GPU phase a CUDA graph."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Engine", "ServerArgs", "__version__"]


def __getattr__(name):
    # Lazy: `specserve --help` and the HTTP front end should not pay for importing torch.
    if name == "Engine":
        from specserve.engine.engine import Engine

        return Engine
    if name == "ServerArgs":
        from specserve.server_args import ServerArgs

        return ServerArgs
    raise AttributeError(name)
