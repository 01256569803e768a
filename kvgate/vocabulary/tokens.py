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

A request's `HashInputs` (its cache salt, LoRA adapter and multimodal
placeholders) enter each unit's key as vLLM folds them into its block hash
(`generate_block_hash_extra_keys`): the adapter into every unit, the salt
into the first only, an item into every unit whose hashed window (the unit
and its lookahead tokens) overlaps its placeholder, with the item's offset
from the unit's start. A key therefore names "the state after these tokens
under these inputs", and two requests share it iff vLLM's hashes agree.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

try:
    # hashlib's own blake2b (hashlib takes it from here), without hashlib
    # loading OpenSSL for every other hash at start-up.
    from _blake2 import blake2b
except ImportError:  # an interpreter without CPython's module
    from hashlib import blake2b

FIRST_FRESH_TOKEN = 1000


class FreshTokens:
    """Hands out token ids never used before in this replay."""

    def __init__(self, start: int = FIRST_FRESH_TOKEN) -> None:
        self._next = start

    def take(self, n: int) -> list[int]:
        return list(self.ids(n))

    def ids(self, n: int) -> range:
        """`take`, as a range: a long prompt's ids are not built twice."""
        first = self._next
        self._next += n
        return range(first, first + n)


@dataclass(frozen=True)
class MmItem:
    """A multimodal item's placeholder in the prompt: tokens
    [offset, offset + length), and its content identifier (vLLM's
    `MultiModalFeatureSpec.identifier`, the mm hash)."""

    offset: int
    length: int
    identifier: str

    @property
    def end(self) -> int:
        return self.offset + self.length


# One extra key, tagged as vLLM tags it: ("lora", name), ("cache_salt", salt)
# or ("mm", identifier, offset from the window's start).
ExtraKey = tuple[str, str] | tuple[str, str, int]
# What a KV-cache event carries for one block: vLLM's untagged form (a bare
# adapter name or salt, an (identifier, offset) pair per item), or None.
EventExtra = tuple[str | tuple[str, int], ...] | None


@dataclass(frozen=True)
class HashInputs:
    """A request's inputs besides its tokens that enter its block hashes.

    `mm` is sorted by offset, the placeholders disjoint and inside the
    prompt (the trace reader checks it). Empty strings mean none, as vLLM
    reads an empty salt.
    """

    cache_salt: str = ""
    lora: str = ""
    mm: tuple[MmItem, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.cache_salt or self.lora or self.mm)

    def extra_keys(self, start: int, end: int) -> tuple[ExtraKey, ...]:
        """The extra keys of the token window [start, end), in vLLM's order:
        the adapter, each item the window overlaps, the salt (window at 0)."""
        keys: list[ExtraKey] = []
        if self.lora:
            keys.append(("lora", self.lora))
        for item in self.mm:
            if item.offset >= end:
                break
            if item.end > start:
                keys.append(("mm", item.identifier, item.offset - start))
        if start == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys)

    def event_extra(self, start: int, end: int) -> EventExtra:
        """What a KV-cache event carries for the block [start, end) (its
        hashed window): the extra keys untagged, None when there are none."""
        keys = self.extra_keys(start, end)
        if not keys:
            return None
        return tuple((k[1], k[2]) if len(k) == 3 else k[1] for k in keys)


NO_INPUTS = HashInputs()


def lora_adapter_id(name: str) -> int:
    """The int id a LoRA adapter named `name` gets (vLLM's `lora_int_id`,
    which KV-cache events carry): stable per name, in every target, >= 1."""
    return int.from_bytes(blake2b(name.encode(), digest_size=4).digest(), "big") + 1


def extend_prefix_keys(
    keys: list[str],
    tokens: Sequence[int],
    unit: int,
    lookahead: int = 0,
    inputs: HashInputs = NO_INPUTS,
) -> None:
    """Append to `keys` the key of every complete `unit` of `tokens` past them
    that has `lookahead` tokens after it.

    `keys[i]` names the prefix `tokens[: (i + 1) * unit + lookahead]` (ending
    at `(i + 1) * unit`) under `inputs`' extra keys for that window; each
    digest chains over the one before, so the work is linear in the number
    of tokens.
    """
    first = len(keys) * unit
    if first + unit + lookahead > len(tokens):
        return  # no unit completed since the last key (a decode's usual step)
    parent = keys[-1].encode() if keys else b""
    for start in range(first, len(tokens) - unit - lookahead + 1, unit):
        chunk = array("q", tokens[start : start + unit + lookahead]).tobytes()
        if inputs:
            extra = inputs.extra_keys(start, start + unit + lookahead)
            if extra:
                # After the fixed-width chunk, so no token run can spell it.
                chunk += repr(extra).encode()
        digest = blake2b(parent + chunk, digest_size=8).hexdigest()
        key = f"{start + unit}:{digest}"
        keys.append(key)
        parent = key.encode()


def prefix_keys(
    tokens: Sequence[int], unit: int, lookahead: int = 0, inputs: HashInputs = NO_INPUTS
) -> list[str]:
    keys: list[str] = []
    extend_prefix_keys(keys, tokens, unit, lookahead, inputs)
    return keys


def key_position(key: str) -> int:
    """The token position a prefix key ends at."""
    return int(key.split(":", 1)[0])
