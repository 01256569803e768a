"""The interface both Z3 encodings implement: every transition hook and op.

The bounded encoding (`transitions.Encoding`: one variable per block,
request and group) and the unbounded one
(`unbounded_transitions.UEncoding`: functions over uninterpreted sorts)
write the same transitions twice, as the same
micro-steps under the same names. Both classes derive from `Hooks`, so a
hook or an op one of them lacks makes it abstract, and building it is a
type error (strict mypy, `tests/test_lint.py`) as well as a run-time one.

`TxT` is the backend's transition under construction (`transitions.Tx`,
`unbounded_transitions.UTx`). The pool micro-steps and the hold's release
take the backend's own picture of the pool after it (a ref count per block; ref
tokens edited per holder), so their remaining arguments are the
backend's; the rest share one signature.

What they encode is checked in two steps: the drift test
(`tests/test_z3_drift.py`) maps every model step onto a bounded
transition, and the embedding test (`tests/test_z3_embedding.py`,
`embedding.py`) maps those bounded steps onto unbounded ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Generic, TypeVar

TxT = TypeVar("TxT")


class Hooks(ABC, Generic[TxT]):
    """Every hook a mutation may break (`kvgate.model.mutations`, `breaks`)
    and one method per encoded op (`transitions.ENCODED_OPS`)."""

    breaks: frozenset[str]

    # -- pool micro-steps: the model's `BlockPool` calls ---------------------------

    @abstractmethod
    def get_new(self, tx: TxT, *args: Any, **kwargs: Any) -> Any:
        """`get_new_blocks`: take free blocks for a group (or an eviction)."""

    @abstractmethod
    def touch(self, tx: TxT, *args: Any, **kwargs: Any) -> Any:
        """`touch`: a ref each; a block at ref 0 leaves the free queue."""

    @abstractmethod
    def add_ref(self, tx: TxT, *args: Any, **kwargs: Any) -> Any:
        """`add_ref`: a ref each; the queue is not looked at."""

    @abstractmethod
    def free_blocks(self, tx: TxT, *args: Any, **kwargs: Any) -> Any:
        """`free_blocks`: a ref less each; a block left with none joins the queue."""

    # -- the hooks mutations break ---------------------------------------------------

    @abstractmethod
    def cow_retain(self, tx: TxT, *args: Any, **kwargs: Any) -> Any:
        """`apply_cow`: the private copy's ref for the pending copy."""

    @abstractmethod
    def supersede(self, tx: TxT, *args: Any, **kwargs: Any) -> Any:
        """`Holds.hold` releases the hold it replaces."""

    @abstractmethod
    def release_holds(self, tx: TxT, *args: Any, **kwargs: Any) -> Any:
        """Every free path releases the request's holds, last."""

    @abstractmethod
    def hold_enabled(self, tx: TxT) -> Any:
        """`Holds.enabled`: the hold switch."""

    @abstractmethod
    def follows(self, tx: TxT) -> Any:
        """Whether holds follow a producer's moved keys."""

    @abstractmethod
    def admission_extra(self, tx: TxT, partial_hit: Any, holding: Any) -> Any:
        """`Holds.admission_extra`: the block admission reserves for the hold."""

    # -- the ops, one per primitive op of the action table but `check` --------------

    @abstractmethod
    def op_arrive(self, tx: TxT) -> None: ...

    @abstractmethod
    def op_lookup(self, tx: TxT) -> None: ...

    @abstractmethod
    def op_reserve(self, tx: TxT) -> None: ...

    @abstractmethod
    def op_allocate(self, tx: TxT) -> None: ...

    @abstractmethod
    def op_decode1(self, tx: TxT) -> None: ...

    @abstractmethod
    def op_step(self, tx: TxT) -> None: ...

    @abstractmethod
    def op_drain(self, tx: TxT) -> None: ...

    @abstractmethod
    def op_free(self, tx: TxT) -> None: ...

    @abstractmethod
    def op_pop(self, tx: TxT) -> None: ...

    @abstractmethod
    def op_release(self, tx: TxT) -> None: ...

    @abstractmethod
    def op_evict(self, tx: TxT) -> None: ...

    @abstractmethod
    def op_reset(self, tx: TxT) -> None: ...

    @abstractmethod
    def op_events(self, tx: TxT) -> None: ...

    @abstractmethod
    def op_stats(self, tx: TxT) -> None: ...

    @abstractmethod
    def op_residency(self, tx: TxT) -> None: ...

    # -- allocate_slots, as both write it ----------------------------------------------

    @abstractmethod
    def _allocate_slots(self, tx: TxT, adopt_hit: bool) -> None:
        """`allocate` and `decode1`: remove_skipped, each group, then caching."""

    @abstractmethod
    def _allocate_group(self, tx: TxT, *args: Any, **kwargs: Any) -> Any:
        """One group's part of an allocation."""

    @abstractmethod
    def _cache(self, tx: TxT, *args: Any, **kwargs: Any) -> Any:
        """What a chunk keys."""

    @abstractmethod
    def _forget(self, tx: TxT) -> None:
        """A request's rows cleared when its life ends."""


HOOK_NAMES: tuple[str, ...] = tuple(
    sorted(
        name for name in vars(Hooks) if getattr(getattr(Hooks, name), "__isabstractmethod__", False)
    )
)
