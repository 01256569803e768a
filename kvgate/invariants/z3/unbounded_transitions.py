"""The manager's transition system for every pool size: quantified, over
uninterpreted sorts.

The bounded encoding (`vocabulary.py`, `transitions.py`, `properties.py`,
`checker.py`) unrolls one Z3 variable per block, request and group. Here, in
the same parts (`unbounded_vocabulary.py`, this file with its ref tokens in
`unbounded_tokens.py`, `unbounded_properties.py`, `unbounded_proof.py`),
blocks, requests and pending copies are uninterpreted sorts (`Block`,
`Req`, `Copy`) with no bound on their size, each field of a state is a Z3
function over them (`table1(r, b)`: block `b` is in request `r`'s table of
group 1), and the properties are universally quantified. A proof is then about
every pool size and every number of requests at once. The KV-cache groups
stay a fixed, finite list (one attention group, then `mamba` align-mode Mamba
groups; a model's group count is fixed by its architecture): the encoding
is built per group count.

The fragment: no function goes from a sort back to itself or forms a cycle
between sorts (`source`/`destination` go from `Copy` to `Block`, nothing goes back), the
only integers are a request's phase, reservation and peak and a block's group
(ghost) -- compared with constants, never summed over a sort -- and the
quantifier alternation is stratified (Block over Req and Copy, "some holder
of this block"). What needs an unbounded count in the bounded encoding is an
abstraction here, stated below. Each op is written as the same micro-steps
as the bounded transition, which the drift test (`tests/test_z3_drift.py`)
checks against the model; here, `tests/test_z3_unbounded.py` checks each
transition satisfiable on a finite instance of the sorts (`finite`), and
`tests/test_z3_embedding.py` maps the drift test's bounded steps onto this
encoding (`embedding.py`); both encodings derive from `hooks.Hooks`. What
this one abstracts:

- Ref counts are sets of holders. The pool's ref on a block is the set of
  its ref *tokens*, one per holder identity: a request's table entry in a
  group (`table_token<g>(r, b)`, kept while `pop` puts the block aside), a
  request's hold in a Mamba group (`hold_token<m>(r, b)`), a pending copy's
  source and destination endpoint (`source_token(c)` on `source(c)`,
  `destination_token(c)` on `destination(c)`).
  ref(b) = the number of tokens on b, by definition. Each pool call of the
  model (`touch`, `add_ref`, `free_blocks`, `get_new_blocks`) adds or removes
  the token of the holder its call site acts for. A call the integer count
  would absorb but the token set cannot -- a ref taken twice for one holder,
  a ref dropped that no holder had, a block taken from the queue while still
  referenced -- sets the block's `miscount` flag: its integer ref is then no
  longer its holder count, and `no_leak` (which forbids the flag) fails, as
  the bounded `no_leak` (ref = holders) would.
- The free queue is a set (its order is abstracted away in both encodings:
  any free block may be taken or evicted).
- Pending copies have identities (`Copy`); a new copy takes one that is not
  pending (the sort is unbounded: a state has finitely many pending copies).
- "Exactly one block" (a copy-on-write's copy, a pending tail, a hit's
  partial source) is a Skolem constant of sort Block plus a guard.
- The configuration switches are constants, free in every proof: the
  hold, the fork's retention, and per Mamba group `more_partial_states`
  (prefill checkpoint blocks or the shared-prefix checkpoint), which widens
  the same clauses as in the bounded encoding (see `transitions.py`):
  checkpoints keyed mid-block on blocks the request took, more than one
  pending tail per life, the hold alone taking a retired sub-block state,
  admission's extra whatever the hit.

A request's lifecycle is the action table's (`kvgate.vocabulary.ops`), as
in the bounded encoding: each op's guard admits the phases of its
`valid_in` (`vocabulary.phase_guard`) and leaves its request in the table's
`next_phase` (`vocabulary.phase_after`).

Mutations break the same hooks, under the same names, as in the bounded
encoding, read from the same record (`kvgate.model.mutations`, `breaks`;
`transitions.broken_hooks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import z3

from kvgate.invariants.z3.hooks import Hooks
from kvgate.invariants.z3.transitions import broken_hooks
from kvgate.invariants.z3.unbounded_tokens import Edit, copy_edit, holders_edit, one_copy, req_edit
from kvgate.invariants.z3.unbounded_vocabulary import (
    BLOCK,
    COPY,
    Fn,
    UState,
    at_most_one,
    forall,
)
from kvgate.invariants.z3.vocabulary import (
    ABORT,
    ATTENTION,
    PREEMPT,
    WAITING,
    phase_after,
    phase_guard,
)

Clause = tuple[str, Any]


class UTx:
    """One transition under construction: `next` holds the next values (the
    pre-state's functions until a micro-step rewrites them)."""

    def __init__(self, s: UState, op: str, r: Any, tag: str) -> None:
        self.s = s
        self.op = op
        self.r = r
        self.tag = tag
        self.next: dict[str, Any] = dict(s.values)
        self.clauses: list[Clause] = []

    @property
    def groups(self) -> int:
        return self.s.groups

    def view(self) -> UState:
        return UState(self.s.groups, f"{self.tag}.next", self.next)

    def require(self, what: str, expr: Any) -> None:
        self.clauses.append((f"{self.op}: {what}", expr))

    def fresh(self, name: str, *args: Any, out: Any = None) -> Any:
        rng = z3.BoolSort() if out is None else out
        if not args:
            return z3.Const(f"{self.tag}.{name}", rng)
        return z3.Function(f"{self.tag}.{name}", *args, rng)

    def named(self) -> list[Clause]:
        by_name: dict[str, list[Any]] = {}
        for name, expr in self.clauses:
            by_name.setdefault(name, []).append(expr)
        return [(name, z3.And(exprs)) for name, exprs in by_name.items()]

    # Functional updates of one request's row.
    def set_req(self, key: str, value: Any) -> None:
        old, r = self.next[key], self.r
        self.next[key] = lambda x, old=old: z3.If(x == r, value, old(x))

    def set_row(self, key: str, row: Fn, r: Any = None) -> None:
        old, r = self.next[key], self.r if r is None else r
        self.next[key] = lambda x, b, old=old: z3.If(x == r, row(b), old(x, b))

    def row(self, key: str, r: Any = None) -> Fn:
        cur, r = self.next[key], self.r if r is None else r
        return lambda b: cur(r, b)

    def map_block(self, key: str, fn: Callable[[Any, Any], Any]) -> None:
        """next[key](b) = fn(b, current value at b)."""
        old = self.next[key]
        self.next[key] = lambda b, old=old: fn(b, old(b))


class UEncoding(Hooks[UTx]):
    """The clean manager, for every size; hooks as in `transitions.Encoding`."""

    def __init__(self, groups: int, mutation: str = "clean") -> None:
        self.groups = groups
        # "clean", or the name of a mutation in `kvgate.model.mutations`
        self.name = mutation
        self.breaks = broken_hooks(mutation)

    def build(self, op: str, s: UState, r: Any, tag: str) -> UTx:
        tx = UTx(s, op, r, tag)
        if r is not None:  # the phases the action table accepts the op in
            tx.require("guard", phase_guard(s["phase"](r), op))
        getattr(self, f"op_{op}")(tx)
        return tx

    # -- pool micro-steps ----------------------------------------------------------

    def _apply_tokens(self, tx: UTx, edits: list[Edit], adding: bool) -> tuple[Fn, Fn]:
        """Apply the edits to the token fields; returns (on, clash) per block."""
        before = dict(tx.next)
        for e in edits:
            old = tx.next[e.key]
            if adding:
                tx.next[e.key] = lambda *a, old=old, e=e: z3.Or(old(*a), e.cond(*a))
            else:
                tx.next[e.key] = lambda *a, old=old, e=e: z3.And(old(*a), z3.Not(e.cond(*a)))

        def on(b: Any) -> Any:
            return z3.Or([e.on(b) for e in edits]) if edits else z3.BoolVal(False)

        def clash(b: Any) -> Any:
            parts = [e.clash(before[e.key], b, adding) for e in edits]
            return z3.Or(parts) if parts else z3.BoolVal(False)

        return on, clash

    def _miscount(self, tx: UTx, clash: Fn) -> None:
        tx.map_block("miscount", lambda b, old: z3.Or(old, clash(b)))

    def touch(self, tx: UTx, edits: list[Edit]) -> None:
        """`touch`: a ref each; a block at ref 0 leaves the free queue.
        Broken (`touch_keeps_queued`): a ref-0 block stays queued."""
        if "touch" in self.breaks:
            self.add_ref(tx, edits)
            return
        had = tx.view().has
        on, clash = self._apply_tokens(tx, edits, True)
        self._miscount(tx, clash)
        tx.map_block("free", lambda b, old: z3.And(old, z3.Not(z3.And(on(b), z3.Not(had(b))))))

    def add_ref(self, tx: UTx, edits: list[Edit]) -> None:
        """`add_ref`: a ref each; the queue is not looked at."""
        _, clash = self._apply_tokens(tx, edits, True)
        self._miscount(tx, clash)

    def free_blocks(self, tx: UTx, edits: list[Edit]) -> None:
        """`free_blocks`: a ref less each; a block left with none joins the queue."""
        had = tx.view().has
        on, clash = self._apply_tokens(tx, edits, False)
        has = tx.view().has
        self._miscount(tx, clash)
        tx.map_block("free", lambda b, old: z3.Or(old, z3.And(on(b), had(b), z3.Not(has(b)))))

    def get_new(self, tx: UTx, take: Fn, group: int | None, owners: list[Edit]) -> None:
        """`get_new_blocks`: take free blocks, drop their keys, one ref each
        (the owners' tokens); a taken block still referenced is miscounted."""
        free, had = tx.next["free"], tx.view().has
        tx.require("takes free blocks", forall((BLOCK,), lambda b: z3.Implies(take(b), free(b))))
        tx.map_block("miscount", lambda b, old: z3.Or(old, z3.And(take(b), had(b))))
        for key in ("free", "keyed", "tail_keyed"):
            tx.map_block(key, lambda b, old: z3.And(old, z3.Not(take(b))))
        if group is not None:
            tx.map_block("block_group", lambda b, old: z3.If(take(b), group, old))
        self._apply_tokens(tx, owners, True)

    # -- the hooks mutations break (`touch` too), as in `transitions.Encoding` ----------

    def cow_retain(self, tx: UTx, edits: list[Edit]) -> None:
        if "cow_retain" not in self.breaks:
            self.add_ref(tx, edits)

    def hold_enabled(self, tx: UTx) -> Any:
        return z3.BoolVal(False) if "hold_enabled" in self.breaks else tx.s["hold_on"]

    def follows(self, tx: UTx) -> Any:
        return z3.BoolVal("follows" not in self.breaks)

    def admission_extra(self, tx: UTx, partial_hit: Any, holding: Any) -> Any:
        if "admission_extra" in self.breaks:
            return z3.IntVal(0)
        upstream = z3.If(z3.And(tx.s["hold_on"], partial_hit, z3.Not(holding)), 1, 0)
        fork = tx.fresh("fork_extra", out=z3.IntSort())
        tx.require("the retained-state admission extra is 0 or 1", z3.And(fork >= 0, fork <= 1))
        return z3.If(tx.s["retain_retired"], fork, upstream)

    def supersede(self, tx: UTx, m: int, old: Fn, do_hold: Any) -> Fn:
        """Release the superseded hold; returns which old blocks stay held."""
        if "supersede" in self.breaks:
            return old
        self.free_blocks(tx, [req_edit(f"hold_token{m}", tx.r, lambda b: z3.And(do_hold, old(b)))])
        return lambda b: z3.BoolVal(False)

    def release_holds(self, tx: UTx, how: Any) -> None:
        holds = []
        for m in tx.s.mamba_ids:
            row = tx.row(f"hold{m}")
            if "release_holds" in self.breaks:  # free(abort) forgets them
                row = lambda b, row=row: z3.And(how != ABORT, row(b))  # noqa: E731
            holds.append(req_edit(f"hold_token{m}", tx.r, row))
        self.free_blocks(tx, holds)

    # -- the ops ----------------------------------------------------------------------

    def op_arrive(self, tx: UTx) -> None:
        tx.set_req("phase", z3.IntVal(phase_after("arrive")))

    def op_lookup(self, tx: UTx) -> None:
        s = tx.s
        tx.set_req("has_hit", z3.BoolVal(True))
        shape = []
        for g in s.group_ids:
            hit, src = tx.fresh(f"hit{g}", BLOCK), tx.fresh(f"src{g}", BLOCK)
            # One partial source; a Mamba hit is one state block.
            unique = [src, hit] if g != ATTENTION else [src]

            def each(b: Any, g: int = g, hit: Any = hit, src: Any = src) -> Any:
                parts = [
                    z3.Implies(hit(b), z3.And(s["keyed"](b), s["block_group"](b) == g)),
                    z3.Implies(src(b), hit(b)),
                ]
                if g != ATTENTION:
                    parts.append(z3.Implies(src(b), s["tail_keyed"](b)))
                return z3.And(parts)

            shape.append(forall((BLOCK,), each))
            shape += [at_most_one(p) for p in unique]
            tx.set_row(f"hit{g}", hit)
            tx.set_row(f"hit_source{g}", src)
        tx.require("cached blocks of the group, one partial source", z3.And(shape))

    def op_reserve(self, tx: UTx) -> None:
        return None  # reads only: the admission count is at the allocate

    def op_step(self, tx: UTx) -> None:
        return None

    def op_drain(self, tx: UTx) -> None:
        pending, src, dst = tx.s["pending"], tx.s["source"], tx.s["destination"]
        self.free_blocks(
            tx,
            [copy_edit("source_token", pending, src), copy_edit("destination_token", pending, dst)],
        )
        tx.next["pending"] = lambda c: z3.BoolVal(False)

    def op_free(self, tx: UTx) -> None:
        s, r = tx.s, tx.r
        how = tx.fresh("how", out=z3.IntSort())
        tx.require("how", z3.And(how >= 0, how <= 2))
        tables = [req_edit(f"table_token{g}", r, tx.row(f"table{g}")) for g in s.group_ids]
        self.free_blocks(tx, tables)
        self.release_holds(tx, how)  # holds go last
        self._forget(tx)
        after = {h: phase_after("free", h) for h in ("preempt", "finish")}
        tx.set_req("phase", z3.If(how == PREEMPT, after["preempt"], after["finish"]))

    def op_pop(self, tx: UTx) -> None:
        s = tx.s
        for g in s.group_ids:
            tx.set_row(f"popped_table{g}", tx.row(f"table{g}"))
        for m in s.mamba_ids:
            tx.set_row(f"popped_hold{m}", tx.row(f"hold{m}"))
        self._forget(tx)
        tx.set_req("phase", z3.IntVal(phase_after("pop")))

    def op_release(self, tx: UTx) -> None:
        s, r = tx.s, tx.r
        edits = [req_edit(f"table_token{g}", r, tx.row(f"popped_table{g}")) for g in s.group_ids]
        edits += [req_edit(f"hold_token{m}", r, tx.row(f"popped_hold{m}")) for m in s.mamba_ids]
        self.free_blocks(tx, edits)
        false = lambda b: z3.BoolVal(False)  # noqa: E731
        for g in s.group_ids:
            tx.set_row(f"popped_table{g}", false)
        for m in s.mamba_ids:
            tx.set_row(f"popped_hold{m}", false)
        tx.set_req("phase", z3.IntVal(phase_after("release")))

    def op_reset(self, tx: UTx) -> None:
        # reset_prefix_cache: with every block free, every key is forgotten;
        # with any block in use, nothing changes (the call is refused).
        free = tx.s["free"]
        clean = forall((BLOCK,), lambda b: free(b))
        for key in ("keyed", "tail_keyed"):
            tx.map_block(key, lambda b, old: z3.And(z3.Not(clean), old))

    def op_events(self, tx: UTx) -> None:
        return None  # takes the event queue: no manager state changes

    def op_stats(self, tx: UTx) -> None:
        return None  # takes the hit stats: no manager state changes

    def op_residency(self, tx: UTx) -> None:
        return None  # takes the residency metrics' events: no manager state changes

    def op_evict(self, tx: UTx) -> None:
        taken = tx.fresh("evict", BLOCK)
        free = tx.next["free"]
        self.get_new(tx, taken, None, [])
        # ... and freed at once: back in the queue at ref 0.
        tx.map_block("free", lambda b, old: z3.Or(old, z3.And(taken(b), free(b))))

    def op_allocate(self, tx: UTx) -> None:
        self._allocate_slots(tx, adopt_hit=True)

    def op_decode1(self, tx: UTx) -> None:
        self._allocate_slots(tx, adopt_hit=False)

    # -- allocate_slots -----------------------------------------------------------

    def _allocate_slots(self, tx: UTx, adopt_hit: bool) -> None:
        s, r = tx.s, tx.r
        ok = tx.fresh("ok")
        first = s["phase"](r) == WAITING
        adopt = z3.And(ok, first, s["has_hit"](r)) if adopt_hit else z3.BoolVal(False)

        # remove_skipped: the request's own Mamba states behind the running one.
        dropped: list[Edit] = []
        retained: list[tuple[int, Any, Any]] = []
        for m in s.mamba_ids:
            drop = tx.fresh(f"drop{m}", BLOCK)
            table, pending_tail = s.field("table", m), s.field("pending_tail", m)
            tx.require(
                f"skipped states are own, not the keyed tail (group {m})",
                forall(
                    (BLOCK,),
                    lambda b, drop=drop, table=table, pending_tail=pending_tail: z3.Implies(
                        drop(b), z3.And(table(r, b), z3.Not(pending_tail(r, b)))
                    ),
                ),
            )
            for key in (f"table{m}", f"own{m}"):
                row = tx.row(key)
                tx.set_row(key, lambda b, row=row, drop=drop: z3.And(row(b), z3.Not(drop(b))))
            # Holds.retire: maybe keep one keyed dropped state as the hold,
            # superseding (and freeing) the hold.
            kept, retains = tx.fresh(f"retired{m}", out=BLOCK), tx.fresh(f"retains{m}")
            tx.require(
                f"a retained state is a keyed dropped one (group {m})",
                z3.Implies(
                    retains,
                    z3.And(
                        drop(kept),
                        s["keyed"](kept),
                        # The fork keeps any keyed state; the hold alone a
                        # sub-block one (an exported prefill checkpoint).
                        z3.Or(
                            s["retain_retired"],
                            z3.And(
                                self.hold_enabled(tx),
                                s.field("more_partial_states", m),
                                s["tail_keyed"](kept),
                            ),
                        ),
                    ),
                ),
            )
            retained.append((m, kept, retains))
            hold = s.field("hold", m)
            dropped.append(
                req_edit(
                    f"table_token{m}",
                    r,
                    lambda b, drop=drop, kept=kept, retains=retains: z3.And(
                        drop(b), z3.Not(z3.And(retains, b == kept))
                    ),
                )
            )
            dropped.append(
                req_edit(
                    f"hold_token{m}",
                    r,
                    lambda b, hold=hold, retains=retains: z3.And(retains, hold(r, b)),
                )
            )
        self.free_blocks(tx, dropped)
        for m, kept, retains in retained:
            # The kept state's table ref is now the hold's.
            table_token, hold_token = tx.next[f"table_token{m}"], tx.next[f"hold_token{m}"]
            moves = lambda x, b, kept=kept, retains=retains: z3.And(  # noqa: E731
                retains, x == r, b == kept
            )
            tx.next[f"table_token{m}"] = lambda x, b, table_token=table_token, moves=moves: z3.And(
                table_token(x, b), z3.Not(moves(x, b))
            )
            tx.next[f"hold_token{m}"] = (
                lambda x, b, hold_token=hold_token, moves=moves, table_token=table_token: z3.Or(
                    hold_token(x, b), z3.And(moves(x, b), table_token(x, b))
                )
            )
            hold_row, ckpt_row = tx.row(f"hold{m}"), tx.row(f"checkpoint{m}")
            tx.set_row(
                f"hold{m}",
                lambda b, kept=kept, retains=retains, row=hold_row: z3.If(
                    retains, b == kept, row(b)
                ),
            )
            # With the hold on, the newest state held is the one to resume from.
            tx.set_row(
                f"checkpoint{m}",
                lambda b, kept=kept, retains=retains, row=ckpt_row: z3.If(
                    z3.And(retains, s["hold_on"]), b == kept, row(b)
                ),
            )

        if adopt_hit:
            # add_hit_blocks: the fresh lookup's blocks join the tables.
            block_group = s["block_group"]
            tx.require(
                "the lookup is fresh",
                z3.And(
                    [
                        forall(
                            (BLOCK,),
                            lambda b, g=g: z3.Implies(
                                z3.And(adopt, s.field("hit", g)(r, b)), block_group(b) == g
                            ),
                        )
                        for g in s.group_ids
                    ]
                ),
            )
            adopted = [
                req_edit(
                    f"table_token{g}", r, lambda b, g=g: z3.And(adopt, s.field("hit", g)(r, b))
                )
                for g in s.group_ids
            ]
            self.touch(tx, adopted)
            for g in s.group_ids:
                row = tx.row(f"table{g}")
                tx.set_row(
                    f"table{g}",
                    lambda b, row=row, g=g: z3.Or(row(b), z3.And(adopt, s.field("hit", g)(r, b))),
                )

        for g in s.group_ids:
            self._allocate_group(tx, g, ok, adopt)
        self._cache(tx, ok)

        tx.set_req("phase", z3.If(ok, phase_after(tx.op), s["phase"](r)))
        if adopt_hit:
            tx.set_req("has_hit", z3.And(s["has_hit"](r), z3.Not(ok)))
            for g in s.group_ids:
                for key in (f"hit{g}", f"hit_source{g}"):
                    row = s.field(key)
                    tx.set_row(key, lambda b, row=row: z3.And(row(r, b), z3.Not(ok)))

    def _skolem_of(self, tx: UTx, name: str, rel: Fn) -> tuple[Any, Any]:
        """A block standing for the one `rel` holds of, if any: (it, whether any)."""
        b0 = tx.fresh(name, out=BLOCK)
        tx.require(f"{name} is the one", forall((BLOCK,), lambda b: z3.Implies(rel(b), rel(b0))))
        return b0, rel(b0)

    def _allocate_group(self, tx: UTx, g: int, ok: Any, adopt: Any) -> None:
        s, r = tx.s, tx.r
        source_block, partial = self._skolem_of(
            tx, f"srcblock{g}", lambda b: s.field("hit_source", g)(r, b)
        )
        cow_new = z3.And(adopt, partial)
        if g != ATTENTION:
            tail_block, has_tail = self._skolem_of(
                tx, f"tailblock{g}", lambda b: s.field("pending_tail", g)(r, b)
            )
            move = z3.And(ok, has_tail)
        else:
            tail_block, move = None, z3.BoolVal(False)
        copies = z3.Or(cow_new, move)
        copy_block = tx.fresh(f"copy{g}", out=BLOCK)
        copy_id = tx.fresh(f"copy_id{g}", out=COPY)  # the pending copy's identity
        new = tx.fresh(f"new{g}", BLOCK)
        tx.require(
            f"group {g}: new blocks only on success, a fresh copy",
            z3.And(
                forall(
                    (BLOCK,),
                    lambda b: z3.Implies(
                        new(b), z3.And(ok, z3.Not(z3.And(copies, b == copy_block)))
                    ),
                ),
                z3.Implies(copies, z3.Not(tx.next["pending"](copy_id))),
            ),
        )

        def is_copy(b: Any) -> Any:
            return z3.And(copies, b == copy_block)

        table_owner = [
            req_edit(
                f"table_token{g}", r, lambda b: z3.Or(new(b), z3.And(cow_new, b == copy_block))
            )
        ]
        moved_dst = [one_copy("destination_token", copy_id, move, copy_block)]
        self.get_new(tx, lambda b: z3.Or(is_copy(b), new(b)), g, table_owner + moved_dst)

        # apply_cow: the copy replaces the shared source in the table; the
        # source's table ref becomes the pending copy's source endpoint.
        row = tx.row(f"table{g}")
        tx.set_row(
            f"table{g}",
            lambda b: z3.Or(
                z3.And(row(b), z3.Not(z3.And(cow_new, b == source_block))),
                z3.And(cow_new, b == copy_block),
                new(b),
            ),
        )
        own = tx.row(f"own{g}")
        tx.set_row(f"own{g}", lambda b: z3.Or(own(b), z3.And(cow_new, b == copy_block), new(b)))
        table_token = tx.next[f"table_token{g}"]
        source_token = tx.next["source_token"]
        tx.next[f"table_token{g}"] = lambda x, b: z3.And(
            table_token(x, b), z3.Not(z3.And(cow_new, x == r, b == source_block))
        )
        tx.next["source_token"] = lambda c: z3.If(
            z3.And(cow_new, c == copy_id), table_token(r, source_block), source_token(c)
        )
        self._new_copy(tx, copy_id, cow_new, source_block, copy_block)
        self.cow_retain(tx, [one_copy("destination_token", copy_id, cow_new, copy_block)])
        if g == ATTENTION:
            return

        m = g
        assert tail_block is not None
        # move_keys: the keyed tail's keys go to the copy.
        keyed, tail_keyed = tx.next["keyed"], tx.next["tail_keyed"]
        for key, cur in (("keyed", keyed), ("tail_keyed", tail_keyed)):

            def moved_key(b: Any, old: Any, cur: Fn = cur) -> Any:
                return z3.If(
                    z3.And(move, b == copy_block),
                    cur(tail_block),
                    z3.If(z3.And(move, b == tail_block), False, old),
                )

            tx.map_block(key, moved_key)
        # follow_moved_keys: others holding the tail now hold the copy.
        follow = self.follows(tx)
        hold, checkpoint = tx.next[f"hold{m}"], tx.next[f"checkpoint{m}"]

        def holder(q: Any) -> Any:
            return z3.And(move, follow, q != r, hold(q, tail_block))

        def resumer(q: Any) -> Any:
            return z3.And(move, q != r, checkpoint(q, tail_block))

        tx.next[f"hold{m}"] = lambda q, b: _moved(
            holder(q), hold(q, b), b == tail_block, b == copy_block
        )
        tx.next[f"checkpoint{m}"] = lambda q, b: _moved(
            resumer(q), checkpoint(q, b), b == tail_block, b == copy_block
        )
        self.touch(tx, [holders_edit(f"hold_token{m}", holder, copy_block)])
        self.free_blocks(tx, [holders_edit(f"hold_token{m}", holder, tail_block)])
        # The moved tail's pending copy: the source keeps a ref for it.
        self._new_copy(tx, copy_id, move, tail_block, copy_block)
        self.add_ref(tx, [one_copy("source_token", copy_id, move, tail_block)])
        pending_tail = tx.row(f"pending_tail{m}")
        tx.set_row(f"pending_tail{m}", lambda b: z3.And(pending_tail(b), z3.Not(move)))

        # Holds.hold: the hit source a new request copied from, or the copy
        # its running tail moved to, if it carries a key.
        target = z3.If(cow_new, source_block, copy_block)
        old_hold = tx.row(f"hold{m}")
        held_block, holding = self._skolem_of(tx, f"held{m}", old_hold)
        # A newer retained state (the fork's) makes the hold refuse the copy.
        refuse = tx.fresh(f"refuse{m}")
        tx.require(
            f"group {m}: only a retained hold refuses",
            z3.Implies(refuse, z3.And(s["retain_retired"], holding)),
        )
        takes = z3.And(copies, tx.next["keyed"](target), z3.Not(refuse))
        do_hold = z3.And(self.hold_enabled(tx), takes)
        self.touch(tx, [req_edit(f"hold_token{m}", r, lambda b: z3.And(do_hold, b == target))])
        kept = self.supersede(tx, m, old_hold, do_hold)
        tx.set_row(f"hold{m}", lambda b: z3.If(do_hold, z3.Or(b == target, kept(b)), old_hold(b)))
        ckpt_row = tx.row(f"checkpoint{m}")
        tx.set_row(f"checkpoint{m}", lambda b: z3.If(takes, b == target, ckpt_row(b)))

        # Ghosts: what admission reserved, and the most pinned at once.
        first = z3.And(ok, s["phase"](r) == WAITING)
        tx.set_req(
            f"reserved{m}",
            z3.If(
                first,
                self.admission_extra(
                    tx, z3.Or(z3.And(adopt, partial), s.field("more_partial_states", m)), holding
                ),
                s.field("reserved", m)(r),
            ),
        )
        # One hold at most before (one_hold): counting it is testing it.
        at_swap = z3.If(holding, 1, 0) + 1
        still = z3.And(kept(held_block), held_block != target, holding)
        held_now = z3.If(do_hold, 1 + z3.If(still, 1, 0), z3.If(holding, 1, 0))
        peak = s.field("peak", m)(r)
        tx.set_req(
            f"peak{m}",
            z3.If(first, held_now, z3.If(z3.And(move, at_swap > peak), at_swap, peak)),
        )

    def _new_copy(self, tx: UTx, copy_id: Any, when: Any, source: Any, dest: Any) -> None:
        for key, value in (
            ("pending", z3.BoolVal(True)),
            ("source", source),
            ("destination", dest),
        ):
            old = tx.next[key]
            tx.next[key] = lambda c, old=old, value=value: z3.If(
                z3.And(when, c == copy_id), value, old(c)
            )

    def _cache(self, tx: UTx, ok: Any) -> None:
        """`cache`: key some of the request's table blocks; in each Mamba group
        maybe its prompt's partial tail."""
        s, r = tx.s, tx.r
        key, mid = tx.fresh("key", BLOCK), tx.fresh("midkey", BLOCK)
        tables = {g: tx.row(f"table{g}") for g in s.group_ids}
        owns = {m: tx.row(f"own{m}") for m in s.mamba_ids}
        rules = [
            forall(
                (BLOCK,),
                lambda b: z3.Implies(key(b), z3.And(ok, z3.Or([t(b) for t in tables.values()]))),
            )
        ]
        tx.map_block("keyed", lambda b, old: z3.Or(old, key(b)))
        tx.map_block("tail_keyed", lambda b, old: z3.If(key(b), mid(b), old))
        for m in s.mamba_ids:
            tail = tx.fresh(f"tail{m}")
            at = tx.fresh(f"tailat{m}", out=BLOCK)
            tailed = s.field("tailed", m)(r)
            more = s.field("more_partial_states", m)
            rules.append(z3.Implies(tail, z3.And(ok, z3.Or(z3.Not(tailed), more))))
            rules.append(z3.Implies(tail, z3.And(owns[m](at), key(at), mid(at))))
            rules.append(
                forall(
                    (BLOCK,),
                    lambda b, m=m, tail=tail, at=at, more=more: z3.Implies(
                        z3.And(key(b), mid(b), tables[m](b)),
                        # the prompt's tail, or a checkpoint on a block it took
                        z3.Or(z3.And(tail, b == at), z3.And(more, owns[m](b))),
                    ),
                )
            )
            pending_tail = tx.row(f"pending_tail{m}")
            tx.set_row(
                f"pending_tail{m}",
                lambda b, pending_tail=pending_tail, tail=tail, at=at: z3.Or(
                    pending_tail(b), z3.And(tail, b == at)
                ),
            )
            tx.set_req(f"tailed{m}", z3.Or(tailed, tail))
        tx.require("keys own blocks, the tail once", z3.And(rules))

    def _forget(self, tx: UTx) -> None:
        s = tx.s
        false = lambda b: z3.BoolVal(False)  # noqa: E731
        tx.set_req("has_hit", z3.BoolVal(False))
        for g in s.group_ids:
            for key in ("table", "hit", "hit_source", "own"):
                tx.set_row(f"{key}{g}", false)
        for m in s.mamba_ids:
            tx.set_req(f"tailed{m}", z3.BoolVal(False))
            tx.set_req(f"reserved{m}", z3.IntVal(0))
            tx.set_req(f"peak{m}", z3.IntVal(0))
            for key in ("pending_tail", "hold", "checkpoint"):
                tx.set_row(f"{key}{m}", false)


def _moved(moves: Any, held: Any, is_source: Any, is_copy: Any) -> Any:
    return z3.If(moves, z3.Or(z3.And(held, z3.Not(is_source)), is_copy), held)
