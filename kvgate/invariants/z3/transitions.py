"""The manager's transition relation: one Z3 transition per primitive trace op.

`TRANSITIONS` maps every primitive op of the action table
(`kvgate.vocabulary.ops.PRIMITIVE_OPS`) but `check`, which replays nothing,
to one method of `Encoding`. A transition relates a pre-state `s` and a
next state `t` (both `vocabulary.State`) for one acting request `r`; the ops
that act on no request (`step`, `drain`, `evict`, `reset`, `events`,
`stats`) take none.

Each method follows the model's code path for that op, in the model's order,
as a sequence of pool micro-steps (`get_new`, `touch`, `add_ref`,
`free_blocks`: the model's `BlockPool` calls) over intermediate values, so a
ref count that drops to 0 and is taken again inside one op is handled as the
model handles it. What the model decides from token positions (how many
blocks a chunk needs, which states lie behind the running one, which blocks
its caching keys, whether a chunk ends at the prompt's partial tail, whether
the pool is short) is a free choice variable here, constrained only by what
the model guarantees whatever the positions:

- `remove_skipped` frees only blocks of the request's own Mamba tables, never
  the keyed tail the next chunk must move (that tail is the running block,
  which is never behind itself);
- a chunk keys only the request's own table blocks; it keys its prompt's
  partial tail at most once per life (a prefill passes that position once),
  on a block it took from the pool itself (its running block: a new block or
  its copy-on-write copy, never one adopted from a hit), and that tail is the
  only mid-block key a Mamba block ever gets -- unless the group keeps more
  partial states (below);
- a Mamba hit ends where its state's key ends, so a partial Mamba hit is on
  a mid-block key;
- a running request's hold is always superseded by its moved tail (the tail
  lies above the position it resumed from, so it is newer);
- allocation and eviction take any free blocks (the queue's order is not
  modelled);
- a lookup is fresh when its allocate adopts it: its blocks still belong to
  the group they were found in. The scheduler calls `allocate_slots` right
  after `get_computed_blocks`; a trace may put other ops in between, and a
  run whose stale hit was retaken by another group is outside this
  encoding (the drift test's runs keep lookups fresh).

- with `retain_retired` (the production fork's retention, `retain_retired`),
  `remove_skipped` may keep one keyed block it drops as the request's hold
  (its table ref becomes the hold's), superseding the hold, which it frees
  with the rest; whether the dropped state is newer than the hold is a free
  choice, and so is whether a newer held state makes `Holds.hold` refuse a
  later copy. The admission extra is then a free 0 or 1 (the fork's rule
  counts tokens);
- holds follow a producer's moved keys whatever the switches (the model
  follows them unconditionally; without retention no one holds with the
  hold off).

- with prefill checkpoint blocks or the shared-prefix checkpoint, and a
  hash unit finer than the group's block (`more_partial_states[m]`, the
  model's `more_partial_states`; one switch covers both, their union is
  encoded): a chunk may key a mid-block state on any block of its Mamba
  table it took itself (an exported checkpoint on its spare column, which
  no chunk moves), and may key a pending tail more than once per life (the
  junction's, moved like a tail, then the prompt's); `remove_skipped` may
  keep a dropped mid-block keyed state as the hold with the hold alone
  (`Holds.retire` takes sub-block positions: the checkpoint leaving the
  table), superseding the hold; admission reserves the extra block
  whatever the hit. A checkpoint the step does not keep (neither the
  prompt's, nor retained, nor the junction) has its keys dropped within
  the same `cache` call, on a column no key was on before the step: that
  step keys nothing, which is already a choice. Periodic retention only
  changes which own blocks a chunk keys, and the prefill threshold only
  how many tokens it runs: both are free choices already.

Each of these is checked, not trusted: the drift test
(`tests/test_z3_drift.py`) runs the model and requires every concrete step
to satisfy its transition.

Transition clauses are named (`op: what`), so an unsat core lists the parts
of a transition a proof used, and a failed check can name them.

Mutated transitions (`MUTATIONS`): each mutation is recorded once, in
`kvgate.model.mutations.MUTATIONS` (the model's patch, the invariant it
targets, whether upstream has it, and `breaks`: the hooks below it breaks,
one each, two for `hold_off`, the hold switch and its admission extra). An
`Encoding` built for a mutation takes each hook it breaks in its broken
form, written in the hook beside the clean one; the unbounded encoding's
hooks (`unbounded_transitions.UEncoding`) have the same names and read the
same record.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import z3

from kvgate.invariants.z3.hooks import Hooks
from kvgate.invariants.z3.vocabulary import (
    ABORT,
    ATTENTION,
    FIELDS,
    PREEMPT,
    WAITING,
    Bounds,
    Key,
    State,
    any_of,
    count,
    phase_after,
    phase_guard,
)
from kvgate.model.mutations import MUTATIONS as MODEL_MUTATIONS
from kvgate.vocabulary.ops import ACTIONS, PRIMITIVE_OPS

Clause = tuple[str, Any]  # (name, Z3 boolean)
Counts = Mapping[int, Any]  # block id -> Z3 int (or bool) of how many times


@dataclass
class Pool:
    """The pool's part of a state, threaded through an op's micro-steps."""

    ref: dict[int, Any]
    free: dict[int, Any]
    keyed: dict[int, Any]
    copy_ends: dict[int, Any]
    block_group: dict[int, Any]
    tail_keyed: dict[int, Any]


class Tx:
    """One transition under construction.

    `next` starts as the pre-state's variables (everything unchanged) and each
    micro-step rewrites the entries it changes; `close` equates the next
    state's variables with them. Fresh choice variables are named
    `<tag>.<name>` so a model can be read back step by step.
    """

    def __init__(self, s: State, op: str, r: int | None, tag: str) -> None:
        self.s = s
        self.op = op
        self.r = r
        self.tag = tag
        self.next: dict[str, dict[Key, Any]] = {f.name: s.field(f.name) for f in FIELDS}
        self.clauses: list[Clause] = []

    @property
    def req(self) -> int:
        assert self.r is not None, f"{self.op} acts on a request"
        return self.r

    def require(self, what: str, expr: Any) -> None:
        self.clauses.append((f"{self.op}: {what}", expr))

    def require_all(self, what: str, exprs: list[Any]) -> None:
        if exprs:
            self.require(what, z3.And(exprs))

    def bool(self, name: str) -> Any:
        return z3.Bool(f"{self.tag}.{name}")

    def int(self, name: str) -> Any:
        return z3.Int(f"{self.tag}.{name}")

    def pool(self) -> Pool:
        n = self.next
        return Pool(*(dict(n[name]) for name in POOL_FIELDS))

    def set_pool(self, pool: Pool) -> None:
        self.next.update({name: getattr(pool, name) for name in POOL_FIELDS})

    def successor(self) -> State:
        """The next state as expressions over the pre-state and the choices."""
        return State(self.s.bounds, f"{self.tag}.next", self.next)

    def named(self) -> list[Clause]:
        """The clauses, those of one name as one (a tracking literal names one)."""
        by_name: dict[str, list[Any]] = {}
        for name, expr in self.clauses:
            by_name.setdefault(name, []).append(expr)
        return [(name, z3.And(exprs)) for name, exprs in by_name.items()]

    def close(self, t: State) -> list[Clause]:
        """The clauses, plus one per field tying `t` to the computed values."""
        out = self.named()
        for f in FIELDS:
            variables = t.field(f.name)
            equal = [variables[k] == v for k, v in self.next[f.name].items()]
            out.append((f"{self.op}: next {f.name}", z3.And(equal)))
        return out


class Encoding(Hooks[Tx]):
    """The clean manager. `realizable` adds the constraints bounded model
    checking uses to keep counterexamples concrete (see `checker.bmc`)."""

    def __init__(self, bounds: Bounds, mutation: str = "clean", realizable: bool = False) -> None:
        self.bounds = bounds
        self.realizable = realizable
        # "clean", or the name of a mutation in `kvgate.model.mutations`
        self.name = mutation
        self.breaks = broken_hooks(mutation)

    def transition(self, op: str, s: State, t: State, r: int | None, tag: str) -> list[Clause]:
        """The named clauses of `op` taking `s` to `t`, acting on request `r`."""
        return self.build(op, s, r, tag).close(t)

    def build(self, op: str, s: State, r: int | None, tag: str) -> Tx:
        """`op` from `s`, acting on request `r`: its clauses and next values."""
        if op not in TRANSITIONS:
            raise KeyError(f"no transition for op {op!r}")
        if acts_on_request(op) != (r is not None):
            raise ValueError(f"{op}: acting request {r!r} does not fit the op")
        tx = Tx(s, op, r, tag)
        if r is not None:  # the phases the action table accepts the op in
            tx.require("guard", phase_guard(s.phase[r], op))
        TRANSITIONS[op](self, tx)
        return tx

    # -- pool micro-steps (BlockPool's calls) --------------------------------------

    def get_new(self, tx: Tx, pool: Pool, take: Mapping[int, Any], group: int | None) -> Pool:
        """`get_new_blocks`: take free blocks, drop their keys, ref 1; for
        `group` (None: an eviction burst, which frees them again at once)."""
        tx.require_all("takes free blocks", [z3.Implies(take[b], pool.free[b]) for b in take])
        out = _copy(pool)
        for b, taken in take.items():
            out.ref[b] = z3.If(taken, 1, pool.ref[b])
            out.free[b] = z3.And(pool.free[b], z3.Not(taken))
            out.keyed[b] = z3.And(pool.keyed[b], z3.Not(taken))
            out.tail_keyed[b] = z3.And(pool.tail_keyed[b], z3.Not(taken))
            if group is not None:
                out.block_group[b] = z3.If(taken, group, pool.block_group[b])
        return out

    def touch(self, tx: Tx, pool: Pool, n: Counts) -> Pool:
        """`touch`: one more ref each; a block at ref 0 leaves the free queue.
        Broken (`touch_keeps_queued`): a ref-0 block stays queued."""
        if "touch" in self.breaks:
            return self.add_ref(tx, pool, n)
        out = _copy(pool)
        for b, k in n.items():
            k = _as_int(k)
            out.ref[b] = pool.ref[b] + k
            out.free[b] = z3.And(pool.free[b], z3.Not(z3.And(k > 0, pool.ref[b] == 0)))
        return out

    def add_ref(self, tx: Tx, pool: Pool, n: Counts) -> Pool:
        """`add_ref`: one more ref on a block in use; the queue is not looked at."""
        out = _copy(pool)
        for b, k in n.items():
            out.ref[b] = pool.ref[b] + _as_int(k)
        return out

    def free_blocks(self, tx: Tx, pool: Pool, n: Counts) -> Pool:
        """`free_blocks`: one ref less each; a block reaching 0 joins the queue."""
        out = _copy(pool)
        for b, k in n.items():
            k = _as_int(k)
            out.ref[b] = pool.ref[b] - k
            reaches_zero = z3.And(k > 0, pool.ref[b] > 0, pool.ref[b] - k <= 0)
            out.free[b] = z3.Or(pool.free[b], reaches_zero)
        return out

    # -- the hooks mutations break (`touch` too) ---------------------------------------

    def cow_retain(self, tx: Tx, pool: Pool, copy: Counts) -> Pool:
        """`apply_cow`: the private copy takes a ref for the pending copy too.
        Broken (`cow_copy_unreferenced`): it does not."""
        if "cow_retain" in self.breaks:
            return pool
        return self.add_ref(tx, pool, copy)

    def hold_enabled(self, tx: Tx) -> Any:
        """`Holds.enabled`: the switch. Broken (`hold_off`): never on, as
        upstream vLLM 0.33.0."""
        return z3.BoolVal(False) if "hold_enabled" in self.breaks else tx.s.hold_on

    def follows(self, tx: Tx) -> Any:
        """Whether holds follow a producer's moved keys (`follow_moved_keys`).
        Broken (`no_follow`): they stay on the producer's block."""
        return z3.BoolVal("follows" not in self.breaks)

    def admission_extra(self, tx: Tx, partial_hit: Any, holding: Any) -> Any:
        """`Holds.admission_extra`: one block for a partial-tail hit, hold on;
        with the fork's retention, a free 0 or 1. Broken (`hold_off`,
        `no_admission_extra`): none."""
        if "admission_extra" in self.breaks:
            return z3.IntVal(0)
        upstream = z3.If(z3.And(tx.s.hold_on, partial_hit, z3.Not(holding)), 1, 0)
        fork = tx.int("fork_extra")
        tx.require("the retained-state admission extra is 0 or 1", z3.And(fork >= 0, fork <= 1))
        return z3.If(tx.s.retain_retired, fork, upstream)

    def or_more(self, tx: Tx, m: int, rule: Any, *widened: Any) -> Any:
        """`rule`, or with the group's `more_partial_states` switch on, `widened`.

        Bounded model checking (`realizable`) leaves the switch out: the
        traces it writes run without prefill checkpoint blocks or the
        shared-prefix checkpoint, and the search, sensitive to the formula's
        shape, keeps the paths it found before the switch was encoded."""
        if self.realizable:
            return rule
        return z3.Or(rule, z3.And(tx.s.more_partial_states[m], *widened))

    def supersede(
        self, tx: Tx, pool: Pool, old: Mapping[int, Any], do_hold: Any
    ) -> tuple[Pool, dict[int, Any]]:
        """`Holds.hold` releases the hold it replaces; returns the pool and
        which old blocks stay held (none). Broken (`superseded_hold_kept`):
        all stay held, with their refs."""
        if "supersede" in self.breaks:
            return pool, dict(old)
        released = {b: z3.If(z3.And(do_hold, old[b]), 1, 0) for b in old}
        return self.free_blocks(tx, pool, released), {b: z3.BoolVal(False) for b in old}

    def release_holds(self, tx: Tx, pool: Pool, n: Counts, how: Any) -> Pool:
        """Every free path releases the request's holds, last. Broken
        (`abort_keeps_hold`): `free(abort)` forgets them without a release."""
        if "release_holds" in self.breaks:
            n = {b: z3.If(how == ABORT, 0, _as_int(k)) for b, k in n.items()}
        return self.free_blocks(tx, pool, n)

    # -- the ops ----------------------------------------------------------------------

    def op_arrive(self, tx: Tx) -> None:
        r = tx.req
        tx.next["phase"][r] = z3.IntVal(phase_after("arrive"))

    def op_lookup(self, tx: Tx) -> None:
        s, r, n, bounds = tx.s, tx.req, tx.next, self.bounds
        n["has_hit"][r] = z3.BoolVal(True)
        shape = []
        for g in bounds.group_ids:
            hits, sources = [], []
            for b in bounds.block_ids:
                hit, source = tx.bool(f"hit[{g},{b}]"), tx.bool(f"src[{g},{b}]")
                shape += [
                    z3.Implies(hit, z3.And(s.keyed[b], s.block_group[b] == g)),
                    z3.Implies(source, hit),
                ]
                if g != ATTENTION:
                    # A Mamba hit ends where its state's key ends: a partial
                    # hit is on a mid-block (partial-tail) key.
                    shape.append(z3.Implies(source, s.tail_keyed[b]))
                    if self.realizable:  # ... and only there (a block keyed
                        # at both kinds of position is left out)
                        shape.append(z3.Implies(hit, source == s.tail_keyed[b]))
                n["hit"][r, g, b], n["hit_source"][r, g, b] = hit, source
                hits.append(hit)
                sources.append(source)
            shape.append(count(sources) <= 1)
            if g != ATTENTION:
                shape.append(count(hits) <= 1)  # a Mamba hit is one state block
        tx.require("cached blocks of the group, one partial source", z3.And(shape))

    def op_reserve(self, tx: Tx) -> None:
        # Reads only: the admission count is `admission_extra` at the allocate.
        return None

    def op_allocate(self, tx: Tx) -> None:
        self._allocate_slots(tx, adopt_hit=True)

    def op_decode1(self, tx: Tx) -> None:
        self._allocate_slots(tx, adopt_hit=False)

    def op_step(self, tx: Tx) -> None:
        return None  # new_step_starts clears same-step deferral, not modelled

    def op_drain(self, tx: Tx) -> None:
        pool = self.free_blocks(tx, tx.pool(), tx.s.copy_ends)
        pool.copy_ends = {b: z3.IntVal(0) for b in pool.copy_ends}
        tx.set_pool(pool)

    def op_free(self, tx: Tx) -> None:
        s, r, bounds = tx.s, tx.req, self.bounds
        how = tx.int("how")
        tx.require("how", z3.And(how >= 0, how <= 2))
        tables = {b: count(s.table[r, g, b] for g in bounds.group_ids) for b in bounds.block_ids}
        holds = {b: count(s.hold[r, m, b] for m in bounds.mamba_ids) for b in bounds.block_ids}
        pool = self.free_blocks(tx, tx.pool(), tables)
        pool = self.release_holds(tx, pool, holds, how)  # holds go last
        tx.set_pool(pool)
        self._forget(tx)
        after = {h: phase_after("free", h) for h in ("preempt", "finish")}
        tx.next["phase"][r] = z3.If(how == PREEMPT, after["preempt"], after["finish"])

    def op_pop(self, tx: Tx) -> None:
        s, r, bounds = tx.s, tx.req, self.bounds
        for b in bounds.block_ids:
            tx.next["popped"][r, b] = count(s.table[r, g, b] for g in bounds.group_ids) + count(
                s.hold[r, m, b] for m in bounds.mamba_ids
            )
        self._forget(tx)
        tx.next["phase"][r] = z3.IntVal(phase_after("pop"))

    def op_release(self, tx: Tx) -> None:
        s, r, bounds = tx.s, tx.req, self.bounds
        popped = {b: s.popped[r, b] for b in bounds.block_ids}
        tx.set_pool(self.free_blocks(tx, tx.pool(), popped))
        for b in bounds.block_ids:
            tx.next["popped"][r, b] = z3.IntVal(0)
        tx.next["phase"][r] = z3.IntVal(phase_after("release"))

    def op_reset(self, tx: Tx) -> None:
        # reset_prefix_cache: with every block free, every key is forgotten;
        # with any block in use, nothing changes (the call is refused).
        pool = tx.pool()
        clean = z3.And([pool.free[b] for b in self.bounds.block_ids])
        pool.keyed = {b: z3.And(z3.Not(clean), k) for b, k in pool.keyed.items()}
        pool.tail_keyed = {b: z3.And(z3.Not(clean), k) for b, k in pool.tail_keyed.items()}
        tx.set_pool(pool)

    def op_events(self, tx: Tx) -> None:
        return None  # takes the event queue: no manager state changes

    def op_stats(self, tx: Tx) -> None:
        return None  # takes the hit stats: no manager state changes

    def op_residency(self, tx: Tx) -> None:
        return None  # takes the residency metrics' events: no manager state changes

    def op_evict(self, tx: Tx) -> None:
        s, bounds = tx.s, self.bounds
        taken = {b: tx.bool(f"evict[{b}]") for b in bounds.block_ids}
        if self.realizable:  # the concrete trace evicts `all`
            tx.require("realizable: all", z3.And([taken[b] == s.free[b] for b in taken]))
        pool = self.get_new(tx, tx.pool(), taken, None)
        tx.set_pool(self.free_blocks(tx, pool, {b: z3.If(taken[b], 1, 0) for b in taken}))

    # -- allocate_slots -----------------------------------------------------------

    def _allocate_slots(self, tx: Tx, adopt_hit: bool) -> None:
        s, r, n, bounds = tx.s, tx.req, tx.next, self.bounds
        ok = tx.bool("ok")
        if self.realizable:
            tx.require("realizable: ok", ok)
        first = s.phase[r] == WAITING
        adopt = z3.And(ok, first, s.has_hit[r]) if adopt_hit else z3.BoolVal(False)

        # remove_skipped: runs before the pool check, so even when it fails.
        pool = tx.pool()
        freed: dict[int, Any] = {b: z3.IntVal(0) for b in bounds.block_ids}
        within = []
        for m in bounds.mamba_ids:
            # Holds.retire: maybe keep one keyed dropped state as the hold.
            keep = {b: tx.bool(f"retire[{m},{b}]") for b in bounds.block_ids}
            retained = any_of(keep.values())
            within.append(count(keep.values()) <= 1)
            for b in bounds.block_ids:
                drop = tx.bool(f"drop[{m},{b}]")
                within.append(
                    z3.Implies(drop, z3.And(s.table[r, m, b], z3.Not(s.pending_tail[r, m, b])))
                )
                # The fork keeps any keyed state; the hold alone a sub-block
                # one (a prefill checkpoint's, exported into a spare column).
                by = self.or_more(tx, m, s.retain_retired, self.hold_enabled(tx), s.tail_keyed[b])
                within.append(z3.Implies(keep[b], z3.And(drop, s.keyed[b], by)))
                n["table"][r, m, b] = z3.And(s.table[r, m, b], z3.Not(drop))
                n["own"][r, m, b] = z3.And(s.own[r, m, b], z3.Not(drop))
                superseded = z3.And(retained, s.hold[r, m, b])
                freed[b] = freed[b] + z3.If(z3.And(drop, z3.Not(keep[b])), 1, 0)
                freed[b] = freed[b] + z3.If(superseded, 1, 0)
            for b in bounds.block_ids:
                n["hold"][r, m, b] = z3.If(retained, keep[b], s.hold[r, m, b])
                # With the hold on, the newest state held is the one to resume from.
                n["checkpoint"][r, m, b] = z3.If(
                    z3.And(retained, s.hold_on), keep[b], s.checkpoint[r, m, b]
                )
        tx.require("skipped states are own, not the keyed tail; one retained", z3.And(within))
        pool = self.free_blocks(tx, pool, freed)

        # add_hit_blocks: the pending lookup, on the first allocation only.
        # The lookup is fresh: its blocks still belong to the group they were
        # found in (the scheduler allocates right after it looks up).
        if adopt_hit:
            tx.require(
                "the lookup is fresh",
                z3.And(
                    [
                        z3.Implies(z3.And(adopt, s.hit[r, g, b]), s.block_group[b] == g)
                        for g in bounds.group_ids
                        for b in bounds.block_ids
                    ]
                ),
            )
            adopted = {
                b: count(z3.And(adopt, s.hit[r, g, b]) for g in bounds.group_ids)
                for b in bounds.block_ids
            }
            pool = self.touch(tx, pool, adopted)
            for g in bounds.group_ids:
                for b in bounds.block_ids:
                    n["table"][r, g, b] = z3.Or(n["table"][r, g, b], z3.And(adopt, s.hit[r, g, b]))

        for g in bounds.group_ids:
            pool = self._allocate_group(tx, pool, g, ok, adopt)
        pool = self._cache(tx, pool, ok)
        tx.set_pool(pool)

        n["phase"][r] = z3.If(ok, phase_after(tx.op), s.phase[r])
        if adopt_hit:  # the driver clears the pending lookup on success
            n["has_hit"][r] = z3.And(s.has_hit[r], z3.Not(ok))
            for g in bounds.group_ids:
                for b in bounds.block_ids:
                    n["hit"][r, g, b] = z3.And(s.hit[r, g, b], z3.Not(ok))
                    n["hit_source"][r, g, b] = z3.And(s.hit_source[r, g, b], z3.Not(ok))

    def _allocate_group(self, tx: Tx, pool: Pool, g: int, ok: Any, adopt: Any) -> Pool:
        """One group's `allocate`: new blocks, the copy-on-write, and (Mamba)
        the tail move, following holds, and the hold itself."""
        s, r, n, bounds = tx.s, tx.req, tx.next, self.bounds
        blocks = bounds.block_ids
        partial = any_of(s.hit_source[r, g, b] for b in blocks)
        cow_new = z3.And(adopt, partial)  # a new request's partial hit
        move = (
            z3.And(ok, any_of(s.pending_tail[r, g, b] for b in blocks))
            if g != ATTENTION
            else z3.BoolVal(False)
        )
        copy = {b: tx.bool(f"copy[{g},{b}]") for b in blocks}
        new = {b: tx.bool(f"new[{g},{b}]") for b in blocks}
        tx.require(
            f"group {g}: one copy per copy-on-write, new blocks only on success",
            z3.And(
                count(copy.values()) == z3.If(z3.Or(cow_new, move), 1, 0),
                *[z3.Implies(new[b], z3.And(ok, z3.Not(copy[b]))) for b in blocks],
            ),
        )
        pool = self.get_new(tx, pool, {b: z3.Or(copy[b], new[b]) for b in blocks}, g)

        # apply_cow: the copy replaces the shared source in the table; both
        # stay referenced by the pending copy until `drain`.
        source = {b: z3.And(cow_new, s.hit_source[r, g, b]) for b in blocks}
        for b in blocks:
            n["table"][r, g, b] = z3.Or(
                z3.And(n["table"][r, g, b], z3.Not(source[b])),
                z3.And(cow_new, copy[b]),
                new[b],
            )
        for b in blocks:
            n["own"][r, g, b] = z3.Or(n["own"][r, g, b], z3.And(cow_new, copy[b]), new[b])
        pool = self.cow_retain(tx, pool, {b: z3.And(cow_new, copy[b]) for b in blocks})
        for b in blocks:
            pool.copy_ends[b] = pool.copy_ends[b] + count([source[b], z3.And(cow_new, copy[b])])
        if g == ATTENTION:
            return pool

        m = g
        tail = {b: s.pending_tail[r, m, b] for b in blocks}
        # move_keys: the keyed tail's keys go to the copy; the request keeps
        # writing the source block.
        tail_keyed = any_of(z3.And(tail[b], pool.keyed[b]) for b in blocks)
        tail_tailkey = any_of(z3.And(tail[b], pool.tail_keyed[b]) for b in blocks)
        for b in blocks:
            pool.keyed[b] = z3.If(
                z3.And(move, copy[b]),
                tail_keyed,
                z3.If(z3.And(move, tail[b]), False, pool.keyed[b]),
            )
            pool.tail_keyed[b] = z3.If(
                z3.And(move, copy[b]),
                tail_tailkey,
                z3.If(z3.And(move, tail[b]), False, pool.tail_keyed[b]),
            )
        # follow_moved_keys: others holding the source now hold the copy; the
        # specification's checkpoints follow the keys whatever the switch.
        follow = self.follows(tx)
        touched = {b: z3.IntVal(0) for b in blocks}
        released = {b: z3.IntVal(0) for b in blocks}
        for q in bounds.request_ids:
            if q == r:
                continue
            holder = z3.And(
                move, follow, any_of(z3.And(n["hold"][q, m, b], tail[b]) for b in blocks)
            )
            resumer = z3.And(
                move, any_of(z3.And(n["checkpoint"][q, m, b], tail[b]) for b in blocks)
            )
            for b in blocks:
                n["hold"][q, m, b] = _moved(holder, n["hold"][q, m, b], tail[b], copy[b])
                n["checkpoint"][q, m, b] = _moved(
                    resumer, n["checkpoint"][q, m, b], tail[b], copy[b]
                )
                touched[b] = touched[b] + z3.If(z3.And(holder, copy[b]), 1, 0)
                released[b] = released[b] + z3.If(z3.And(holder, tail[b]), 1, 0)
        pool = self.touch(tx, pool, touched)
        pool = self.free_blocks(tx, pool, released)
        for b in blocks:
            pool.copy_ends[b] = pool.copy_ends[b] + count(
                [z3.And(move, tail[b]), z3.And(move, copy[b])]
            )
        pool = self.add_ref(tx, pool, {b: z3.And(move, tail[b]) for b in blocks})
        for b in blocks:
            n["pending_tail"][r, m, b] = z3.And(s.pending_tail[r, m, b], z3.Not(move))

        # Holds.hold: the hit source a new request copied from, or the copy a
        # running request's tail moved to, if it carries a key.
        target = {b: z3.Or(source[b], z3.And(move, copy[b])) for b in blocks}
        old = {b: n["hold"][r, m, b] for b in blocks}
        # A newer retained state (the fork's) makes the hold refuse the copy.
        refuse = tx.bool(f"refuse[{m}]")
        tx.require(
            f"group {m}: only a retained hold refuses",
            z3.Implies(refuse, z3.And(s.retain_retired, any_of(old.values()))),
        )
        takes = z3.And(
            z3.Or(cow_new, move),
            any_of(z3.And(target[b], pool.keyed[b]) for b in blocks),
            z3.Not(refuse),
        )
        do_hold = z3.And(self.hold_enabled(tx), takes)
        pool = self.touch(tx, pool, {b: z3.And(do_hold, target[b]) for b in blocks})
        pool, kept = self.supersede(tx, pool, old, do_hold)
        for b in blocks:
            n["hold"][r, m, b] = z3.If(do_hold, z3.Or(target[b], kept[b]), old[b])
            n["checkpoint"][r, m, b] = z3.If(takes, target[b], n["checkpoint"][r, m, b])

        # Ghosts: what admission reserved, and the most pinned at once (the
        # old hold is released only after the moved tail's copy is taken).
        first = z3.And(ok, s.phase[r] == WAITING)
        holding = any_of(s.hold[r, m, b] for b in blocks)
        n["reserved"][r, m] = z3.If(
            first,
            self.admission_extra(tx, self.or_more(tx, m, z3.And(adopt, partial)), holding),
            s.reserved[r, m],
        )
        at_swap = count(old.values()) + 1
        n["peak"][r, m] = z3.If(
            first,
            count(n["hold"][r, m, b] for b in blocks),
            z3.If(z3.And(move, at_swap > s.peak[r, m]), at_swap, s.peak[r, m]),
        )
        return pool

    def _cache(self, tx: Tx, pool: Pool, ok: Any) -> Pool:
        """`cache`: key some of the request's table blocks; in each Mamba group
        maybe its prompt's partial tail, which the next chunk must move."""
        s, r, n, bounds = tx.s, tx.req, tx.next, self.bounds
        out = _copy(pool)
        rules = []
        keyed = {b: tx.bool(f"key[{b}]") for b in bounds.block_ids}
        # Keying may add a mid-block key or replace one by a full-block key.
        mid_block = {b: tx.bool(f"midkey[{b}]") for b in bounds.block_ids}
        for b in bounds.block_ids:
            own = any_of(n["table"][r, g, b] for g in bounds.group_ids)
            rules.append(z3.Implies(keyed[b], z3.And(ok, own)))
            out.keyed[b] = z3.Or(pool.keyed[b], keyed[b])
            out.tail_keyed[b] = z3.If(keyed[b], mid_block[b], pool.tail_keyed[b])
        for m in bounds.mamba_ids:
            tail = tx.bool(f"tail[{m}]")
            at = {b: tx.bool(f"tail[{m},{b}]") for b in bounds.block_ids}
            once = self.or_more(tx, m, z3.Not(s.tailed[r, m]))
            rules.append(z3.Implies(tail, z3.And(ok, once)))
            rules.append(count(at.values()) == z3.If(tail, 1, 0))
            for b in bounds.block_ids:
                rules.append(z3.Implies(at[b], z3.And(n["own"][r, m, b], keyed[b], mid_block[b])))
                # A Mamba block gets a mid-block key only as the prompt's
                # tail, or as a checkpoint on a block the request took.
                mid_key = z3.And(keyed[b], mid_block[b], n["table"][r, m, b])
                rules.append(z3.Implies(mid_key, self.or_more(tx, m, at[b], n["own"][r, m, b])))
                n["pending_tail"][r, m, b] = z3.Or(n["pending_tail"][r, m, b], at[b])
            n["tailed"][r, m] = z3.Or(s.tailed[r, m], tail)
        tx.require("keys own blocks, the tail once", z3.And(rules))
        return out

    def _forget(self, tx: Tx) -> None:
        """What every end of residency drops (free, preempt, pop)."""
        r, n, bounds = tx.req, tx.next, self.bounds
        false, zero = z3.BoolVal(False), z3.IntVal(0)
        n["has_hit"][r] = false
        for g in bounds.group_ids:
            for b in bounds.block_ids:
                n["table"][r, g, b] = n["hit"][r, g, b] = n["hit_source"][r, g, b] = false
                n["own"][r, g, b] = false
        for m in bounds.mamba_ids:
            n["tailed"][r, m] = false
            n["reserved"][r, m] = n["peak"][r, m] = zero
            for b in bounds.block_ids:
                n["pending_tail"][r, m, b] = n["hold"][r, m, b] = n["checkpoint"][r, m, b] = false


def _moved(moves: Any, held: Any, source: Any, copy: Any) -> Any:
    """A membership after `source`'s keys moved to `copy` (when `moves`)."""
    return z3.If(moves, z3.Or(z3.And(held, z3.Not(source)), copy), held)


def _as_int(k: Any) -> Any:
    return z3.If(k, 1, 0) if z3.is_bool(k) else k


def _copy(pool: Pool) -> Pool:
    return Pool(*(dict(getattr(pool, name)) for name in POOL_FIELDS))


POOL_FIELDS = ("ref", "free", "keyed", "copy_ends", "block_group", "tail_keyed")


TRANSITIONS: dict[str, Callable[[Encoding, Tx], None]] = {
    "arrive": Encoding.op_arrive,
    "lookup": Encoding.op_lookup,
    "reserve": Encoding.op_reserve,
    "allocate": Encoding.op_allocate,
    "decode1": Encoding.op_decode1,
    "step": Encoding.op_step,
    "drain": Encoding.op_drain,
    "free": Encoding.op_free,
    "pop": Encoding.op_pop,
    "release": Encoding.op_release,
    "evict": Encoding.op_evict,
    "reset": Encoding.op_reset,
    "events": Encoding.op_events,
    "stats": Encoding.op_stats,
    "residency": Encoding.op_residency,
}
# `check` compares state and replays nothing: it is no transition.
ENCODED_OPS: tuple[str, ...] = tuple(op for op in PRIMITIVE_OPS if op != "check")


def acts_on_request(op: str) -> bool:
    return "req" in ACTIONS[op].required


# Every mutation of the encodings: the model's (one record each).
MUTATIONS: tuple[str, ...] = tuple(MODEL_MUTATIONS)


def broken_hooks(mutation: str) -> frozenset[str]:
    """The hooks `mutation` breaks in both encodings (none for "clean")."""
    return frozenset(MODEL_MUTATIONS[mutation].breaks) if mutation != "clean" else frozenset()
