"""Output logprobs in the OpenAI shapes: chat `logprobs.content` entries, and the legacy completions `logprobs`.

The engine gives each output token's logprob and, when asked, the most likely tokens' (engine/logit_rules.py says
of which distribution). Here they get their token strings: a token is shown as the tokenizer decodes it alone, and
`bytes` are that string's UTF-8 bytes (a token holding part of a character decodes to U+FFFD, as in vLLM).
"""

from __future__ import annotations

from collections.abc import Callable

Decode = Callable[[int], str]


def token_decoder(tokenizer) -> Decode:
    """A token id -> its text alone, memoised (a vocabulary's tokens repeat across a long answer)."""
    cache: dict[int, str] = {}

    def decode(tok: int) -> str:
        s = cache.get(tok)
        if s is None:
            s = cache[tok] = tokenizer.decode([tok])
        return s

    return decode


def chat_logprobs(ids: list[int], logprobs: list[float], top: list | None, decode: Decode) -> dict:
    """choices[i].logprobs of a chat answer (or of one streamed chunk's tokens): {"content": [...]}."""
    content = []
    for i, (tok, lp) in enumerate(zip(ids, logprobs)):
        s = decode(tok)
        entry = {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []}
        if top:
            entry["top_logprobs"] = [{"token": (ts := decode(t)), "logprob": v, "bytes": list(ts.encode("utf-8"))}
                                     for t, v in top[i]]
        content.append(entry)
    return {"content": content}


def completion_logprobs(ids: list[int], logprobs: list[float], top: list | None, decode: Decode,
                        text_offset0: int = 0) -> dict:
    """choices[i].logprobs of a legacy completion: tokens, token_logprobs, top_logprobs (one {token: logprob} per
    position, None without top), text_offset (each token's start in the choice's text, from text_offset0)."""
    tokens = [decode(t) for t in ids]
    offsets, at = [], text_offset0
    for s in tokens:
        offsets.append(at)
        at += len(s)
    tops = [{decode(t): v for t, v in pos} for pos in top] if top else None
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": tops, "text_offset": offsets}
