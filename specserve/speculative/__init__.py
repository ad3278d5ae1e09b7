"""Speculative decoding: chain drafting with an MTP/EAGLE head, lossless verification, the spec step."""
