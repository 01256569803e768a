"""The hash inputs exploration gives its requests (`arrive`'s `cache_salt`,
`lora`, `mm`; see `kvgate.vocabulary.tokens.HashInputs`).

Unlike the config knobs (`knobs.KNOBS`), these belong to requests: an
example draws which of them it sets (`MODES`, counted with the knobs as
`hash_inputs=<mode>`), and then every request gets them as a deployment
would: a new conversation (a fresh prompt) is some tenant's, on some
adapter, with an image placeholder in its prompt; a request that shares an
earlier one's prompt (a follow-up turn, a sibling, a retry) mostly inherits
its inputs, so it can resume where that one left off, and one in
`VARY_EVERY` changes one of them (another tenant, another adapter, another
image id in the same placeholder), so it must share nothing past where they
differ. Which requests vary is fixed by their order, not drawn, so the
example's other draws stay as they were.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from itertools import count

from kvgate.vocabulary.tokens import NO_INPUTS, HashInputs, MmItem

# Which inputs an example sets; the first (none) is what it shrinks to.
MODES: tuple[str, ...] = ("none", "cache_salt", "lora", "mm", "all")
# One request in this many that shares a prompt changes one inherited input.
VARY_EVERY = 3

TENANTS = ("tenant-a", "tenant-b")
ADAPTERS = ("ad-1", "ad-2")


class RequestInputs:
    """Hands out each request's hash inputs for one example in `mode`."""

    def __init__(self, mode: str, counts: Counter[str], unit: int = 1) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown hash-input mode {mode!r}")
        self.mode = mode
        self.unit = unit  # the hash unit, where images may start
        self._on = {"cache_salt", "lora", "mm"} if mode == "all" else {mode}
        self._roots = count()
        self._shares = count()
        self._of: dict[str, HashInputs] = {}
        # Arrivals per input set, and those that varied one from the parent.
        self.counts = counts

    def of(self, request: str) -> HashInputs:
        return self._of.get(request, NO_INPUTS)

    def fresh(self, request: str, prompt_tokens: int) -> HashInputs:
        """A new conversation's inputs (`prompt_tokens` long)."""
        k = next(self._roots)
        inputs = HashInputs(
            cache_salt=TENANTS[k % 2] if "cache_salt" in self._on else "",
            lora=ADAPTERS[k % 2] if "lora" in self._on else "",
            mm=self._image(k, prompt_tokens) if "mm" in self._on else (),
        )
        return self._record(request, inputs, varied=False)

    def shared(self, request: str, parent: str) -> HashInputs:
        """Inputs of a request whose prompt starts with `parent`'s."""
        inputs = self.of(parent)
        n = next(self._shares)
        varied = bool(inputs) and n % VARY_EVERY == VARY_EVERY - 1
        if varied:
            inputs = self._vary(inputs, n // VARY_EVERY)
        return self._record(request, inputs, varied)

    def _record(self, request: str, inputs: HashInputs, varied: bool) -> HashInputs:
        self._of[request] = inputs
        for name in ("cache_salt", "lora", "mm"):
            if getattr(inputs, name):
                self.counts[f"arrive:{name}"] += 1
        if varied:
            self.counts["arrive:varied"] += 1
        return inputs

    def _image(self, k: int, prompt_tokens: int) -> tuple[MmItem, ...]:
        """One image placeholder, placed in turn: in the middle third of the
        prompt; from the first hash-unit boundary there (the edge of the
        units' windows: the unit before it covers it only through its
        lookahead tokens); ending the prompt (the output completes the unit
        it ends in, hashed as tokens arrive)."""
        if prompt_tokens < 3:
            return ()
        length = max(1, min(24, prompt_tokens // 3))
        offset = prompt_tokens // 3
        if k % 3 == 1:
            offset = -(-offset // self.unit) * self.unit
        elif k % 3 == 2:
            offset = prompt_tokens - length
        if offset + length > prompt_tokens:
            offset = prompt_tokens - length
        return (MmItem(offset, length, f"img-{k}"),)

    def _vary(self, inputs: HashInputs, turn: int) -> HashInputs:
        """`inputs` with one of them changed (in turn, among those set)."""
        kinds = [name for name in ("cache_salt", "lora", "mm") if getattr(inputs, name)]
        kind = kinds[turn % len(kinds)]
        if kind == "cache_salt":
            return replace(inputs, cache_salt=_other(TENANTS, inputs.cache_salt))
        if kind == "lora":
            return replace(inputs, lora=_other(ADAPTERS, inputs.lora))
        return replace(
            inputs, mm=tuple(replace(m, identifier=f"{m.identifier}-other") for m in inputs.mm)
        )


def _other(names: tuple[str, str], name: str) -> str:
    return names[1] if name == names[0] else names[0]


def arrive_fields(inputs: HashInputs) -> dict[str, object]:
    """`inputs` as an `arrive` step's fields."""
    return {"cache_salt": inputs.cache_salt, "lora": inputs.lora, "mm": inputs.mm}
