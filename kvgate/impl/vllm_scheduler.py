"""vLLM's real `Scheduler` (v1, CPU, no weights) as a scheduler-level target.

`VllmScheduler` builds the installed vLLM's `Scheduler` for a trace config
from the `VllmConfig` and `KVCacheConfig` that `vllm_scheduler_config.py`
resolves as vLLM's engine would (a tiny local hybrid model config, no
weights; what vLLM derives checked against the trace, a mismatch an
`UnsupportedConfig` naming the field), and drives it.

Each engine step is `schedule()`, then `update()` with fake model-runner
output (`ModelRunnerOutput`: the tokens each request sampled, every draft
rejected) and the next drafts (`update_draft_token_ids`). A wrapper on the
owned manager's `get_computed_blocks` (an instance attribute; the call
passes through unchanged) records each lookup's hit, and, before a
follow-up's lookup, how much of the turn it follows the attention group
still has cached. The manager's state is read through `vllm_view.ManagerView`.
With KV-cache events on (`config.kv_events`) the Scheduler publishes through
vLLM's null publisher, whose `publish` is wrapped the same way (an instance
attribute; each batch kept, then passed on unchanged).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from typing import Any

from kvgate.impl import _vllm_api
from kvgate.impl import vllm_scheduler_config as engine_config
from kvgate.impl.vllm_build import block_hasher, kv_cache_config, request_inputs
from kvgate.impl.vllm_connector import ConnectorScript, ExternalHit
from kvgate.impl.vllm_errors import config_field, describe
from kvgate.impl.vllm_probe import (
    hold_source,
    holds_partial_tails,
    retains_retired,
    takes_streaming_input,
)
from kvgate.impl.vllm_scheduler_config import ConnectorSettings
from kvgate.impl.vllm_view import ManagerView
from kvgate.vocabulary.config import (
    Config,
    UnsupportedConfig,
)
from kvgate.vocabulary.events import KvEvent
from kvgate.vocabulary.scheduling import (
    COW_RETENTION,
    PREFIX_CACHE_STATS_KEYS,
    DeferredFree,
    OutputAccounting,
    PrefillStats,
    PrefixCacheStats,
    ScheduledStep,
)
from kvgate.vocabulary.snapshot import Snapshot, StepView
from kvgate.vocabulary.target import Capabilities, StepRefused
from kvgate.vocabulary.tokens import NO_INPUTS, HashInputs

__all__ = ["VllmScheduler"]

# The draft token ids handed back after each step: never verified (every
# draft is rejected), so never part of a token sequence.
DRAFT_TOKEN = 0


def _size_encoder(scheduler: Any, config: Config) -> str:
    """Give the Scheduler, built for a text model, the encoder budget and
    encoder cache a multimodal model's engine would size from `config`, so
    requests with multimodal items run as on a vision-language hybrid.
    Probed on the Scheduler's own attributes: what the build lacks for it,
    or "" once done."""
    cache = getattr(scheduler, "encoder_cache_manager", None)
    if cache is None or not hasattr(scheduler, "max_num_encoder_input_tokens"):
        return "this vLLM's Scheduler has no encoder budget and encoder cache"
    try:
        sized = type(cache)(cache_size=config.encoder_cache_slots)
    except TypeError:
        return "this vLLM's encoder cache cannot be built with a size of its own"
    scheduler.encoder_cache_manager = sized
    scheduler.max_num_encoder_input_tokens = config.encoder_budget
    return ""


def _processed_item() -> Any:
    """An image's processed data as an engine hands it to the Scheduler
    with a new request (a one-byte stand-in: the Scheduler never reads it,
    but under the v2 model runner it tracks which requests' items the
    worker holds), or None where the build cannot make one."""
    from vllm.multimodal import inputs

    make = getattr(getattr(inputs, "MultiModalKwargsItem", None), "dummy", None)
    return make() if callable(make) else None


def _check_connector_support() -> None:
    from kvgate.impl.vllm_connector import missing_support

    missing = missing_support()
    if missing:
        raise UnsupportedConfig(
            "kv_connector",
            "this vLLM's Scheduler cannot take kvgate's scripted KV connector: it lacks "
            + ", ".join(missing),
        )


def _scripted_connector(scheduler: Any) -> ConnectorScript:
    """The script of the connector the Scheduler built (it must be ours)."""
    from kvgate.impl.vllm_connector import connector_class

    connector: Any = getattr(scheduler, "connector", None)
    if not isinstance(connector, connector_class()):
        raise UnsupportedConfig(
            "kv_connector",
            "this vLLM's Scheduler did not build the configured KV connector "
            f"(its connector: {type(connector).__name__})",
        )
    script: ConnectorScript = connector.script
    return script


class VllmScheduler:
    """The installed vLLM's `Scheduler`, driven one engine step at a time."""

    capabilities: Capabilities

    def __init__(
        self,
        config: Config,
        *,
        spec_tokens: int,
        max_num_seqs: int,
        plugin: str | None = None,
        connector: ConnectorSettings | None = None,
        engine_sizes: bool = True,
    ) -> None:
        """`engine_sizes` off runs a Mamba block vLLM's engine would not
        resolve for the config (one finer than max_model_len without prefix
        caching: the Scheduler accepts it), for a study of what the Scheduler
        does there; on (the default, and the `workload` command's), such a
        config is refused by name."""
        self.config = config
        self.spec_tokens = spec_tokens
        api, plugin_module = _vllm_api.load_with_hold(config.hold, config.retain_retired, plugin)
        self._api = api
        # Its model is a Qwen3-Next-class hybrid: a pure Mamba model would be
        # another model.
        if not config.has_attention:
            raise UnsupportedConfig(
                "groups", "the vllm-scheduler target runs a hybrid model: a full_attention group"
            )
        if spec_tokens == 0 and config.eagle:
            raise UnsupportedConfig("eagle", "the eagle drop needs draft tokens (spec > 0)")
        if connector is None and config.kv_connector:
            connector = ConnectorSettings(
                load_failure_policy=config.kv_load_failure_policy,
                divergent_hits=config.kv_connector_divergent_hits,
            )
        if connector is not None and config.hash_lookahead_tokens:
            # VllmConfig.num_hash_lookahead_tokens is 0 under any KV connector.
            raise UnsupportedConfig(
                "hash_lookahead_tokens",
                "vLLM keeps legacy block hashes (and the eagle drop) with a KV connector",
            )
        if connector is not None:
            _check_connector_support()
        try:
            from vllm.v1.structured_output import StructuredOutputManager

            with engine_config.model_runner(config):
                vllm_config = engine_config.vllm_config(
                    config, spec_tokens, max_num_seqs, connector
                )
                engine_config.check_mode(vllm_config, config)
                scheduler_class = engine_config.scheduler_class(vllm_config, config)
                kv_config = kv_cache_config(api, config)
                hash_block = engine_config.engine_sizes(
                    vllm_config, kv_config, config, engine_sizes
                )
                scheduler = scheduler_class(
                    vllm_config=vllm_config,
                    kv_cache_config=kv_config,
                    structured_output_manager=StructuredOutputManager(vllm_config),
                    block_size=config.scheduler_block_size,
                    hash_block_size=hash_block,
                    # Stats are made each update (the prefix-cache stats, and
                    # the residency metrics drained when they are on), as an
                    # engine logging stats does.
                    log_stats=not config.disable_log_stats,
                )
        except UnsupportedConfig:
            raise
        except Exception as exc:  # pydantic, ValueError or a bare assert
            message = describe(exc)
            raise UnsupportedConfig(
                config_field(message), f"vLLM's Scheduler rejects it: {message}"
            ) from exc
        engine_config.check_derived(scheduler, config, spec_tokens, hash_block)
        # What this build lacks to schedule encoder inputs ("": nothing).
        self._encoder_lacks = _size_encoder(scheduler, config)
        self._mm_data = _processed_item()
        if self._encoder_lacks and (config.encoder_compute_budget or config.encoder_cache_size):
            field = (
                "encoder_compute_budget" if config.encoder_compute_budget else "encoder_cache_size"
            )
            raise UnsupportedConfig(field, self._encoder_lacks)
        self._script: ConnectorScript | None = (
            None if connector is None else _scripted_connector(scheduler)
        )
        self._scheduler: Any = scheduler
        manager = scheduler.kv_cache_manager
        self._view = ManagerView(api, manager, config.hash_unit, config.hash_lookahead_tokens)
        self._hasher: Any = block_hasher(api, config)
        managers = self._view.managers
        hold = holds_partial_tails(api, managers, config.hold)
        self.capabilities = Capabilities(
            implementation=f"vllm {api.version} Scheduler",
            partial_hits=bool(getattr(manager.coordinator, "enable_partial_hash_hits", False)),
            hold=hold,
            hold_source=hold_source(managers, plugin, plugin_module) if hold else "",
            retain_retired=retains_retired(api, managers),
            release=api.version,
        )
        self.streaming_input = takes_streaming_input(api, scheduler)
        # The engine's pauses (`pause_generation`) set the Scheduler's state.
        self.pause_states = callable(getattr(scheduler, "set_pause_state", None))
        # The event batches the Scheduler published, not yet taken.
        self._published: list[Any] = []
        if config.kv_events:
            self._capture_published(scheduler)
        # Every request ever added, by name (finished ones too: a follow-up's
        # check reads the turn it follows).
        self._requests: dict[str, Any] = {}
        self._follows: dict[str, str] = {}
        # Requests no later entry names, kept while another request needs them.
        self._forgettable: set[str] = set()
        # Streaming-input sessions: their tokens are rewritten at each chunk
        # (and their hashes recomputed at a lookup), which the view follows.
        self._sessions: set[str] = set()
        self._admitted: set[str] = set()
        # The scheduled batches whose output is not processed yet, oldest
        # first (one at a time without async scheduling).
        self._outputs: deque[Any] = deque()
        # Each deferred free's blocks as `pop_blocks_for_free` returned them,
        # by request (the Scheduler's queue holds the same lists).
        self._popped: list[tuple[str, Any]] = []
        # The reuse gaps of each eviction event the stats drained, not yet taken.
        self._evictions: list[int] = []
        # The prefix-cache stats the last update reported, not yet taken.
        self._prefix_cache_stats: PrefixCacheStats | None = None
        # The prefill stats the last update's outputs carried, not yet taken.
        self._prefill_stats: dict[str, PrefillStats] = {}
        self._step = ScheduledStep()
        # Requests a stop condition ends in the next update (`stop`).
        self._stopping: set[str] = set()
        # The admission's own local lookup: with a connector that restores
        # lagging Mamba states, the per-group one (which may fall back to, and
        # be followed by a reconciling, `get_computed_blocks`: not lookups of
        # their own).
        divergent = connector is not None and connector.divergent_hits
        name_of_lookup = "get_computed_blocks_for_connector" if divergent else "get_computed_blocks"
        lookup = getattr(manager, name_of_lookup)

        def observed_lookup(request: Any, *args: Any, **kwargs: Any) -> Any:
            name = request.request_id
            previous = self._follows.get(name)
            if previous is not None and name not in self._admitted:
                cached = self._view.attention_cached(self._requests[previous])
                self._step.checked[name] = cached
            result = lookup(request, *args, **kwargs)
            self._step.lookups.append((name, int(result[1])))
            return result

        setattr(manager, name_of_lookup, observed_lookup)
        pop_blocks = manager.pop_blocks_for_free

        def observed_pop(request: Any) -> Any:
            blocks = pop_blocks(request)
            self._popped.append((str(request.request_id), blocks))
            return blocks

        manager.pop_blocks_for_free = observed_pop
        session_update = getattr(scheduler, "_update_request_as_session", None)
        if self.streaming_input and session_update is not None:

            def observed_session_update(session: Any, update: Any) -> Any:
                # Index the session's hashes before its next chunk rewrites
                # its tokens: a hash the rewrite keeps may cover, in its
                # lookahead tokens, the sampled token the chunk drops.
                self._view.index_now(str(session.request_id))
                return session_update(session, update)

            scheduler._update_request_as_session = observed_session_update
        if self._script is not None:
            allocate = manager.allocate_slots

            def observed_allocation(request: Any, *args: Any, **kwargs: Any) -> Any:
                result = allocate(request, *args, **kwargs)
                # Only the waiting queue's calls pass the lookup's blocks.
                if result is not None and "new_computed_blocks" in kwargs:
                    self._step.taken.append(
                        (
                            str(request.request_id),
                            int(kwargs.get("num_new_computed_tokens", 0)),
                            int(kwargs.get("num_external_computed_tokens", 0)),
                            bool(kwargs.get("delay_cache_blocks", False)),
                        )
                    )
                return result

            manager.allocate_slots = observed_allocation

    def _capture_published(self, scheduler: Any) -> None:
        """Keep every KV event batch the Scheduler hands its publisher (an
        instance attribute over the publisher's `publish`, which still runs)."""
        publisher = scheduler.kv_event_publisher
        publish = publisher.publish

        def captured(batch: Any) -> Any:
            self._published.append(batch)
            return publish(batch)

        publisher.publish = captured

    @property
    def scheduler(self) -> Any:
        """The vLLM `Scheduler` under test."""
        return self._scheduler

    @property
    def connector_script(self) -> ConnectorScript:
        """The scripted KV connector's answers and record (a Scheduler built
        with `connector` only)."""
        if self._script is None:
            raise RuntimeError("this Scheduler was built without a KV connector")
        return self._script

    def add_request(
        self,
        name: str,
        tokens: list[int],
        max_tokens: int,
        follows: str | None,
        inputs: HashInputs = NO_INPUTS,
        resumable: bool = False,
        priority: int = 0,
        skip_prefix_cache: bool = False,
    ) -> None:
        # An adapter enters the hashes and, under `max_loras`, the waiting
        # scan; the engine refuses one without a LoRA config (so does the
        # trace reader, before anything runs).
        if inputs.lora and not self.config.max_loras:
            raise StepRefused(
                "lora", f"request {name!r}: adapter {inputs.lora!r} without a LoRA config"
            )
        if inputs.mm and self._encoder_lacks:
            raise UnsupportedConfig("mm", f"request {name!r}: {self._encoder_lacks}")
        if name in self._requests:
            raise StepRefused("req", f"request {name!r} already added")
        limit = self.config.max_model_len
        if len(tokens) + max_tokens > limit:
            # vLLM's input processing refuses it before the scheduler sees it.
            raise StepRefused(
                "prompt",
                f"{len(tokens)} prompt + {max_tokens} output tokens exceed max_model_len {limit}",
            )
        api = self._api
        # Under the priority policy ties go to the earlier arrival: requests
        # arrive one a time unit apart, in the trace's order (a clock could
        # read the same twice, and the request ids would then decide).
        ranked = (
            {"priority": priority, "arrival_time": float(len(self._requests))}
            if self.config.scheduling_policy == "priority"
            else {}
        )
        request = self._request(
            name,
            tokens,
            max_tokens,
            skip_prefix_cache,
            block_hasher=self._hasher,
            **ranked,
            **request_inputs(api, inputs, self._mm_data if inputs.mm else None),
            **({"resumable": True} if resumable else {}),
        )
        if resumable:
            self._sessions.add(name)
        self._requests[name] = request
        if follows is not None:
            self._follows[name] = follows
        self._view.track(name, request, inputs)
        self._scheduler.add_request(request)

    def add_chunk(self, name: str, tokens: list[int], max_tokens: int) -> None:
        """As vLLM's engine sends a session's next input chunk: a resumable
        request with the session's id, which the Scheduler takes at once if
        the session waits for input, and queues otherwise."""
        self._send_again(name, tokens, max_tokens, resumable=True)

    def end_session(self, name: str) -> None:
        """As vLLM's engine ends a session: the request id again, not resumable."""
        self._send_again(name, [], 1, resumable=False)

    def _send_again(self, name: str, tokens: list[int], max_tokens: int, resumable: bool) -> None:
        self._scheduler.add_request(self._request(name, tokens, max_tokens, resumable=resumable))
        self._view.rewritten(name)

    def _request(
        self,
        name: str,
        tokens: list[int],
        max_tokens: int,
        skip_prefix_cache: bool = False,
        **fields: Any,
    ) -> Any:
        """A vLLM `Request` as the engine hands it over: its own output
        length, never stopped early by an end-of-sequence token; one that
        skips the prefix cache says so as prompt logprobs would."""
        api = self._api
        return api.Request(
            request_id=name,
            prompt_token_ids=tokens,
            sampling_params=api.SamplingParams(
                max_tokens=max_tokens,
                ignore_eos=True,
                skip_reading_prefix_cache=True if skip_prefix_cache else None,
                # As a router asking for a lookup's hits as events too.
                extra_args=(
                    {"kv_cache_report_mode": "full"} if self.config.kv_events_full else None
                ),
            ),
            pooling_params=None,
            **fields,
        )

    def schedule(self) -> ScheduledStep:
        self._step = step = ScheduledStep()
        running = {r.request_id for r in self._scheduler.running}
        output = self._scheduler.schedule()
        self._outputs.append(output)
        step.scheduled = [(str(r), int(n)) for r, n in output.num_scheduled_tokens.items()]
        step.preempted = sorted(str(r) for r in output.preempted_req_ids)
        for name, _ in step.lookups:
            if name in self._sessions:
                # With lookahead hashes the Scheduler recomputes a session's
                # hashes before its lookup.
                self._view.rewritten(name)
        hits = dict(step.lookups)
        # With a connector the hit an admission takes can be less than its
        # lookup's (a local sub-block tail superseded): the allocation's.
        hits.update((r, local) for r, local, _, _ in step.taken)
        step.admitted = [(r, hits.get(r, 0)) for r, _ in step.scheduled if r not in running]
        self._admitted.update(r for r, _ in step.admitted)
        step.copies = [
            [int(c.src_block_id), int(c.dst_block_id)] for c in (output.kv_cache_block_copies or ())
        ]
        step.encoder_inputs = {
            str(r): [int(i) for i in items]
            for r, items in (getattr(output, "scheduled_encoder_inputs", None) or {}).items()
            if items
        }
        if self._script is not None:
            queries = self._script.take_queries()
            step.connector_queries = [
                (q.request, q.presented, q.answered, q.load_async) for q in queries
            ]
        return step

    def script_external(self, name: str, tokens: int, load_async: bool, undecided: int = 0) -> None:
        self.connector_script.hits[name] = ExternalHit(tokens, load_async, undecided)

    def update(
        self,
        sampled: Mapping[str, list[int]],
        *,
        loaded: Collection[str] = (),
        failed: Collection[str] = (),
    ) -> list[str]:
        """As `SchedulerTarget.update`; with a connector, also the
        asynchronous loads the worker finished this step (`loaded`) and those
        that failed (`failed`), as its `KVConnectorOutput` reports them (a
        failed receive is also a finished one)."""
        from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput

        if not self._outputs:
            raise RuntimeError("update() without a schedule() before it")
        output = self._outputs.popleft()
        if (loaded or failed) and self._script is None:
            raise RuntimeError("KV loads reported to a Scheduler without a connector")
        ids = [str(r) for r in output.num_scheduled_tokens]
        for name in self._stopping:
            # The last token it gets in this output is its last: vLLM's stop
            # check ends it there.
            request = self._requests[name]
            request.max_tokens = request.num_output_tokens + max(1, len(sampled.get(name, ())))
        self._stopping.clear()
        kv_output = None
        if loaded or failed:
            kv_output = KVConnectorOutput(
                finished_recving={*loaded, *failed}, failed_recving=set(failed)
            )
        # Under async scheduling a request may have ended (aborted) while
        # this batch ran: only the ones this output finishes are reported.
        ended = {r for r in ids if self._requests[r].is_finished()}
        # Each request's index in the batch: a release whose output has no
        # such map reads it from the order of `req_ids`.
        indices: dict[str, Any] = {}
        if "req_id_to_index" in getattr(ModelRunnerOutput, "__dataclass_fields__", {}):
            indices["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
        runner_output = ModelRunnerOutput(
            req_ids=ids,
            sampled_token_ids=[list(sampled.get(r, ())) for r in ids],
            kv_connector_output=kv_output,
            **indices,
        )
        outputs = self._scheduler.update_from_output(output, runner_output)
        for engine_output in outputs.values():
            for output_of_request in engine_output.outputs:
                reported = output_of_request.prefill_stats
                if reported is not None:
                    self._prefill_stats[str(output_of_request.request_id)] = (
                        int(reported.num_cached_tokens),
                        int(reported.num_cache_creation_tokens),
                    )
            stats = engine_output.scheduler_stats
            if stats is not None:
                reported = stats.prefix_cache_stats
                self._prefix_cache_stats = {
                    key: getattr(reported, key) for key in PREFIX_CACHE_STATS_KEYS
                }
                self._evictions += [
                    len(e.reuse_gaps_seconds) for e in stats.kv_cache_eviction_events
                ]
        finished = [r for r in ids if r not in ended and self._requests[r].is_finished()]
        # The drafter proposes K tokens for every request that goes on (the
        # Scheduler drops them for a prefill chunk); under async scheduling
        # the engine leaves them to the worker.
        going_on = [r for r in ids if not self._requests[r].is_finished()]
        if going_on and self.spec_tokens and not self.config.async_scheduling:
            self._scheduler.update_draft_token_ids(
                DraftTokenIds(going_on, [[DRAFT_TOKEN] * self.spec_tokens for _ in going_on])
            )
        for r in ids:
            if r in self._sessions:
                # A session that stopped may have taken its next chunk.
                self._view.rewritten(r)
            else:
                self._view.touched(r)
        return finished

    def stop(self, name: str) -> None:
        self._stopping.add(name)

    def abort(self, name: str) -> None:
        from vllm.v1.request import RequestStatus

        self._scheduler.finish_requests(name, RequestStatus.FINISHED_ABORTED)

    def pause(self, mode: str) -> None:
        from vllm.v1.core.sched.interface import PauseState

        states = {
            "keep": PauseState.PAUSED_ALL,
            "wait": PauseState.PAUSED_NEW,
            "": PauseState.UNPAUSED,
        }
        self._scheduler.set_pause_state(states[mode])

    def reset_prefix_cache(self, running: bool, connector: bool = False) -> tuple[bool, list[str]]:
        ok = bool(
            self._scheduler.reset_prefix_cache(
                reset_running_requests=running, reset_connector=connector
            )
        )
        return ok, [str(r.request_id) for r in self._scheduler.waiting]

    def take_prefill_stats(self) -> dict[str, PrefillStats]:
        stats, self._prefill_stats = self._prefill_stats, {}
        return stats

    def take_prefix_cache_stats(self) -> PrefixCacheStats | None:
        stats, self._prefix_cache_stats = self._prefix_cache_stats, None
        return stats

    def take_evictions(self) -> list[int]:
        evictions, self._evictions = self._evictions, []
        return evictions

    def take_kv_events(self) -> list[KvEvent]:
        batches, self._published = self._published, []
        return self._view.kv_events(event for batch in batches for event in batch.events)

    def kv_cache_usage(self) -> float:
        return float(self._scheduler.get_kv_cache_usage())

    def has_requests(self) -> bool:
        return bool(self._scheduler.has_requests())

    def batches_in_flight(self) -> int:
        return len(self._outputs)

    def deferred_frees(self) -> list[DeferredFree]:
        """The Scheduler's `deferred_frees` (none in a release without them),
        each named by the request whose blocks it holds (a copy-on-write
        retention's by that name)."""
        owners = {id(blocks): name for name, blocks in self._popped}
        return [
            (int(fence), owners.get(id(blocks), COW_RETENTION))
            for fence, blocks in getattr(self._scheduler, "deferred_frees", ())
        ]

    def output_accounting(self) -> dict[str, OutputAccounting]:
        counts = {
            str(name): (
                int(request.num_output_placeholders),
                int(request.num_in_flight_tokens),
                int(request.num_stale_output_tokens),
            )
            for name, request in self._scheduler.requests.items()
            if not request.is_finished()
        }
        return {name: c for name, c in counts.items() if any(c)}

    def forget(self, names: list[str]) -> None:
        """Drop what is kept of each ended request of `names` (no later
        entry names it): the request, and its hashes in the view's index."""
        self._forgettable.update(names)
        if not self._forgettable:
            return
        # A batch in flight may still carry an aborted request's output; a
        # request not yet admitted reads the one it follows at its lookup.
        needed = {str(r) for output in self._outputs for r in output.num_scheduled_tokens}
        needed |= {f for r, f in self._follows.items() if r not in self._admitted}
        for name in list(self._forgettable):
            request = self._requests.get(name)
            if request is not None and (not request.is_finished() or name in needed):
                continue
            self._forgettable.discard(name)
            if request is None:
                continue
            del self._requests[name]
            self._follows.pop(name, None)
            self._sessions.discard(name)
            self._admitted.discard(name)
            self._view.forget(name)

    def _kept_aside(self) -> dict[str, Any]:
        """Each deferred free's blocks by the request they were popped from."""
        owners = {id(blocks): name for name, blocks in self._popped}
        queued = getattr(self._scheduler, "deferred_frees", ())
        popped = {owners[id(b)]: b for _, b in queued if id(b) in owners}
        # Released lists are forgotten (their ids could be reused).
        self._popped = [(n, b) for n, b in self._popped if n in popped]
        return popped

    def snapshot(self) -> Snapshot:
        return self._view.snapshot(self._kept_aside())

    def take_changed_blocks(self) -> set[int]:
        return self._view.take_changed_blocks()

    def step_view(self, blocks: Collection[int], requests: Collection[str]) -> StepView:
        return self._view.step_view(self._kept_aside(), blocks, requests)

    def close(self) -> None:
        self._outputs.clear()
        self._popped.clear()
        self._view.close()
        self._requests.clear()
        self._scheduler = None
