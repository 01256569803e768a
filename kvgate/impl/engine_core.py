"""vLLM's real `EngineCore` on CPU, with a scripted executor and no model.

`ScriptedEngine` builds the installed vLLM's `EngineCore` (the engine's
inner loop: `step`, or `step_with_batch_queue` under async scheduling) for
a trace config, with `ScriptedExecutor` in place of the workers. The
`VllmConfig` is the one the scheduler-level target builds
(`vllm_scheduler_config.vllm_config`: the tiny local hybrid model config, MTP
drafts, async scheduling as the config says), so every derived setting
(`num_lookahead_tokens`, `num_prefill_lookahead_tokens`, the lookahead
hashes, `max_concurrent_batches`) is vLLM's own derivation; only the
executor is kvgate's, named as the engine's executor backend.

The executor answers the engine's start-up calls from the config: one KV
layer per group of `vllm_build.kv_cache_config` (the Mamba pages padded to
the attention page, as vLLM's hybrid models pad them), memory for exactly
`config.num_blocks` blocks, so vLLM's own planning derives the groups, the
pool and the block sizes. Each executed batch is answered as a model runner
answers it, without running anything:

- a request samples when the batch reaches the end of the tokens it knows
  (its prompt and everything sampled for it before), otherwise (a prefill
  chunk) it samples nothing;
- a request scheduled with drafts accepts as many as the script says for
  that decode (`Script.accept`: request -> accepted counts, one per decode
  with drafts, in order; 0 when the list runs out), and samples the
  accepted drafts plus one token;
- without async scheduling, `take_draft_token_ids` proposes K drafts for
  every request that sampled (under async scheduling the engine never asks:
  the worker keeps its drafts);
- sampled token ids are a fixed function of the request and the position.

The executor's futures are already done when returned, so the engine's
batch queue runs in the order the engine itself chooses, deterministically.
`ScriptedEngine.calls` lists the executor's calls in order.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvgate.impl import _vllm_api
from kvgate.impl import vllm_scheduler_config as engine_config
from kvgate.impl.vllm_build import kv_cache_config
from kvgate.impl.vllm_errors import config_field, describe
from kvgate.impl.worker_specs import check_worker_blocks
from kvgate.vocabulary.config import Config, UnsupportedConfig

__all__ = [
    "ExecutorCall",
    "Script",
    "SchedulerCall",
    "SchedulerCalls",
    "ScriptedEngine",
    "sampled_token",
]

# The executor's vocabulary: sampled ids stay below the tiny model's vocabulary.
VOCABULARY = 1024


def sampled_token(request: str, position: int) -> int:
    """The token the executor samples for `request` at `position` (1..VOCABULARY-1)."""
    digest = hashlib.sha256(f"{request}:{position}".encode()).digest()
    return 1 + int.from_bytes(digest[:4], "big") % (VOCABULARY - 1)


@dataclass
class Script:
    """How many drafts each request accepts at each decode with drafts, in
    order (0 once its list runs out)."""

    accept: Mapping[str, Sequence[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class ExecutorCall:
    """One executor call the engine made: `execute_model` (the batch's
    number, from 1 in the order the engine scheduled them), `sample_tokens`
    (the batch it samples), or `take_draft_token_ids`."""

    call: str
    batch: int


@dataclass
class _Known:
    """What the executor knows of a request, as a worker's input batch would."""

    prompt: int
    # Tokens known: the prompt and every token sampled for it since.
    length: int
    decodes_with_drafts: int = 0


class ScriptedExecutor:
    """The executor body; `ScriptedEngine` derives a vLLM `Executor` class
    from it, bound to one script (see the module's docstring)."""

    script: Script
    calls: list[ExecutorCall]
    # Each request's tokens as sampled for it, a preemption's discarded ones dropped.
    sampled: dict[str, list[int]]
    # Each executed batch's drafts accepted, by request (batches numbered from 1).
    accepted: dict[int, dict[str, int]]
    num_blocks: int
    layer_specs: dict[str, Any]
    page_bytes: int
    spec_tokens: int

    def _init_executor(self) -> None:
        self._known: dict[str, _Known] = {}
        self._sampled = self.sampled
        self._batches = 0
        self._pending: Any = None
        self._drafts: Any = None

    # -- start-up ----------------------------------------------------------

    def collective_rpc(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"the scripted executor has no workers (asked for {method!r})")

    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        return [dict(self.layer_specs)]

    def determine_available_memory(self) -> list[int]:
        return [self.num_blocks * self.page_bytes]

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [["NHD"]]

    def set_kv_cache_layout(self, layout_name: str, cp_kv_cache_interleave_size: int) -> None:
        return None

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        return None

    def compile_or_warm_up_model(self) -> None:
        return None

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        return None

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    # -- steps -------------------------------------------------------------

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        self._batches += 1
        self.calls.append(ExecutorCall("execute_model", self._batches))
        output = self._run(scheduler_output)
        if not scheduler_output.total_num_scheduled_tokens:
            # Nothing to run: the output at once, as a model runner returns
            # its empty output (the engine samples nothing then).
            return _done(output) if non_block else output
        # Otherwise it comes from `sample_tokens`, as a model runner's does.
        self._pending = (self._batches, output)
        return _done(None) if non_block else None

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        if self._pending is None:
            raise RuntimeError("sample_tokens() without an execute_model() before it")
        (batch, output), self._pending = self._pending, None
        self.calls.append(ExecutorCall("sample_tokens", batch))
        return _done(output) if non_block else output

    def take_draft_token_ids(self) -> Any:
        self.calls.append(ExecutorCall("take_draft_token_ids", self._batches))
        drafts, self._drafts = self._drafts, None
        return drafts

    def _run(self, scheduler_output: Any) -> Any:
        from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

        for new in scheduler_output.scheduled_new_reqs:
            prompt = len(new.prompt_token_ids or ())
            self._known[new.req_id] = _Known(prompt, prompt)
            self._sampled[new.req_id] = []
        cached = scheduler_output.scheduled_cached_reqs
        computed: dict[str, int] = {
            new.req_id: int(new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs
        }
        for index, name in enumerate(cached.req_ids):
            computed[name] = int(cached.num_computed_tokens[index])
            if name in cached.resumed_req_ids:
                # Resumed after a preemption: what the Scheduler kept of its output.
                known = self._known[name]
                kept = int(cached.num_output_tokens[index])
                known.length = known.prompt + kept
                del self._sampled[name][kept:]
        for name in scheduler_output.finished_req_ids:
            self._known.pop(name, None)
        ids = [str(r) for r in scheduler_output.num_scheduled_tokens]
        drafts_of = scheduler_output.scheduled_spec_decode_tokens
        sampled: list[list[int]] = []
        for name in ids:
            known = self._known[name]
            drafts = len(drafts_of.get(name, ()))
            end = computed[name] + int(scheduler_output.num_scheduled_tokens[name]) - drafts
            if end < known.length:
                sampled.append([])  # a prefill chunk: nothing sampled
                continue
            accepted = 0
            if drafts:
                plan = self.script.accept.get(name, ())
                step = known.decodes_with_drafts
                accepted = min(plan[step], drafts) if step < len(plan) else 0
                known.decodes_with_drafts += 1
                self.accepted.setdefault(self._batches, {})[name] = accepted
            tokens = [sampled_token(name, known.length + i) for i in range(accepted + 1)]
            known.length += len(tokens)
            self._sampled[name] += tokens
            sampled.append(tokens)
        going_on = [name for name, tokens in zip(ids, sampled, strict=True) if tokens]
        self._drafts = (
            DraftTokenIds(going_on, [[0] * self.spec_tokens for _ in going_on])
            if going_on and self.spec_tokens
            else None
        )
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={name: i for i, name in enumerate(ids)},
            sampled_token_ids=sampled,
        )


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def _layer_specs(api: Any, config: Config) -> tuple[dict[str, Any], int]:
    """One KV layer per group of `config`, every page padded to the largest
    (vLLM's hybrid models pad Mamba pages to the attention page), the
    drafter's groups' layers marked as draft layers, and the page's bytes."""
    groups = kv_cache_config(api, config).kv_cache_groups
    drafts = set(config.eagle_group_ids) if config.eagle and config.has_attention else set()
    pages = [int(g.kv_cache_spec.page_size_bytes) for g in groups]
    page = max(pages)
    specs: dict[str, Any] = {}
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        if int(spec.page_size_bytes) != page:
            if "page_size_padded" not in {f.name for f in dataclasses.fields(spec)}:
                raise UnsupportedConfig("groups", "this vLLM's KV-cache spec has no page padding")
            spec = dataclasses.replace(spec, page_size_padded=page)
            if int(spec.page_size_bytes) != page:
                raise UnsupportedConfig(
                    f"groups[{index}]",
                    f"its page ({spec.page_size_bytes} bytes) cannot be padded to {page}",
                )
        if index in drafts:
            # The drafter's layer: an attention layer like the target's
            # (vLLM flags the group holding it as the drafter's).
            spec = dataclasses.replace(spec, is_draft=True)
        specs[f"model.layers.{index}.kv"] = spec
    return specs, page


class ScriptedEngine:
    """vLLM's `EngineCore` for `config`, its executor scripted by `script`."""

    def __init__(
        self,
        config: Config,
        *,
        spec_tokens: int,
        max_num_seqs: int,
        script: Script | None = None,
        log_stats: bool = True,
        plugin: str | None = None,
    ) -> None:
        """`plugin`: a vLLM plugin module registered first (the hold
        overlay, say), and the hold switches set as `config` asks, as the
        scheduler-level target does."""
        from vllm import envs
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.executor.abstract import Executor

        # The executor stands in for a real worker: it reports only the
        # layer specs one reports.
        check_worker_blocks(config)
        api, _ = _vllm_api.load_with_hold(config.hold, config.retain_retired, plugin)
        self._api = api
        self.config = config
        self.calls: list[ExecutorCall] = []
        # What the executor sampled for each request (see `ScriptedExecutor.sampled`).
        self.executor_sampled: dict[str, list[int]] = {}
        # The drafts each executed batch accepted, by request.
        self.accepted: dict[int, dict[str, int]] = {}
        specs, page = _layer_specs(api, config)
        executor = type(
            "ScriptedExecutor",
            (ScriptedExecutor, Executor),
            {
                "script": script or Script(),
                "calls": self.calls,
                "sampled": self.executor_sampled,
                "accepted": self.accepted,
                "num_blocks": config.num_blocks,
                "layer_specs": specs,
                "page_bytes": page,
                "spec_tokens": spec_tokens,
            },
        )
        with engine_config.model_runner(config):
            vllm_config = engine_config.vllm_config(config, spec_tokens, max_num_seqs, None)
            vllm_config.parallel_config.distributed_executor_backend = executor
            # The pool exactly as the trace sizes it.
            vllm_config.cache_config.num_gpu_blocks_override = config.num_blocks
            self.vllm_config = vllm_config
            was_frozen = gc.get_freeze_count()
            try:
                self.engine: Any = EngineCore(vllm_config, executor, log_stats=log_stats)
            except Exception as exc:  # the engine's refusal (memory, sizes), in one line
                message = describe(exc)
                raise UnsupportedConfig(
                    config_field(message), f"vLLM's engine core rejects it: {message}"
                ) from exc
            finally:
                # The engine core freezes the heap and caches vLLM's environment
                # switches, as a server does once it starts; a test process
                # goes on reading them.
                envs.disable_envs_cache()
                if not was_frozen:
                    gc.unfreeze()
        self._outputs: dict[str, list[int]] = {}

    @property
    def scheduler(self) -> Any:
        return self.engine.scheduler

    @property
    def batch_queue(self) -> Any:
        return self.engine.batch_queue

    def add_request(self, name: str, tokens: list[int], max_tokens: int) -> None:
        """A request as the engine hands it to the Scheduler: its own output
        length, never stopped early by an end-of-sequence token."""
        api = self._api
        request = api.Request(
            request_id=name,
            prompt_token_ids=list(tokens),
            sampling_params=api.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=self.engine.request_block_hasher,
        )
        self.engine.add_request(request)

    def abort(self, name: str) -> None:
        self.engine.abort_requests([name])

    def has_work(self) -> bool:
        """The engine has requests or batches in flight (its busy loop steps then)."""
        return bool(self.scheduler.has_requests() or self.engine.batch_queue)

    def step(self) -> list[str]:
        """One engine step (`step_fn`, then `post_step` as the busy loop runs
        them): the requests it finished."""
        outputs, executed = self.engine.step_fn()
        self.engine.post_step(executed)
        finished: list[str] = []
        for engine_outputs in (outputs or {}).values():
            for output in engine_outputs.outputs:
                self._outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
                if output.finish_reason is not None:
                    finished.append(str(output.request_id))
        return finished

    def output_tokens(self, name: str) -> list[int]:
        """The tokens the engine output for `name` so far."""
        return list(self._outputs.get(name, ()))

    def close(self) -> None:
        self.engine.shutdown()


@dataclass(frozen=True)
class SchedulerCall:
    """One call into a Scheduler: `add_request` and `finish_requests` (the
    request ids), `schedule` (the batch it makes, numbered from 1) and
    `update_from_output` (the batch whose output it processes)."""

    call: str
    batch: int = 0
    requests: tuple[str, ...] = ()
    # A schedule's (request, tokens) in order, and the requests it preempted.
    scheduled: tuple[tuple[str, int], ...] = ()
    preempted: tuple[str, ...] = ()


class SchedulerCalls:
    """The calls made into one vLLM `Scheduler` instance, in order (instance
    attributes over its methods; each call passes through unchanged), so
    whoever drives it (an engine core, kvgate's replay) can be compared."""

    def __init__(self, scheduler: Any) -> None:
        self.calls: list[SchedulerCall] = []
        # Each batch's output, kept (its id is its key) until it is processed.
        self._batches: dict[int, tuple[int, Any]] = {}
        self._made = 0
        add, schedule = scheduler.add_request, scheduler.schedule
        update, finish = scheduler.update_from_output, scheduler.finish_requests

        def logged_add(request: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(SchedulerCall("add_request", requests=(str(request.request_id),)))
            return add(request, *args, **kwargs)

        def logged_schedule(*args: Any, **kwargs: Any) -> Any:
            output = schedule(*args, **kwargs)
            self._made += 1
            self._batches[id(output)] = (self._made, output)
            self.calls.append(
                SchedulerCall(
                    "schedule",
                    self._made,
                    scheduled=tuple(
                        (str(r), int(n)) for r, n in output.num_scheduled_tokens.items()
                    ),
                    preempted=tuple(sorted(map(str, output.preempted_req_ids))),
                )
            )
            return output

        def logged_update(output: Any, *args: Any, **kwargs: Any) -> Any:
            batch, _ = self._batches.pop(id(output), (0, None))
            self.calls.append(SchedulerCall("update_from_output", batch))
            return update(output, *args, **kwargs)

        def logged_finish(request_ids: Any, *args: Any, **kwargs: Any) -> Any:
            ids = (request_ids,) if isinstance(request_ids, str) else tuple(request_ids or ())
            self.calls.append(SchedulerCall("finish_requests", requests=tuple(map(str, ids))))
            return finish(request_ids, *args, **kwargs)

        scheduler.add_request = logged_add
        scheduler.schedule = logged_schedule
        scheduler.update_from_output = logged_update
        scheduler.finish_requests = logged_finish
