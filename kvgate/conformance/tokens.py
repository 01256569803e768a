"""Token ids and prefix keys, the same on every target.

Each target numbers `fresh` tokens with its own `FreshTokens`, starting from
the same value, so two targets replaying one trace see identical token ids.

A prefix key names "the state after these tokens" independently of how a
target hashes: the chained digest of the token ids up to a hash-unit
boundary. The model uses it as its block hash; the vLLM adapter maps vLLM's
block hashes to it, so snapshots of both compare directly.

With lookahead block hashes (L > 0, an EAGLE drafter's default in vLLM) a
block's key also covers the L tokens after it, so two prefixes share a key
only when they agree that far, and the key exists only once those tokens do.
The key's position stays the block's end.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

FIRST_FRESH_TOKEN = 1000


class FreshTokens:
    """Hands out token ids never used before in this replay."""

    def __init__(self, start: int = FIRST_FRESH_TOKEN) -> None:
        self._next = start

    def take(self, n: int) -> list[int]:
        first = self._next
        self._next += n
        return list(range(first, first + n))


def extend_prefix_keys(
    keys: list[str], tokens: Sequence[int], unit: int, lookahead: int = 0
) -> None:
    """Append to `keys` the key of every complete `unit` of `tokens` past them
    that has `lookahead` tokens after it.

    `keys[i]` names the prefix `tokens[: (i + 1) * unit + lookahead]` (ending
    at `(i + 1) * unit`); each digest chains over the one before, so the work
    is linear in the number of tokens.
    """
    parent = keys[-1].encode() if keys else b""
    for start in range(len(keys) * unit, len(tokens) - unit - lookahead + 1, unit):
        chunk = array("q", tokens[start : start + unit + lookahead]).tobytes()
        digest = hashlib.blake2b(parent + chunk, digest_size=8).hexdigest()
        key = f"{start + unit}:{digest}"
        keys.append(key)
        parent = key.encode()


def prefix_keys(tokens: Sequence[int], unit: int, lookahead: int = 0) -> list[str]:
    keys: list[str] = []
    extend_prefix_keys(keys, tokens, unit, lookahead)
    return keys


def key_position(key: str) -> int:
    """The token position a prefix key ends at."""
    return int(key.split(":", 1)[0])
