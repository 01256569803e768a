"""vLLM's KV-cache residency metrics (`--kv-cache-metrics`) for the adapters.

`metrics_collector(config)` builds what vLLM's `Scheduler` builds from its
`ObservabilityConfig` (vLLM validates the sample rate there): a
`KVCacheMetricsCollector`, here a subclass that only also notes which block
each eviction event is for (vLLM's events carry times, not blocks; every
method runs vLLM's own code). `take_evictions` drains it as `make_stats`
does and checks the wall-clock values it does not compare: none is
negative, and the reuse gaps fit in the lifetime.

vLLM is imported when first called, never when this module is imported.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from kvgate.vocabulary.config import Config
from kvgate.vocabulary.residency import Eviction

__all__ = ["collector_class", "metrics_collector", "take_evictions"]

# Float slack for the wall-clock check (the values are ns differences / 1e9).
CLOCK_SLACK_SECONDS = 1e-6


@functools.cache
def collector_class() -> Any:
    """vLLM's `KVCacheMetricsCollector`, noting each event's block."""
    module = importlib.import_module("vllm.v1.core.kv_cache_metrics")
    base: Any = module.KVCacheMetricsCollector

    class BlockNotingCollector(base):  # type: ignore[misc]
        def __init__(self, sample_rate: float) -> None:
            super().__init__(sample_rate)
            # The block of each event queued and not yet drained, in order.
            self.evicted_block_ids: list[int] = []

        def on_block_evicted(self, block: Any) -> None:
            queued = len(self.drained_view())
            super().on_block_evicted(block)
            if len(self.drained_view()) > queued:
                self.evicted_block_ids.append(int(block.block_id))

        def drained_view(self) -> list[Any]:
            # The queue `drain_events` hands over (no public read without
            # draining it).
            return self._eviction_events  # type: ignore[no-any-return]

        def reset(self) -> None:
            super().reset()
            self.evicted_block_ids.clear()

    return BlockNotingCollector


def metrics_collector(config: Config) -> Any:
    """The collector vLLM's Scheduler would pass its manager for `config`, or
    None (metrics off). vLLM's `ObservabilityConfig` validates the sample
    rate, on or off, as the engine builds it."""
    from vllm.config import ObservabilityConfig

    observability = ObservabilityConfig(
        kv_cache_metrics=config.kv_cache_metrics,
        kv_cache_metrics_sample=config.kv_cache_metrics_sample,
    )
    if not observability.kv_cache_metrics:
        return None
    return collector_class()(observability.kv_cache_metrics_sample)


def take_evictions(collector: Any) -> list[Eviction]:
    """Drain `collector` (None: no metrics, no events), each event with its
    block and, when its times cannot be, a flaw naming why."""
    if collector is None:
        return []
    block_ids: list[int | None] = list(getattr(collector, "evicted_block_ids", []))
    collector.evicted_block_ids = []
    events = collector.drain_events()
    if len(block_ids) != len(events):
        # Only a collector not built here lacks the blocks; say so per event.
        block_ids = [None] * len(events)
    evictions = []
    for block_id, event in zip(block_ids, events, strict=True):
        lifetime = float(event.lifetime_seconds)
        idle = float(event.idle_seconds)
        gaps = [float(g) for g in event.reuse_gaps_seconds]
        flaw = ""
        # vLLM reads its clock once per value, so the idle time (read after
        # the lifetime) may exceed it by however long the process was
        # descheduled between the reads: only race-free relations are
        # checked. The gaps span the kept accesses, all after the birth.
        if min(lifetime, idle, *gaps) < 0:
            flaw = f"negative time: lifetime {lifetime}s, idle {idle}s, gaps {gaps}"
        elif sum(gaps) > lifetime + CLOCK_SLACK_SECONDS:
            flaw = f"reuse gaps {gaps} exceed lifetime {lifetime:.6f}s"
        elif block_id is None:
            flaw = "block not noted"
        evictions.append(Eviction(-1 if block_id is None else block_id, len(gaps), flaw))
    return evictions
