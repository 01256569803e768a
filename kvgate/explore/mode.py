"""What an exploration run checks and against what (`Mode`), and what it
exercised (`Stats`, with the drawn configs counted per knob value); the same
at the Scheduler level (`SchedulerMode`, `SchedulerStats`)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvgate.driver.op_driver import OpDriver
from kvgate.explore.knobs import Stratum
from kvgate.options import OVERLAY_PLUGIN
from kvgate.vocabulary.config import Config, GroupConfig


@dataclass
class Stats:
    """What a run exercised, across examples (for the summary and tests)."""

    ops: Counter[str] = field(default_factory=Counter)
    # Configs drawn, per value of each align-mode knob ("knob=value").
    knobs: Counter[str] = field(default_factory=Counter)
    # Examples as Hypothesis counts them against `max_examples`: those it
    # ran to the end before the first failure. Not counted: `discarded`,
    # examples Hypothesis dropped part-way (its choice buffer overran, as a
    # long stateful example's draws do), which it runs but does not count;
    # `shrinking`, the runs after the first failure while it shrinks.
    examples: int = 0
    discarded: int = 0
    shrinking: int = 0
    # Examples dropped at a lookup vLLM 0.33.0 crashes on (kv_events_full).
    rejected_lookups: int = 0
    # Configs breaking one of vLLM's rules checked before the search
    # (`check_config_rules`), and how the model refused them ("field" counts).
    rule_breaches: Counter[str] = field(default_factory=Counter)
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)
    # Seconds from `started` to the first failing step Hypothesis ran
    # (before any shrinking).
    first_failure: float | None = None
    # The same in this process's CPU seconds (steadier on a shared machine).
    started_cpu: float = field(default_factory=time.process_time)
    first_failure_cpu: float | None = None
    on_example: Callable[[Stats], None] | None = None


@dataclass
class Mode:
    """What the machine checks and against what."""

    hold: bool
    invariants: tuple[str, ...]
    lockstep: Callable[[Config], OpDriver[Any]] | None = None
    stats: Stats = field(default_factory=Stats)
    retain_retired: bool = False  # the production fork's retention of retired states
    # Config features fixed for every example (a campaign's stratum).
    stratum: Stratum = field(default_factory=dict)
    # One config for every example instead of drawn ones: a deployment's
    # (`kvgate gate --deployment`); the rules size their prompts in its blocks.
    config: Config | None = None
    # Swarm testing of config features: each example varies a random subset
    # of the knobs (Hypothesis already enables a random subset of the rules
    # per example: its stateful rule strategy draws feature flags).
    swarm: bool = True
    # A share of the configs drawn break one of vLLM's config rules
    # (`knobs.BREAKABLE`); the model and the lockstep target must refuse alike.
    refusals: bool = False

    def apply(self, config: Config) -> Config:
        """A drawn config with this mode's switches. In lockstep the KV-cache
        events are always queued, so every `events` step compares them (as
        the gate does on a trace with them)."""
        events = config.kv_events or self.lockstep is not None
        return replace(config, hold=self.hold, retain_retired=self.retain_retired, kv_events=events)


@dataclass(frozen=True)
class SchedulerMode:
    """The arm the Scheduler level explores: vLLM's Scheduler as installed
    (hold off), or with kvgate's hold overlay (hold on; `retain_retired`:
    the fork's retention too)."""

    hold: bool = False
    retain_retired: bool = False

    @property
    def plugin(self) -> str | None:
        return OVERLAY_PLUGIN if self.hold or self.retain_retired else None

    def replay_command(self, path: Path) -> str:
        plugin = f" --plugin {self.plugin}" if self.plugin else ""
        return f"kvgate replay {path} --target vllm{plugin}"


@dataclass
class SchedulerStats:
    """What one Scheduler-level run exercised."""

    examples: int = 0
    # Examples dropped part-way (refused, or past Hypothesis's buffer), and
    # the runs while Hypothesis shrinks a failure: not among `examples`.
    discarded: int = 0
    shrinking: int = 0
    engine_steps: int = 0
    ops: Counter[str] = field(default_factory=Counter)
    families: Counter[str] = field(default_factory=Counter)
    # Configs or requests the real Scheduler refused (examples dropped), by field.
    refused: Counter[str] = field(default_factory=Counter)
    preemptions: int = 0
    first_failure: float | None = None
    started: float = field(default_factory=time.perf_counter)


def knob_values(config: Config, refused: str | None = None) -> tuple[str, ...]:
    """The config's align-mode knobs as `knob=value` (per-knob counts), and
    how the model refuses it (`refused`: vLLM's field, `not modelled:
    FIELD` for kvgate's own refusal, `none` if valid)."""
    # A broken `groups` has none (`knobs.broken`): counted as no checkpoint.
    mamba = next((config.groups[i] for i in config.mamba_group_ids), GroupConfig("mamba_align", 1))
    blocks = config.scheduler_block_size
    retention = config.retention_interval
    period = (
        "null"
        if retention is None
        else "0"
        if retention == 0
        else f"{retention // blocks}x block"
        if retention > 0 and retention % blocks == 0
        else f"{retention} tokens"
    )
    return (
        f"refused={refused or 'none'}",
        f"prefill_checkpoint_blocks={mamba.prefill_checkpoint_blocks}",
        f"prefill_checkpoint_alignment={mamba.prefill_checkpoint_alignment}",
        f"retention_interval={period}",
        f"shared_prefix_checkpoint={config.shared_prefix_checkpoint}",
        f"shared_prefix_checkpoint_in_effect={config.shared_prefix_checkpoint_on}",
        f"long_prefill_token_threshold={config.long_prefill_token_threshold}",
        f"hash_lookahead_tokens={config.hash_lookahead_tokens}",
        f"kv_events_full={config.kv_events_full}",
        # vLLM's emit_cached_block_events with lookahead tokens per block.
        "kv_events_full_with_lookahead_hashes="
        + str(config.kv_events_full and bool(config.hash_lookahead_tokens)),
        f"pure_mamba={not config.has_attention}",
        f"prefix_caching={config.prefix_caching}",
        f"mamba_cache_mode={config.mamba_cache_mode}",
        "kv_connector="
        + ("divergent_hits" if config.kv_connector_divergent_hits else str(config.kv_connector)),
        f"kv_load_failure_policy={config.kv_load_failure_policy}",
        f"kv_cache_metrics={config.kv_cache_metrics}",
    )
