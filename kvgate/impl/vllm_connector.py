"""A scheduler-side KV connector for vLLM whose answers are scripted.

vLLM's `Scheduler` builds its connector itself (`KVConnectorFactory`, from
`kv_transfer_config`: `kv_connector` names a class, `kv_connector_module_path`
the module outside vLLM that holds it, built with role `SCHEDULER`). This
module is that module: `CLASS_NAME` resolves, through the module's
`__getattr__`, to a class built on first use over the installed vLLM's
`KVConnectorBase_V1` and `SupportsHMA` (so importing this module never imports
vLLM, and a build lacking either is refused by name, see `missing_support`).

The connector decides nothing. What it answers the Scheduler comes from the
script the caller (`vllm_scheduler.VllmScheduler`, driven by a trace or the
workload's lockstep) sets per request:

- `get_num_new_matched_tokens`: the external store holds the first
  `ExternalHit.tokens` tokens of the request; the answer is what lies past
  the length the Scheduler presents (never negative), loaded asynchronously
  when `load_async` (and there is something to load). No script: nothing.
- when a load completes or fails is not the connector's to say: the worker
  side reports it, and there is no worker here; the caller hands
  `finished_recving` / `failed_recving` to the Scheduler in the model
  runner's output (`VllmScheduler.update`).
- `request_finished_all_groups`: frees are never delayed (nothing is sent).

Every call the Scheduler makes is recorded (`Query`, `Allocated`,
`Finished`), so the lockstep can compare what the Scheduler asked and did
with what kvgate's driver says it asks and does. The worker-side methods
raise: no worker is ever built (no device on CPU).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "CLASS_NAME",
    "Allocated",
    "ConnectorScript",
    "ExternalHit",
    "Finished",
    "Query",
    "connector_class",
    "missing_support",
]

# The name vLLM's factory looks up in this module (`kv_connector`).
CLASS_NAME = "KvgateScriptedConnector"
MODULE = __name__

# What vLLM must offer for its Scheduler to take this connector, probed by
# name (module, attribute): never by version string.
_REQUIRED: tuple[tuple[str, str], ...] = (
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorMetadata"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "SupportsHMA"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorRole"),
    ("vllm.distributed.kv_transfer.kv_connector.factory", "KVConnectorFactory"),
    ("vllm.config", "KVTransferConfig"),
    ("vllm.v1.outputs", "KVConnectorOutput"),
)


@dataclass(frozen=True)
class ExternalHit:
    """The external store holds the request's first `tokens` tokens; the
    connector answers "not yet" to the first `undecided` questions."""

    tokens: int
    load_async: bool = False
    undecided: int = 0


@dataclass(frozen=True)
class Query:
    """One `get_num_new_matched_tokens` call: the local hit the Scheduler
    presented (block-aligned), and the answer given (None: "not yet")."""

    request: str
    presented: int
    answered: int | None
    load_async: bool


@dataclass(frozen=True)
class Allocated:
    """One `update_state_after_alloc` call: the external tokens the Scheduler
    allocated for (0: none to load) and the request's blocks per group."""

    request: str
    external: int
    block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Finished:
    """One `request_finished_all_groups` call: the blocks handed over."""

    request: str
    block_ids: tuple[tuple[int, ...], ...]


@dataclass
class ConnectorScript:
    """The answers a scripted connector gives, and what it was asked."""

    hits: dict[str, ExternalHit] = field(default_factory=dict)
    queries: list[Query] = field(default_factory=list)
    allocations: list[Allocated] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)

    def answer(self, request: str, presented: int) -> tuple[int | None, bool]:
        hit = self.hits.get(request)
        if hit is not None and hit.undecided:
            self.hits[request] = replace(hit, undecided=hit.undecided - 1)
            self.queries.append(Query(request, presented, None, False))
            return None, False
        if hit is None:
            new, load_async = 0, False
        else:
            new = max(0, hit.tokens - presented)
            # vLLM's contract: asynchronous only with something to load.
            load_async = hit.load_async and new > 0
        self.queries.append(Query(request, presented, new, load_async))
        return new, load_async

    def take_queries(self) -> list[Query]:
        """The `get_num_new_matched_tokens` calls since the last take."""
        queries, self.queries = self.queries, []
        return queries

    def take(self) -> tuple[list[Query], list[Allocated], list[Finished]]:
        """The calls recorded since the last `take`."""
        taken = (self.queries, self.allocations, self.finished)
        self.queries, self.allocations, self.finished = [], [], []
        return taken


def missing_support() -> list[str]:
    """The names vLLM lacks for its Scheduler to build this connector
    (empty: it can)."""
    missing = []
    for module_name, attribute in _REQUIRED:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(f"{module_name}.{attribute}")
            continue
        if not hasattr(module, attribute):
            missing.append(f"{module_name}.{attribute}")
    if not missing:
        from vllm.config import KVTransferConfig
        from vllm.v1.outputs import KVConnectorOutput

        fields = getattr(KVTransferConfig, "__dataclass_fields__", {})
        if "kv_connector_module_path" not in fields:
            missing.append("KVTransferConfig.kv_connector_module_path")
        if "failed_recving" not in getattr(KVConnectorOutput, "__dataclass_fields__", {}):
            missing.append("KVConnectorOutput.failed_recving")
    return missing


def _block_ids(blocks: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(b) for b in group) for group in blocks)


# `kv_connector_extra_config` key: the connector restores a lagging Mamba
# state (vLLM's `supports_divergent_local_hybrid_hits`, as NIXL's does).
DIVERGENT_HITS = "divergent_hits"


class _Scripted:
    """The connector's behaviour; `connector_class` puts vLLM's bases under it."""

    script: ConnectorScript
    _divergent_hits: bool

    def _start_script(self, extra_config: dict[str, Any]) -> None:
        self.script = ConnectorScript()
        self._divergent_hits = bool(extra_config.get(DIVERGENT_HITS, False))

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self._divergent_hits

    # -- scheduler side ---------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.script.answer(str(request.request_id), int(num_computed_tokens))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.script.allocations.append(
            Allocated(
                str(request.request_id),
                int(num_external_tokens),
                _block_ids(blocks.get_block_ids()),
            )
        )

    def reset_cache(self) -> bool:
        # The external store forgets what it held of every request.
        self.script.hits.clear()
        return True

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return _metadata_class()()

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.script.finished.append(Finished(str(request.request_id), _block_ids(block_ids)))
        return False, None

    # -- worker side: never built here --------------------------------------

    def _no_worker(self) -> None:
        raise RuntimeError("kvgate's scripted connector is scheduler-side only: no worker runs")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._no_worker()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._no_worker()

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._no_worker()

    def wait_for_save(self) -> None:
        self._no_worker()


@functools.cache
def _metadata_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    return type("KvgateScriptedMetadata", (KVConnectorMetadata,), {"__module__": MODULE})


@functools.cache
def connector_class() -> type[Any]:
    """The connector class over the installed vLLM's bases (built once)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        SupportsHMA,
    )

    def __init__(self: Any, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        self._start_script(dict(vllm_config.kv_transfer_config.kv_connector_extra_config))

    return type(
        CLASS_NAME,
        (_Scripted, KVConnectorBase_V1, SupportsHMA),
        {"__init__": __init__, "__module__": MODULE},
    )


def __getattr__(name: str) -> Any:
    # vLLM's factory resolves `kv_connector` in this module by getattr.
    if name == CLASS_NAME:
        return connector_class()
    raise AttributeError(f"module {MODULE!r} has no attribute {name!r}")
