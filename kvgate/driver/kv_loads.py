"""A KV connector's loads as vLLM's Scheduler handles them, for the op driver:
what the connector's answer does to a lookup's hit, the admission of an
asynchronous load, its completion, and a load that fails whole or in part
(the recompute and fail policies). Each function takes the driver whose
hooks it calls; the ops in `op_driver.py` call them where a connector is in play.
"""

from __future__ import annotations

from typing import Any, TypeVar

from kvgate.driver.manager_calls import ManagerCalls, Pending
from kvgate.vocabulary.ops import LIVE, Step
from kvgate.vocabulary.target import StepRefused

R = TypeVar("R")  # the target's request object


def refuse_while_loading(pending: Pending[R], step: Step, field: str = "req") -> None:
    if pending.loading:
        raise StepRefused(
            field,
            f"`{step.op}` of {step.req!r} while its KV load is in flight "
            "(only allocate, which completes it, or free finish/abort)",
        )


def connector_answer(
    driver: ManagerCalls[R],
    step: Step,
    pending: Pending[R],
    blocks: Any,
    hit: int,
    junction: int,
    diverged: bool,
) -> tuple[Any, int, int, int, bool]:
    """What the Scheduler does with a KV connector after the local
    lookup: it shows the connector the hit floored to whole scheduler
    blocks; a remote hit strictly past the local hit's sub-block tail
    replaces that tail (the hit is cut back to whole blocks, so no copy is
    made); otherwise the tail stays and nothing is loaded. A per-group
    hit deeper than some group, with nothing external, is looked up
    again as every group agrees. Returns the blocks, hit, junction,
    external tokens and whether the load is asynchronous."""
    total = len(driver.all_tokens(pending.request))
    limit = total if step.remote_async else total - 1
    if step.remote_hit > limit:
        how = "an async load" if step.remote_async else "a sync load (the last token computes)"
        raise StepRefused(
            "remote_hit", f"{step.remote_hit:,} tokens, more than {limit:,} for {how}"
        )
    if step.remote_async and step.remote_hit >= total == 1:
        # After the load the Scheduler leaves the last token to compute, so
        # nothing is computed: it looks the request up again and loads it
        # again, at every step, and the request never runs.
        raise StepRefused(
            "remote_hit",
            "an asynchronous load of a one-token prompt's only token: vLLM's Scheduler "
            "finds nothing computed after it and loads it again at every step (not modelled)",
        )
    tail = hit % driver.config.scheduler_block_size
    aligned = hit - tail
    # The connector's answer to get_num_new_matched_tokens(request, aligned).
    offered, load_async = max(0, step.remote_hit - aligned), step.remote_async
    if pending.skips_cache:
        offered, load_async = 0, False
    external = 0
    if tail and offered > tail:
        blocks = driver.truncate_computed_blocks(blocks, aligned)
        hit, external = aligned, offered
    elif not tail:
        external = offered
    if diverged and external == 0:
        blocks, hit, junction = driver.lookup(pending.request)
    return blocks, hit, junction, external, load_async and external > 0


def fail_load(driver: ManagerCalls[R], pending: Pending[R]) -> None:
    """The connector reported the request's load failed as a whole
    (`failed_recving`, the recompute policy: vLLM's for a model with
    several KV-cache groups): nothing it loaded counts, so when the
    Scheduler next reaches the request it frees its blocks
    (`_update_waiting_for_remote_kv`) and admits it afresh, a lookup
    first, in the same pass."""
    if not pending.loading:
        raise StepRefused("load_failed", "the request has no KV load in flight")
    driver.set_num_computed(pending.request, 0)
    driver.free(pending.request)
    pending.loading = False


def complete_load(driver: ManagerCalls[R], pending: Pending[R]) -> None:
    """The load finished (`_update_waiting_for_remote_kv`, which the
    Scheduler runs right before re-admitting the request): key what it
    loaded; a load of every token leaves the last one to compute."""
    request = pending.request
    computed = driver.num_computed(request)
    driver.cache_blocks(request, computed)
    if computed == len(driver.all_tokens(request)):
        driver.set_num_computed(request, computed - 1)
    pending.loading, pending.after_load = False, True


def allocate_async_load(
    driver: ManagerCalls[R], step: Step, pending: Pending[R], blocks: Any
) -> dict[str, Any]:
    """The admission of a request whose connector loads asynchronously:
    blocks for the local hit and the external tokens, nothing to compute
    and no lookahead yet, nothing keyed until the load completes, and the
    loaded blocks not zeroed (the connector's loaded groups: every group)."""
    if step.tokens != "auto":
        raise StepRefused("tokens", "the allocation of an async KV load computes nothing: use auto")
    request = pending.request
    hit, external = pending.hit, pending.external
    ok = driver.allocate_slots(
        request,
        0,
        hit,
        blocks,
        0,
        full_sequence=driver.config.reserve_full_sequence,
        external=external,
        delay_cache=True,
        skip_zeroing=tuple(range(len(driver.config.groups))),
        reserved=step.reserved,
    )
    if ok:
        driver.record_prefix_cache_stats(request, hit)
        driver.set_num_computed(request, driver.num_computed(request) + hit + external)
        pending.load_hit = hit
        pending.has_hit, pending.hit_blocks, pending.hit = False, None, 0
        pending.external, pending.load_async, pending.loading = 0, False, True
    return {"ok": ok, "tokens": 0, "prompt_done": False, "loading": ok}


def invalid_block_start(
    driver: ManagerCalls[R], pending: Pending[R], hit: int, computed: int, invalid: tuple[int, ...]
) -> tuple[int, list[int]]:
    """The first invalid block's index in the request's table (the one
    group's) and the table's ids, once the indices are checked: each
    names a block the load filled (from the hit's end to the loaded
    tokens' last block), shared with no other request. vLLM scans every
    request for the failed ids (a later one sharing a block keeps it as
    computed), but on a single group none can share one: a Mamba state
    keyed in a step is adopted only from the next step on (the
    same-step hit is deferred), after the step's output reported the
    failure. A request holding one here was scheduled before the failure
    was written: refused by name."""
    size = driver.config.scheduler_block_size
    first_loaded, end = hit // size, -(-computed // size)
    ids = driver.block_ids(pending.request)
    for index in invalid:
        if not first_loaded <= index < min(end, len(ids)) or ids[index] == 0:
            raise StepRefused(
                "invalid_blocks",
                f"block {index} is not one the KV load filled (blocks "
                f"{first_loaded}..{end - 1} of {len(ids)}, null ones excluded)",
            )
    failed = {ids[i] for i in invalid}
    for name, other in driver.requests.items():
        if other is pending or other.phase not in LIVE or not driver.has_blocks(other.request):
            continue
        if failed & set(driver.block_ids(other.request)):
            raise StepRefused(
                "invalid_blocks",
                f"a failed block is shared with {name!r}, which took it after the failed "
                "step (write the failure before that request is scheduled again)",
            )
    return invalid[0], ids


def truncate_at_invalid(
    driver: ManagerCalls[R],
    pending: Pending[R],
    sync_load: tuple[int, int, bool] | None,
    invalid: tuple[int, ...],
) -> list[int]:
    """A sync load's blocks reported invalid in the output of the step
    that loaded them: the request's computed tokens end at its first
    invalid block. Returns the ids of that block and every later one."""
    if sync_load is None:
        raise StepRefused(
            "invalid_blocks",
            "the request's last scheduled step loaded no KV synchronously "
            "(a sync load's admission, with external tokens)",
        )
    hit, before, sampled = sync_load
    if sampled:
        raise StepRefused(
            "invalid_blocks",
            "the failed step sampled (its allocate's sample): vLLM discards the output "
            "of a request whose loaded blocks failed",
        )
    first, ids = invalid_block_start(driver, pending, hit, before, invalid)
    driver.set_num_computed(pending.request, first * driver.config.scheduler_block_size)
    return ids[first:]


def complete_partial_load(
    driver: ManagerCalls[R], pending: Pending[R], invalid: tuple[int, ...]
) -> None:
    """An async load completed with some blocks invalid (policy
    recompute): the computed tokens end at the first one, the valid
    ones are keyed and the rest re-zeroed before they are recomputed
    (`_update_waiting_for_remote_kv`); the request is then re-admitted."""
    request = pending.request
    first, _ = invalid_block_start(
        driver, pending, pending.load_hit, driver.num_computed(request), invalid
    )
    valid = first * driver.config.scheduler_block_size
    if valid == 0:
        raise StepRefused(
            "invalid_blocks",
            "the request's first block failed, so nothing valid is left: the Scheduler "
            "frees it and looks it up again (write load_failed on a lookup)",
        )
    driver.set_num_computed(request, valid)
    driver.cache_blocks(request, valid)
    driver.record_blocks_for_zeroing(request, valid)
    pending.loading, pending.after_load = False, True
