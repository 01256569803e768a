"""Independent tasks run in worker processes or on a Ray cluster: the one pool
kvgate has, for exploration campaigns (`explore/campaign.py`) and for
`kvgate gate --jobs` / `kvgate replay --jobs` (`replay_jobs.py`).

A task is a call of a module-level function on picklable arguments; each
result comes back tagged with its task's index, as it finishes (the caller
puts them in order when order matters). With one job the tasks run in this
process, one after the other, and nothing is pickled.

Worker processes are forked from a fork server that first imported the
modules the caller names (`preload`): nothing of the caller's state is
inherited (as with spawn), and no worker pays those imports again. Spawn
where the platform has no fork server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kvgate.errors import InputError

if TYPE_CHECKING:
    import multiprocessing.context

R = TypeVar("R")

# Runs `call` on each argument tuple; yields (index, result) as each finishes.
Pool = Callable[[Callable[..., R], Sequence[tuple[Any, ...]]], Iterator[tuple[int, R]]]


def in_processes(jobs: int, preload: Sequence[str] = ()) -> Pool[Any]:
    """Tasks in `jobs` worker processes (in this one when `jobs` is 1)."""

    def run(call: Callable[..., R], tasks: Sequence[tuple[Any, ...]]) -> Iterator[tuple[int, R]]:
        if jobs == 1:
            for index, arguments in enumerate(tasks):
                yield index, call(*arguments)
            return
        # Imported only here: one job (every `kvgate replay` and gate run
        # without --jobs) starts no worker and pays no import of the pool.
        from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

        workers = min(jobs, len(tasks))
        with ProcessPoolExecutor(max_workers=workers, mp_context=_context(preload)) as pool:
            pending: dict[Future[R], int] = {
                pool.submit(call, *arguments): index for index, arguments in enumerate(tasks)
            }
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    yield pending.pop(future), future.result()

    return run


def _context(preload: Sequence[str]) -> multiprocessing.context.BaseContext:
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    return context


def on_ray(address: str) -> Pool[Any]:
    """Tasks as Ray tasks on the cluster at `address` (`local` or `local:N`
    starts a local cluster of N worker CPUs). Every node needs kvgate (and
    vLLM for what drives vLLM) importable."""
    try:
        import ray
    except ImportError:
        raise InputError("--ray: Ray is not installed (pip install 'kvgate[ray]')") from None

    def run(call: Callable[..., R], tasks: Sequence[tuple[Any, ...]]) -> Iterator[tuple[int, R]]:
        if address == "local" or address.startswith("local:"):
            cpus = int(address.partition(":")[2] or 2)
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
        try:
            task = ray.remote(call)
            pending = {task.remote(*arguments): index for index, arguments in enumerate(tasks)}
            while pending:
                finished, _ = ray.wait(list(pending), num_returns=1)
                for ref in finished:
                    yield pending.pop(ref), ray.get(ref)
        finally:
            ray.shutdown()

    return run


def in_order(results: Iterator[tuple[int, R]]) -> Iterator[R]:
    """Results tagged by index, yielded in index order as soon as every
    earlier one has come back."""
    waiting: dict[int, R] = {}
    following = 0
    for index, result in results:
        waiting[index] = result
        while following in waiting:
            yield waiting.pop(following)
            following += 1
