"""The named faults of the campaign: realistic one-line bugs in vLLM's block manager.

The faults themselves are data, in `faults.yaml` beside this module (what
each edits, why it is realistic, the symptom to expect); this module reads
them into `Fault` records, checking every entry's keys, once at import.
Anchors are the only vLLM text kvgate carries. Where a release only moved
the line, a `Port` names the other spelling; a build whose code holds
neither reports that fault "not applicable".

Areas: the block pool (free queue, hash map, ref counts), the Mamba align
paths (speculative blocks, state retirement, copy-on-write, same-step
deferral), the shared single-type manager (free and pop paths, admission
counts), the coordinator and `KVCacheManager` (fan-out, drain, admission,
lookup), what a deployment reads besides scheduling (prefix-cache
reset, KV-cache events, the hit stats), the Scheduler's own code, and what
async scheduling with EAGLE/MTP drafts adds (`in flight`, `draft hits`,
`draft frees`, `align split`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

# `module` short names in faults.yaml.
MODULES: dict[str, str] = {
    "pool": "vllm.v1.core.block_pool",
    "single": "vllm.v1.core.single_type_kv_cache_manager",
    "coordinator": "vllm.v1.core.kv_cache_coordinator",
    "manager": "vllm.v1.core.kv_cache_manager",
    "scheduler": "vllm.v1.core.sched.scheduler",
}


@dataclass(frozen=True)
class Port:
    """The same fault where a release moved its line: another function or
    another spelling of it. Tried, in order, when the fault's own anchor is
    not in the installed code (a probe of the code, never of a version)."""

    module: str
    qualname: str
    anchor: str
    replacement: str
    where: str  # which code shape this port fits, for the campaign's listing


@dataclass(frozen=True)
class Fault:
    name: str
    area: str
    module: str
    qualname: str  # "Class.method" or "function", inside `module`
    anchor: str  # exact text, found once in the function's source, on one line
    replacement: str
    what: str
    why: str  # why it is realistic
    symptom: str  # what it does to a deployment
    ports: tuple[Port, ...] = ()
    # The strict view's exclusion (kvgate.vocabulary.snapshot.EXCLUSIONS)
    # under which this fault changes nothing a caller can observe: a gate
    # miss is then no miss, and the campaign lists it apart.
    equivalent_under: str = ""

    def sites(self) -> tuple[Port, ...]:
        """Where the fault may apply: its own anchor first, then its ports."""
        own = Port(self.module, self.qualname, self.anchor, self.replacement, "")
        return (own, *self.ports)


# How a fault reaches the pytest process that runs vLLM's own tests under it
# (`pytest_plugin.py`), and how that process reports back: set here, where
# both sides read them, so the parent need not import pytest.
FAULT_ENV = "KVGATE_FAULT"
REPORT_ENV = "KVGATE_FAULT_REPORT"
# Not one of pytest's own exit codes (0-5).
NOT_APPLICABLE_EXIT = 17

_FAULT_KEYS = ("name", "area", "module", "function", "anchor", "replacement", "what", "why")
_PORT_KEYS = ("module", "function", "anchor", "replacement", "where")


def _fields(entry: Any, required: tuple[str, ...], optional: tuple[str, ...], where: str) -> None:
    if not isinstance(entry, Mapping):
        raise ValueError(f"faults.yaml: {where}: not a mapping")
    missing = [k for k in required if k not in entry]
    unknown = [k for k in entry if k not in required + optional]
    if missing or unknown:
        raise ValueError(f"faults.yaml: {where}: missing {missing}, unknown {unknown}")


def _fault(entry: Any, index: int) -> Fault:
    where = f"fault {index}"
    _fields(entry, (*_FAULT_KEYS, "symptom"), ("ports", "equivalent_under"), where)
    ports = []
    for i, port in enumerate(entry.get("ports", ())):
        _fields(port, _PORT_KEYS, (), f"{where} ({entry['name']}): ports[{i}]")
        ports.append(
            Port(
                MODULES.get(port["module"], port["module"]),
                port["function"],
                port["anchor"],
                port["replacement"],
                port["where"],
            )
        )
    return Fault(
        name=entry["name"],
        area=entry["area"],
        module=MODULES.get(entry["module"], entry["module"]),
        qualname=entry["function"],
        anchor=entry["anchor"],
        replacement=entry["replacement"],
        what=entry["what"],
        why=entry["why"],
        symptom=entry["symptom"],
        ports=tuple(ports),
        equivalent_under=entry.get("equivalent_under", ""),
    )


def load_faults() -> tuple[Fault, ...]:
    """Every fault of faults.yaml, in its order."""
    text = resources.files(__package__).joinpath("faults.yaml").read_text()
    return tuple(_fault(entry, i) for i, entry in enumerate(yaml.safe_load(text)))


FAULTS: tuple[Fault, ...] = load_faults()
BY_NAME: dict[str, Fault] = {f.name: f for f in FAULTS}
# The areas, in the table's order of first appearance.
AREAS: tuple[str, ...] = tuple(dict.fromkeys(f.area for f in FAULTS))
# The areas of the faults async scheduling with EAGLE/MTP drafts adds: the
# classes of defect that configuration brings.
DRAFT_AREAS = ("in flight", "draft frees", "draft hits", "align split")


def select(names: Iterable[str] | None) -> list[Fault]:
    """The named faults, in table order; every fault when `names` is None."""
    if names is None:
        return list(FAULTS)
    wanted = list(dict.fromkeys(names))
    unknown = [n for n in wanted if n not in BY_NAME]
    if unknown:
        raise KeyError(f"unknown fault(s): {', '.join(unknown)} (see `kvgate mutate --list`)")
    return [f for f in FAULTS if f.name in wanted]
