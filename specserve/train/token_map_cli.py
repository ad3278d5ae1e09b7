"""`specserve token-map`: write a --speculative-token-map file (models/token_map.py) from text, best text the target
itself generated (e.g. `specserve generate --json` over representative prompts): the `--size` token ids that occur
most often, EOS and the tokenizer's special tokens always included (train/vocab.py build_draft_vocab).

    specserve token-map --model-path M --input answers.jsonl --field text --size 32768 --output map.pt
"""

from __future__ import annotations

import json
import os

import torch


def read_texts(path: str, field: str) -> list[str]:
    """A .jsonl file's `field` strings (a line without it is an error naming the line), or any other file whole."""
    with open(path, encoding="utf-8") as f:
        if not path.endswith(".jsonl"):
            return [f.read()]
        texts = []
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                raise ValueError(f"{path}:{n}: no string field {field!r}")
            texts.append(row[field])
        return texts


def main(argv: list[str] | None = None) -> int:
    from specserve.defaults import embedded_model_path
    from specserve.models.loader import ModelSource, load_hf_config
    from specserve.models.registry import config_from_hf
    from specserve.server_args import CommandParser
    from specserve.tokenizer import eos_token_ids, load_tokenizer
    from specserve.train.vocab import build_draft_vocab

    p = CommandParser(prog="specserve token-map", description="Write a --speculative-token-map file.")
    p.add_argument("--model-path", default=None, help="the target (its tokenizer and vocabulary); default embedded")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--input", action="append", required=True,
                   help="a text file, or a .jsonl file read by --field (repeat for more)")
    p.add_argument("--field", default="text", help="the .jsonl field holding the text (default: text)")
    p.add_argument("--size", type=int, required=True, help="how many token ids the map keeps")
    p.add_argument("--output", required=True, help="the map: .pt (an int64 tensor) or .json (a list)")
    args = p.parse_args(argv)
    if not args.output.endswith((".pt", ".json")):
        p.error("--output must end in .pt or .json")
    src = ModelSource.resolve(args.model_path or embedded_model_path())
    cfg = config_from_hf(load_hf_config(src))
    if not 0 < args.size < cfg.vocab_size:
        p.error(f"--size must be in 1..{cfg.vocab_size - 1} (the vocabulary has {cfg.vocab_size} tokens)")
    tok = load_tokenizer(src, args.tokenizer_path)
    seqs = []
    for path in args.input:
        if not os.path.isfile(path):
            p.error(f"--input {path!r}: no such file")
        try:
            seqs += [tok.encode(t, add_special_tokens=False) for t in read_texts(path, args.field)]
        except (ValueError, UnicodeDecodeError) as e:
            p.error(str(e))
    forced = eos_token_ids(tok, cfg.eos_token_ids, None) | set(tok.all_special_ids)
    vocab = build_draft_vocab(seqs, [], cfg.vocab_size, args.size, forced)
    if args.output.endswith(".json"):
        with open(args.output, "w") as f:
            json.dump(vocab.ids.tolist(), f)
    else:
        torch.save(vocab.ids, args.output)
    print(f"{args.output}: {vocab.size} of {cfg.vocab_size} token ids, covering {100 * vocab.coverage:.2f}% of the "
          f"{sum(map(len, seqs))} input tokens")
    return 0
