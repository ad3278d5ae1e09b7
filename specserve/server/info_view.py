"""What the info routes (/v1/models, /get_model_info, /get_server_info) may show a client.

By default no absolute path, process id or internal address leaves the server: a path-valued argument shows only
its last component (the model's directory name, which /v1/models' `root` has always carried), the engine's pid and
--dist-init-addr are left out. --show-internal-info (an operator's flag) shows them as they are. The API key is never
shown.
"""

from __future__ import annotations

import dataclasses
import os

from specserve.server_args import ServerArgs

PATH_ARGS = ("model_path", "tokenizer_path", "chat_template", "speculative_draft_model_path", "speculative_token_map",
             "allowed_local_media_path")
HIDDEN_ARGS = ("dist_init_addr",)  # shown only with --show-internal-info
SECRET_ARGS = ("api_key", "extra")  # never shown


def shown_path(path: str | None, show_internal: bool) -> str | None:
    """`path` as the info routes show it: whole with --show-internal-info, else its last component."""
    if path is None or show_internal:
        return path
    return os.path.basename(os.path.normpath(path)) or path


def shown_args(args: ServerArgs) -> dict:
    """The server arguments /get_server_info shows."""
    out = dataclasses.asdict(args)
    for k in SECRET_ARGS:
        out.pop(k, None)
    if not args.show_internal_info:
        for k in PATH_ARGS:
            out[k] = shown_path(out[k], False)
        for k in HIDDEN_ARGS:
            out.pop(k, None)
    return out


def shown_runtime(runtime: dict, show_internal: bool) -> dict:
    """TokenizerManager.runtime_info() as the info routes show it."""
    if show_internal:
        return runtime
    out = {k: v for k, v in runtime.items() if k != "engine_pid"}
    out["speculative_draft_model_path"] = shown_path(out.get("speculative_draft_model_path"), False)
    return out
