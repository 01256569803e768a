"""The config features exploration varies, one `Knob` each.

A config is the seed's (`SEED_CONFIG`) with every knob set: an example
draws a value for each knob it enables (swarm testing: each example varies
a random subset of the features, the rest keep the seed's value), and a
campaign stratum fixes some knobs to one value each. A knob's first value
is the seed's, so a drawn config shrinks toward the seed's.

To add a knob: append a `Knob` to `KNOBS` (its `set` returns the config
with that feature set; knobs apply in order, so one that reads another's
effect comes after it), naming in `fields` the trace config fields it sets
(`field_knob` builds one that sets a single field to each value).
`stratum=True` makes it an axis of the campaign matrix (`kvgate explore
--jobs`): give it few values. Every config field is either set by a knob or
says in its schema row why it is not explored (`tests/test_config_schema.py`).
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from hypothesis import strategies as st

from kvgate.vocabulary.config import Config, GroupConfig
from kvgate.vocabulary.schema import BY_KEY

HASH_UNIT = 8

# The seed patch's scenario: one attention group, one Mamba group (align
# mode, 3 speculative blocks), eagle, sparse retention, a small pool.
SEED_CONFIG = Config(
    num_blocks=32,
    hash_unit=HASH_UNIT,
    groups=(GroupConfig("full_attention", 8), GroupConfig("mamba_align", 32, 3)),
    eagle=True,
    retention_interval=0,
    hold=False,
    scheduler_block_size=32,
    max_num_scheduled_tokens=8192,
)


def _mamba_groups(config: Config, count: int) -> Config:
    attention = config.groups[0]
    mamba = config.groups[config.mamba_group_ids[0]]
    return replace(config, groups=(attention, *(mamba for _ in range(count))))


def _mamba_block(config: Config, size: int) -> Config:
    groups = tuple(
        replace(g, block_size=size) if g.kind == "mamba_align" else g for g in config.groups
    )
    return replace(config, groups=groups, scheduler_block_size=size)


def _attention_block(config: Config, size: int) -> Config:
    groups = tuple(
        replace(g, block_size=size) if g.kind == "full_attention" else g for g in config.groups
    )
    return replace(config, groups=groups)


def _speculative(config: Config, blocks: int) -> Config:
    groups = tuple(
        replace(g, speculative_blocks=blocks) if g.kind == "mamba_align" else g
        for g in config.groups
    )
    return replace(config, groups=groups)


def _pure_mamba(config: Config, on: bool) -> Config:
    """A pure Mamba model (Mamba-Codestral, Falcon-Mamba): its one Mamba
    group alone, hashed at its own block, as vLLM's unitary coordinator
    requires. Drawn only over one Mamba group (the knob's `only_with`: a
    pure Mamba model's layers share one group); a stratum or family that
    fixes it over more is a mistake, refused here."""
    if not on:
        return config
    if len(config.mamba_group_ids) > 1:
        raise ValueError("pure_mamba needs mamba_groups=1 (a pure Mamba model has one group)")
    mamba = config.groups[config.mamba_group_ids[0]]
    return replace(
        config,
        groups=(mamba,),
        hash_unit=mamba.block_size,
        scheduler_block_size=mamba.block_size,
    )


def _mtp_modules(config: Config, modules: int) -> Config:
    """A drafter with lookahead hashes of one token keeps them, or has K > 1
    MTP modules (a multi-module MTP drafter: it hashes, drafts and reads
    ahead K tokens). Hybrid models only: with more than one token vLLM
    0.33.0's unitary lookup (a pure Mamba model's) indexes past a request's
    block hashes and raises whenever its length is 1 to K - 1 tokens past a
    block boundary, and no pure Mamba model ships such a drafter."""
    if modules > 1 and config.hash_lookahead_tokens == 1 and config.has_attention:
        return replace(config, hash_lookahead_tokens=modules)
    return config


@dataclass(frozen=True)
class Knob:
    """One config feature: its values (the seed's first) and how to set it."""

    name: str
    values: tuple[Any, ...]
    set: Callable[[Config, Any], Config]
    # The trace config fields (`schema.CONFIG_FIELDS` keys) it sets.
    fields: tuple[str, ...] = ()
    # An axis of the campaign matrix (else drawn inside every stratum).
    stratum: bool = False
    # Drawn from this instead of `values` when the knob is on (a range);
    # `values[0]` is still the value when it is off.
    strategy: st.SearchStrategy[Any] | None = None
    # Drawn only where these earlier knobs have these values (fixed by a
    # stratum or drawn; a frozenset: any of its values); elsewhere it keeps
    # its first value, so it never undoes what a stratum fixes.
    only_with: tuple[tuple[str, Any], ...] = ()

    def applies(self, values: Mapping[str, Any]) -> bool:
        """Whether the earlier knobs' `values` let this one be drawn."""
        for name, wanted in self.only_with:
            value = values.get(name, _first(name))
            if value not in wanted if isinstance(wanted, frozenset) else value != wanted:
                return False
        return True

    def draw_from(self) -> st.SearchStrategy[Any]:
        return self.strategy if self.strategy is not None else st.sampled_from(self.values)


def field_knob(key: str, values: tuple[Any, ...], **options: Any) -> Knob:
    """A knob that sets one config field (named by its trace key) to each value."""
    attribute = BY_KEY[key].attribute
    return Knob(key, values, lambda c, v: replace(c, **{attribute: v}), fields=(key,), **options)


def _prefill_checkpoint(config: Config, value: tuple[int, int | None]) -> Config:
    blocks, alignment = value
    groups = tuple(
        replace(g, prefill_checkpoint_blocks=blocks, prefill_checkpoint_alignment=alignment)
        if g.kind == "mamba_align"
        else g
        for g in config.groups
    )
    return replace(config, groups=groups)


def _retention(config: Config, value: int | None) -> Config:
    """0: sparse; None: dense; k > 0: every k Mamba blocks (1 acts dense)."""
    if value:
        value *= config.scheduler_block_size
    return replace(config, retention_interval=value)


def _long_prefill(config: Config, value: int | None) -> Config:
    """A token count, or None: one Mamba block plus a hash unit."""
    if value is None:
        value = config.scheduler_block_size + config.hash_unit
    return replace(config, long_prefill_token_threshold=value)


def _kv_connector(config: Config, value: str) -> Config:
    """vLLM keeps legacy block hashes under a connector (VllmConfig does), so
    lookahead hashes drawn before it keep the connector off."""
    on = value != "off" and not config.hash_lookahead_tokens
    return replace(
        config, kv_connector=on, kv_connector_divergent_hits=on and value == "divergent_hits"
    )


# The knobs that reshape the groups.
_GROUPS = ("groups",)

KNOBS: tuple[Knob, ...] = (
    Knob("mamba_groups", (1, 2), _mamba_groups, fields=_GROUPS, stratum=True),
    Knob("mamba_block", (32, 64), _mamba_block, fields=(*_GROUPS, "scheduler_block_size")),
    Knob("attention_block", (8, 16), _attention_block, fields=_GROUPS),
    Knob("speculative_blocks", (3, 0, 1), _speculative, fields=_GROUPS, stratum=True),
    field_knob("eagle", (True, False), stratum=True),
    Knob("retention_interval", (0, None, 2, 4, 1), _retention, fields=("retention_interval",)),
    # Prefill checkpoint blocks as deployments set them: none (GDN on
    # Triton), one on the 64-token grid (GDN on FlashInfer), one at
    # alignment 1 (Mamba2 layers); a grid of two hash units besides.
    Knob(
        "prefill_checkpoint",
        ((0, None), (1, 64), (1, 1), (1, 2 * HASH_UNIT)),
        _prefill_checkpoint,
        fields=_GROUPS,
    ),
    field_knob("shared_prefix_checkpoint", (False, True)),
    Knob(
        "long_prefill_token_threshold",
        (0, 48, None),
        _long_prefill,
        fields=("long_prefill_token_threshold",),
    ),
    # Acts only with a threshold (as in vLLM): the cap's fair-share floor.
    field_knob("long_prefill_token_threshold_adaptive", (False, True)),
    field_knob("num_blocks", (32, 64, 128), strategy=st.integers(32, 128)),
    field_knob("max_num_scheduled_tokens", (8192, 64, 32)),
    # KV-cache events queued for the `events` op; "full": every request also
    # asks for kv_cache_report_mode full (its hits reported as BlockStored).
    Knob(
        "kv_events",
        (False, True, "full"),
        lambda c, v: replace(c, kv_events=bool(v), kv_events_full=v == "full"),
        fields=("kv_events", "kv_events_full"),
    ),
    # The scheduler's full-sequence admission gate (`scheduler_reserve_full_isl`).
    field_knob("reserve_full_sequence", (False, True)),
    # vLLM's default for an EAGLE/MTP drafter: lookahead block hashes (L = 1,
    # or more with the `mtp_modules` knob) instead of the trailing-block drop;
    # only with eagle (else 0).
    Knob(
        "hash_lookahead_tokens",
        (0, 1),
        lambda c, v: replace(c, hash_lookahead_tokens=v if c.eagle else 0),
        fields=("hash_lookahead_tokens",),
    ),
    # A single group, no attention (the unitary coordinator); after the
    # Mamba block size it reads.
    Knob(
        "pure_mamba",
        (False, True),
        _pure_mamba,
        fields=(*_GROUPS, "hash_unit", "scheduler_block_size"),
        only_with=(("mamba_groups", 1),),
    ),
    # After the groups are final (hybrid or pure Mamba): K MTP modules.
    Knob("mtp_modules", (1, 2, 3), _mtp_modules, fields=("hash_lookahead_tokens",)),
    # vLLM's `enable_prefix_caching` off: the no-prefix-cache coordinator,
    # with Mamba in cache mode none, as the engine config then sets it.
    Knob(
        "prefix_caching",
        (True, False),
        lambda c, v: replace(c, prefix_caching=v, mamba_cache_mode="align" if v else "none"),
        fields=("prefix_caching", "mamba_cache_mode"),
    ),
    # A KV connector: none, one reading the agreed local hit (LMCache-like),
    # or one taking per-group hits (NIXL-like); the machine's connector rule
    # then scripts what it holds.
    Knob(
        "kv_connector",
        ("off", "on", "divergent_hits"),
        _kv_connector,
        fields=("kv_connector", "kv_connector_divergent_hits"),
    ),
    # The connector's kv_load_failure_policy (after the connector, which it
    # needs): a failed load retried (`recompute`, vLLM's default) or failing
    # its request (`fail`).
    Knob(
        "kv_load_failure_policy",
        ("recompute", "fail"),
        lambda c, v: replace(c, kv_load_failure_policy=v if c.kv_connector else "recompute"),
        fields=("kv_load_failure_policy",),
        only_with=(("kv_connector", frozenset({"on", "divergent_hits"})),),
    ),
    # vLLM's --kv-cache-metrics (every block sampled): the residency
    # metrics' eviction events, drained by the `residency` op.
    field_knob("kv_cache_metrics", (False, True)),
)
KNOB_NAMES = tuple(k.name for k in KNOBS)

# vLLM's own config rules (`model.scope.vllm_rules`), broken on purpose one knob
# at a time in a small share of a differential run's examples: the model and
# vLLM must then refuse the config alike. One draw of 16 bits says whether
# (its low bits, 1 in `REFUSAL_ODDS`: spread more evenly than a small
# range's draws, which favour its low end; it shrinks to 0, unbroken); the
# knob and value come from a checksum of the drawn config, which varies
# from example to example where Hypothesis repeats its draws.
REFUSAL_ODDS = 16
BREAKABLE = (
    "retention_interval",
    "long_prefill_token_threshold",
    "scheduler_block_size",
    "hash_unit",
    "groups",
)


def broken(config: Config, knob: str, variant: int) -> Config:
    """`config` with `knob` set to a value vLLM refuses (`variant` picks one
    of a few: negative, below the unit, between two multiples, ...). For
    `groups`: the model without its Mamba groups, with a retention interval
    of one scheduler block (odd variants), which vLLM refuses, or of 0
    (even), which vLLM builds (the one interval its retention check lets
    through without a Mamba group) and kvgate does not model: that refusal
    must then be kvgate's on both sides."""
    scheduler = config.scheduler_block_size
    mamba = max(config.groups[i].block_size for i in config.mamba_group_ids)
    if knob == "groups" and config.has_attention:
        kept = tuple(g for g in config.groups if g.kind == "full_attention")
        return replace(config, groups=kept, retention_interval=(0, scheduler)[variant % 2])
    if knob == "hash_unit" and config.prefix_caching:
        if config.has_attention:
            # Coarser than the attention block, which stays a multiple of
            # it no longer (the hybrid coordinator's rule).
            attention = next(g.block_size for g in config.groups if g.kind == "full_attention")
            return replace(config, hash_unit=2 * attention)
        return replace(config, hash_unit=mamba // 2)  # the unitary coordinator's
    if knob == "scheduler_block_size":
        return replace(config, scheduler_block_size=(mamba // 2, mamba + mamba // 2)[variant % 2])
    if knob == "long_prefill_token_threshold":
        length = config.max_model_len
        return replace(config, long_prefill_token_threshold=(length + 1, 2 * length)[variant % 2])
    # The retention interval (also the hash unit's stand-in without prefix
    # caching, where no hash-unit rule of vLLM's applies).
    values = (-scheduler, scheduler // 2, scheduler + scheduler // 2)
    return replace(config, retention_interval=values[variant % 3])


# A campaign stratum: a value for some knobs, fixed for all its examples.
Stratum = Mapping[str, Any]


def rule_breaches() -> list[Config]:
    """Each of `BREAKABLE` broken in each of its variants, on the seed's
    config and on the pure Mamba one (where `hash_unit` and `groups` break
    otherwise), without repeats: a differential run checks them all before
    its search, so every rule is checked whatever the search draws."""
    found: list[Config] = []
    for base in (build({}), build({"pure_mamba": True})):
        for knob in BREAKABLE:
            for variant in range(3):
                config = broken(base, knob, variant)
                if config not in found:
                    found.append(config)
    return found


def strata() -> Iterator[dict[str, Any]]:
    """Every combination of the stratum knobs' values (the matrix's rows)."""
    axes = [k for k in KNOBS if k.stratum]
    for values in itertools.product(*(k.values for k in axes)):
        yield {k.name: v for k, v in zip(axes, values, strict=True)}


def stratum_name(stratum: Stratum) -> str:
    if not stratum:
        return "any"
    return " ".join(f"{name}={_short(value)}" for name, value in stratum.items())


def _short(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def build(values: Mapping[str, Any]) -> Config:
    """The seed's config with each knob in `values` set (others: the seed's)."""
    unknown = set(values) - set(KNOB_NAMES)
    if unknown:
        raise KeyError(f"unknown knobs: {', '.join(sorted(unknown))}")
    config = SEED_CONFIG
    for knob in KNOBS:
        config = knob.set(config, values.get(knob.name, knob.values[0]))
    return config


def _first(name: str) -> Any:
    return next(k.values[0] for k in KNOBS if k.name == name)


@st.composite
def configs(
    draw: st.DrawFn, stratum: Stratum | None = None, swarm: bool = True, refusals: bool = False
) -> Config:
    """A config: `stratum`'s knobs fixed; of the rest, with `swarm` a random
    subset is drawn (each shrinks to the seed's value) and the others keep
    the seed's value; without it every one is drawn. With `refusals`, about
    one config in `REFUSAL_ODDS` has one of `BREAKABLE` broken."""
    fixed = dict(stratum or {})
    values: dict[str, Any] = {}
    for knob in KNOBS:
        if knob.name in fixed:
            values[knob.name] = fixed[knob.name]
        elif not knob.applies(values):
            continue
        # `not b`: the switch shrinks to on, so shrinking changes the value, not the subset.
        elif not swarm or draw(st.booleans().map(lambda b: not b)):
            values[knob.name] = draw(knob.draw_from())
    config = build(values)
    if refusals and draw(st.integers(0, 2**16 - 1)) % REFUSAL_ODDS == REFUSAL_ODDS - 1:
        which = zlib.crc32(repr(config).encode())
        config = broken(config, BREAKABLE[which % len(BREAKABLE)], which // len(BREAKABLE))
    return config


def knobs_by_field() -> dict[str, list[str]]:
    """The knobs that vary each config field (by trace key)."""
    found: dict[str, list[str]] = {}
    for knob in KNOBS:
        for key in knob.fields:
            found.setdefault(key, []).append(knob.name)
    return found
