"""Reading prompts: an instruction over a long document (summarise it, list its points, rewrite it, ...).

Served prompts are often long documents the answer draws on (summaries, questions about a text), and a draft head
only learns to copy from such a context when its training sequences contain one, at the lengths it will serve.
Instruction files rarely have long prompts, but their records carry long texts in their answer fields; joined into
documents of a chosen length, they make prompts whose response the target then writes itself (self-distillation:
the head still learns only the target's own text).
"""

from __future__ import annotations

import random

from specserve.train.data import Prompt, read_records

DOC_FIELDS = ("response", "output", "answer", "completion", "reference")  # record fields holding a text
MIN_DOC_CHARS = 200  # shorter texts are not worth a document part

TEMPLATES = (
    "Summarize: {doc}",
    "Summarize the following text.\n\n{doc}",
    "Write a short summary of this text:\n\n{doc}",
    "List the main points of the text below.\n\n{doc}",
    "Read the text and explain in a few sentences what it is about.\n\n{doc}",
    "Rewrite the following text in simpler words.\n\n{doc}",
    "{doc}\n\nWhat are the key facts in the text above?",
    "{doc}\n\nGive this text a title and a one-paragraph summary.",
)


def record_texts(rec: dict) -> list[str]:
    """The long texts of one record's answer fields (a string, or the strings of a list)."""
    out = []
    for key in DOC_FIELDS:
        val = rec.get(key)
        vals = val if isinstance(val, list) else [val]
        out.extend(v.strip() for v in vals if isinstance(v, str) and len(v.strip()) >= MIN_DOC_CHARS)
    return out


def reading_prompts(paths: list[str], num: int, seed: int, min_chars: int, max_chars: int) -> list[Prompt]:
    """`num` prompts, each an instruction template around a document of random texts of one file joined until it
    reaches a length drawn uniformly from [min_chars, max_chars]. A prompt's file is drawn in proportion to the
    characters of text the file holds. Empty when the files hold no long texts."""
    if num <= 0:
        return []
    if not 0 < min_chars <= max_chars:
        raise ValueError("reading documents need 0 < min_chars <= max_chars")
    per_file = [[t for rec in read_records(path) for t in record_texts(rec)] for path in paths]
    per_file = [texts for texts in per_file if texts]
    if not per_file:
        return []
    weights = [sum(len(t) for t in texts) for texts in per_file]
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        texts = rng.choices(per_file, weights)[0]
        want = rng.randint(min_chars, max_chars)
        parts, size = [], 0
        while size < want and len(parts) < len(texts):
            t = texts[rng.randrange(len(texts))]
            if t in parts:
                continue
            parts.append(t)
            size += len(t) + 2
        doc = "\n\n".join(parts)
        out.append(Prompt([{"role": "user", "content": rng.choice(TEMPLATES).format(doc=doc)}], "reading"))
    return out
