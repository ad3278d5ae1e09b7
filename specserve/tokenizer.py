"""Tokenizer and chat template through transformers (also read from GGUF files)."""

from __future__ import annotations

import os

from specserve.models.loader import ModelSource


def load_tokenizer(src: ModelSource, tokenizer_path: str | None = None, chat_template: str | None = None):
    from transformers import AutoTokenizer

    if tokenizer_path:
        tok = AutoTokenizer.from_pretrained(tokenizer_path)
    elif src.is_gguf:
        tok = AutoTokenizer.from_pretrained(src.folder, gguf_file=src.gguf_file)
    else:
        tok = AutoTokenizer.from_pretrained(src.folder)
    if chat_template:
        if os.path.isfile(chat_template):
            with open(chat_template) as f:
                chat_template = f.read()
        tok.chat_template = chat_template
    return tok


def eos_token_ids(tokenizer, config_eos: list[int], generation_config: dict | None) -> set[int]:
    ids = set(config_eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = (generation_config or {}).get("eos_token_id")
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, list):
        ids.update(int(x) for x in gen_eos)
    return ids
