"""KV-cache events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared) as
both targets report them, and as a trace writes them.

A target with `kv_events` on queues an event whenever prefix-cache entries
appear or disappear; the `events` op takes the queue. Each event is a
`KvEvent` over prefix keys (`kvgate.vocabulary.tokens`), so the model's and
vLLM's compare directly. A trace's `expect: {events: [...]}` lists them as
lines, positions instead of digests:

    stored g<G> <start>-<end>/<block size>: <key positions, or ->
    removed g<G> <position>
    cleared

`stored` covers the tokens start..end of the request that cached them (its
parent is the key at `start`, none at 0); a Mamba group in align mode keys
only some of its blocks, so the positions may be fewer than the blocks, even
none. A request with hash inputs (`tokens.HashInputs`) adds what vLLM's
`BlockStored` carries of them: ` lora <name>` (the adapter; its id is
compared too) and ` extra <per block>`, one entry per key, `;`-separated:
`-` (none) or its keys `,`-separated, an adapter or salt bare, an item as
`<identifier>@<offset in the block>`. One eviction can remove several keys
of one block in an order vLLM leaves to a set: every run of consecutive
`removed` events is sorted (by group, then position).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from kvgate.vocabulary.tokens import EventExtra, key_position

EventKind = Literal["stored", "removed", "cleared"]


@dataclass(frozen=True)
class KvEvent:
    kind: EventKind
    group: int = -1
    # stored: the keys entered, in block order; removed: the one key.
    keys: tuple[str, ...] = ()
    parent: str | None = None  # stored: the key the first block chains on
    start: int = 0  # stored: the token span the event carries
    end: int = 0
    block_size: int = 0
    # stored, for a request with an adapter: its name and int id.
    lora: str = ""
    lora_id: int = 0
    # stored: the hash inputs each keyed block's window carries, aligned with
    # `keys`; () when no block carries any (a request without hash inputs).
    extra: tuple[EventExtra, ...] = ()
    # stored, with lookahead block hashes (vLLM's `lookahead_token_ids`): the
    # tokens after each listed block that its hash covers; None without them.
    lookahead: tuple[tuple[int, ...], ...] | None = None

    def line(self) -> str:
        """The event as a trace writes it (positions)."""
        if self.kind == "cleared":
            return "cleared"
        positions = " ".join(str(key_position(k)) for k in self.keys) or "-"
        if self.kind == "removed":
            return f"removed g{self.group} {positions}"
        line = f"stored g{self.group} {self.start}-{self.end}/{self.block_size}: {positions}"
        if self.lora:
            line += f" lora {self.lora}"
        if self.extra:
            line += " extra " + ";".join(_extra_text(e) for e in self.extra)
        return line

    def exact(self) -> str:
        """The event with its full keys: what two targets compare."""
        if self.kind == "cleared":
            return "cleared"
        if self.kind == "stored":
            lora_id = f" lora_id {self.lora_id}" if self.lora else ""
            exact = f"{self.line()} keys {' '.join(self.keys)} parent {self.parent}{lora_id}"
            if self.lookahead is not None:
                exact += f" lookahead {[list(tokens) for tokens in self.lookahead]}"
            return exact
        return f"{self.line()} keys {' '.join(self.keys)}"


def event_extras(extras: Iterable[EventExtra]) -> tuple[EventExtra, ...]:
    """Per-block event extras as `KvEvent.extra` keeps them: () when no
    block carries any (vLLM then still lists a None per block)."""
    kept = tuple(extras)
    return kept if any(e is not None for e in kept) else ()


def _extra_text(extra: EventExtra) -> str:
    if extra is None:
        return "-"
    return ",".join(k if isinstance(k, str) else f"{k[0]}@{k[1]}" for k in extra)


def normalized(events: Iterable[KvEvent]) -> list[KvEvent]:
    """`events` with each run of consecutive `removed` events sorted."""
    out: list[KvEvent] = []
    run: list[KvEvent] = []
    for event in events:
        if event.kind == "removed":
            run.append(event)
            continue
        out += sorted(run, key=_removal_order)
        run = []
        out.append(event)
    out += sorted(run, key=_removal_order)
    return out


def _removal_order(event: KvEvent) -> tuple[int, list[int], tuple[str, ...]]:
    return event.group, [key_position(k) for k in event.keys], event.keys
