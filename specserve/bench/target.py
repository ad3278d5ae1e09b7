"""What a client needs to know about the server it measures: its URL, model name, tokenizer and the accept length
it reports; and /flush_cache before a run. Small synchronous queries (stdlib urllib) made before and after a run,
never during one."""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Keys under which servers report a speculative accept length in /get_server_info: SGLang puts
# "avg_spec_accept_length" in internal_states[0]; others use the shorter names.
ACCEPT_LENGTH_KEYS = ("avg_spec_accept_length", "spec_accept_length", "accept_length")


def base_url(host: str, port: int, url: str | None) -> str:
    """--base-url wins over --host/--port; a trailing "/v1" is dropped since routes are added with their prefix."""
    if url:
        url = url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url
    return f"http://{host}:{port}"


def fetch_json(url: str, headers: dict | None = None, timeout: float = 30.0) -> dict | None:
    """GET url as JSON; None when the route is missing or the server cannot be reached (the caller decides
    whether that matters)."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read().decode("utf-8"))
    except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as e:
        logger.debug("GET %s failed: %s", url, e)
        return None


def flush_cache(base: str, headers: dict | None = None, timeout: float = 60.0) -> str | None:
    """POST /flush_cache (SGLang's and specserve's: empty the prefix cache, refused while requests run). None when it
    worked, else why not (the status and the server's text, or the connection error)."""
    req = urllib.request.Request(base + "/flush_cache", data=b"", method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return None
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read().decode('utf-8', 'replace').strip()[:300]}"
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        return str(e)


def discover_model(base: str, headers: dict | None = None) -> tuple[str | None, dict | None]:
    """The served model name (first id of /v1/models, else /get_model_info's served_model_name / model_path) and
    the /get_model_info object (None when the server has no such route)."""
    info = fetch_json(base + "/get_model_info", headers)
    models = fetch_json(base + "/v1/models", headers)
    if models and models.get("data"):
        return models["data"][0].get("id"), info
    if info:
        return info.get("served_model_name") or info.get("model_path"), info
    return None, info


def _tokenizer_from_path(path: str):
    from transformers import AutoTokenizer

    from specserve.models.loader import ModelSource
    from specserve.tokenizer import load_tokenizer

    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")) and any(
            os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(path)  # a bare tokenizer folder
    if os.path.exists(path):
        return load_tokenizer(ModelSource.resolve(path))  # a checkpoint folder or a .gguf file
    return AutoTokenizer.from_pretrained(path)  # a hub id (needs network)


def local_model_dir(explicit: str | None, model_info: dict | None) -> str | None:
    """The first folder here among --tokenizer, the server's tokenizer_path and model_path (None: none is local):
    where the image dataset looks for the checkpoint's image preprocessor config."""
    info = model_info or {}
    for p in (explicit, info.get("tokenizer_path"), info.get("model_path")):
        if p and os.path.isdir(p):
            return p
    return None


def resolve_tokenizer(explicit: str | None, model_info: dict | None):
    """--tokenizer when given; else the server's tokenizer_path / model_path when that path exists here; else the
    embedded default model's GGUF when the server serves it. Raises ValueError with what to pass otherwise."""
    from specserve.defaults import EMBEDDED_GGUF, embedded_model_path

    if explicit:
        return _tokenizer_from_path(explicit)
    candidates = [p for p in ((model_info or {}).get("tokenizer_path"), (model_info or {}).get("model_path")) if p]
    for p in candidates:
        if os.path.exists(p):
            return _tokenizer_from_path(p)
    if any(p.startswith("embedded:") or os.path.basename(p.rstrip("/")) == EMBEDDED_GGUF for p in candidates):
        return _tokenizer_from_path(embedded_model_path())
    if candidates:
        raise ValueError(f"the server's model {candidates[0]!r} is not a local path here (a server shows its whole "
                         "model path only when started with --show-internal-info); pass --tokenizer")
    raise ValueError("the server has no /get_model_info; pass --tokenizer (an HF folder or a .gguf file)")


def find_accept_length(obj) -> float | None:
    """The first positive accept-length value found in a /get_server_info object (depth-first)."""
    if isinstance(obj, dict):
        for k in ACCEPT_LENGTH_KEYS:
            v = obj.get(k)
            # 0 is what servers report without speculation (or before the first verify): not an accept length
            if isinstance(v, int | float) and not isinstance(v, bool) and v > 0:
                return float(v)
        children = list(obj.values())
    elif isinstance(obj, list):
        children = obj
    else:
        return None
    for child in children:
        v = find_accept_length(child)
        if v is not None:
            return v
    return None


def server_accept_length(base: str, headers: dict | None = None) -> float | None:
    """The accept length the server itself reports (cumulative over its lifetime, warm-up included)."""
    return find_accept_length(fetch_json(base + "/get_server_info", headers))


@dataclass
class SpecCounters:
    """A server's lifetime speculation counters: verify steps and the accept length over them (specserve reports
    both in /get_server_info; other servers may report only the length)."""

    accept_length: float | None
    verify_ct: int | None

    @staticmethod
    def read(base: str, headers: dict | None = None) -> SpecCounters:
        info = fetch_json(base + "/get_server_info", headers)
        ct = info.get("spec_verify_ct") if isinstance(info, dict) else None
        return SpecCounters(find_accept_length(info), ct if isinstance(ct, int) and not isinstance(ct, bool) else None)


def run_accept_length(before: SpecCounters, after: SpecCounters) -> tuple[float | None, str]:
    """The server-side accept length of what ran between two readings, and what it is: "run" when the server
    reports verify counts (tokens accepted over the interval / its verify steps), else "lifetime" (cumulative since
    the server started, warm-up and earlier runs included)."""
    if None not in (before.verify_ct, after.verify_ct, before.accept_length, after.accept_length) \
            and after.verify_ct > before.verify_ct:
        tokens = after.accept_length * after.verify_ct - before.accept_length * before.verify_ct
        return tokens / (after.verify_ct - before.verify_ct), "run"
    return after.accept_length, "lifetime"
