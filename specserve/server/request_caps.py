"""The caps the HTTP server puts on one request's prompts before anything is tokenised or reaches the engine:
characters a context can hold, prompts (and choices) a request, prompt tokens a request, n. Each check raises a 400
naming the flag that sets the cap (TokenizerManager.caps)."""

from __future__ import annotations

from specserve.server.errors import bad_request
from specserve.server_args import ServerArgs


class RequestCaps:
    def __init__(self, args: ServerArgs, tokenizer, context_len: int):
        self.args = args
        self.context_len = context_len
        # No token covers more characters than the longest vocabulary entry, so a text longer than this cannot
        # fit the context: it is refused without being tokenised.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer is not None else 1
        self.max_token_chars = max(longest, 1)
        self.max_prompt_chars = context_len * self.max_token_chars
        self.max_request_tokens = args.max_request_prompt_tokens or 4 * context_len

    def check_text(self, text: str, param: str = "prompt") -> None:
        """A prompt the tokenizer can take and the context can hold, checked without tokenising (raises 400)."""
        if not text:
            raise bad_request("the prompt is empty", param=param)
        if len(text) > self.max_prompt_chars:
            raise bad_request(f"the prompt has {len(text)} characters, more than a context of "
                              f"{self.context_len} tokens can hold", param=param)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad_request(f"the text is not valid Unicode: {e.reason} at character {e.start} (a lone "
                              "surrogate escape such as \\ud800?)", param=param) from None

    def check_prompt_count(self, prompts: int, choices: int | None = None, param: str = "prompt") -> None:
        """A batch of `prompts` prompts (`choices` in all, counting n of each; None: one each) within
        --max-prompts-per-request (raises 400); called before any of them is tokenised."""
        cap = self.args.max_prompts_per_request
        total = prompts if choices is None else choices
        if total > cap:
            what = f"{prompts} prompts" if total == prompts else f"{prompts} prompts, {total} choices in all (n)"
            raise bad_request(f"the request has {what}; at most {cap} are allowed (--max-prompts-per-request)",
                              param=param)

    def check_prompt_chars(self, texts: list[str], param: str = "prompt") -> None:
        """Texts that together may fit --max-request-prompt-tokens, checked without tokenising: no token covers more
        characters than the longest vocabulary entry, so longer text cannot fit (raises 400)."""
        chars = sum(len(t) for t in texts)
        if chars > self.max_request_tokens * self.max_token_chars:
            raise bad_request(f"the request's prompts have {chars} characters, more than "
                              f"{self.max_request_tokens} tokens can hold (--max-request-prompt-tokens)", param=param)

    def check_prompt_tokens(self, prompts: list[list[int]], param: str = "prompt") -> None:
        tokens = sum(len(p) for p in prompts)
        if tokens > self.max_request_tokens:
            raise bad_request(f"the request's prompts have {tokens} tokens; at most {self.max_request_tokens} are "
                              "allowed (--max-request-prompt-tokens)", param=param)

    def check_n(self, n, param: str = "n") -> int:
        """n (None: 1) within 1..--max-n (raises 400)."""
        n = 1 if n is None else n
        cap = self.args.max_n
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cap:
            raise bad_request(f"{param} must be an integer in [1, {cap}] (--max-n), got {n!r}", param=param)
        return n
