"""GGUF checkpoints through the `gguf` package: dequantised to float32 at load and renamed to HF names.

llama.cpp's converter permutes the rows of Q and K for Llama (interleaved rotary); we undo that so the weights
match the HF (rotate-half) layout our models and transformers use.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

_LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's permute(): rows grouped [head, 2, D/2] back to [head, D/2, 2] order."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_hf_name(name: str) -> str | None:
    m = re.match(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$", name)
    if m:
        layer, kind, wb = m.groups()
        if kind not in _LAYER_MAP:
            return None
        return f"model.layers.{layer}.{_LAYER_MAP[kind]}.{wb}"
    m = re.match(r"([a-z_]+)\.(weight|bias)$", name)
    if m and m.group(1) in _TOP_MAP:
        return f"{_TOP_MAP[m.group(1)]}.{m.group(2)}"
    return None


def iter_gguf(path: str, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    for t in reader.tensors:
        hf = gguf_hf_name(t.name)
        if hf is None:
            raise ValueError(f"GGUF tensor {t.name!r} has no known HF name")
        w = dequantize(t.data, t.tensor_type)
        if arch == "llama" and hf.endswith("q_proj.weight"):
            w = _unpermute(w, num_heads)
        elif arch == "llama" and hf.endswith("k_proj.weight"):
            w = _unpermute(w, num_kv_heads)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if not w.flags.writeable:  # float32 tensors come back as read-only views of the memory-mapped file
            w = w.copy()
        yield hf, torch.from_numpy(w)
