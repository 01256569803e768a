"""Record what vLLM's `Scheduler` does as scheduler-level traces.

A vLLM general plugin (entry point group `vllm.general_plugins`, name
`kvgate_record`). vLLM calls `register()` in every process of the
environment; it wraps nothing unless `KVGATE_RECORD=DIR` is set when the
process starts. Then `install()` wraps the entry points of vLLM's
`Scheduler` class (its constructor, `add_request`, `schedule`,
`update_from_output`, `finish_requests`, `reset_prefix_cache`, `set_pause_state`,
`shutdown`) and each
`Scheduler` built afterwards writes its history to `DIR` as scheduler-level
traces (docs/scheduler-traces.md): the config read from the engine's own
KV-cache and scheduler settings, then one `engine` entry per call, with what
the real Scheduler did as each step's expectations.

What is written (docs/how-to/record-and-replay.md is the user's page):

- token ids are renamed: position i of a prompt becomes the id of the
  prefix-trie node of the prompt's first i + 1 tokens, so two prompts share
  renamed ids exactly as far as they share a prefix, and nothing else of the
  tokens survives; a prompt that continues a finished request's whole
  sequence (its prompt and output) is written as `all_of` that request, then
  the renamed rest. Request ids are renamed in arrival order, cache salts
  are hashed;
- an abort between a `schedule()` and its update (a client gone, or a stop
  string the server's detokenizer met, while the step ran) is written in
  that step's `abort`;
- drafts a request accepted: without async scheduling, on the step that
  sampled them (`accept`: the drafts it kept, after a stop or its
  `max_tokens` cut the rest);
- each entry is flushed to its file as it is made (under async scheduling
  with drafts, a step entry once its batch's update says how many drafts
  were accepted, which it carries as `accept`, and the entries made
  meanwhile after it), and each file ends with
  an `end` line counting its entries, so a file cut short (a killed
  process) holds every entry before the cut and is detected by the reader
  (`kvgate replay --partial` replays the entries before the cut); a file is
  opened with its first entry, so none holds a head alone;
- bounded: a file is closed at a size or an entry limit and the recording
  goes on at once in the next part, which follows it (`follows`: its
  requests and renamed tokens carry on, and a replay reads the parts in
  order); after the last file allowed recording stops. Every file's end is
  logged with why it ended. A write that fails (disk full, permissions) logs
  one line and stops recording; a call the format cannot express (a
  request that errors, a KV connector, ...) ends the
  file before it, logs one
  line and stops recording. Nothing the recorder does raises into the
  engine: every wrapper calls vLLM's own method whatever happens;
- under async scheduling, one `step` entry per engine step as vLLM's engine
  core steps its batch queue (`EngineCore.step_with_batch_queue`): a
  `schedule()` ends its step unless two batches are then in flight or
  nothing more can be scheduled, in which case the update of the oldest
  batch ends it; an update with no `schedule()` before it in its step is a
  step of its own.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import logging
import math
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvgate.conformance.writer import recording_end, recording_entry, recording_head
from kvgate.model.scope import validate
from kvgate.vocabulary.config import Config, GroupConfig, UnsupportedConfig
from kvgate.vocabulary.scheduling import ASYNC_BATCHES, EngineSettings

__all__ = [
    "RECORD_SWITCH",
    "RecordLimits",
    "install",
    "is_installed",
    "register",
    "uninstall",
]

# The opt-in: the directory recordings are written to.
RECORD_SWITCH = "KVGATE_RECORD"
# The knobs bounding what one engine process writes.
MAX_BYTES_SWITCH = "KVGATE_RECORD_MAX_BYTES"
MAX_ENTRIES_SWITCH = "KVGATE_RECORD_MAX_STEPS"
MAX_FILES_SWITCH = "KVGATE_RECORD_MAX_FILES"
# vLLM logs under the "vllm" logger tree; a child gets its handler.
LOGGER_NAME = "vllm.plugins.kvgate_record"
# Renamed token ids start here, far above the ids kvgate's model hands out
# for sampled tokens when a recording is replayed, so the two never meet.
RENAMED_BASE = 1 << 32
# The per-instance attribute holding a Scheduler's recording.
ATTR = "_kvgate_recording"
# The Scheduler methods wrapped, in the order a step calls them.
WRAPPED = (
    "__init__",
    "add_request",
    "schedule",
    "update_from_output",
    "finish_requests",
    "reset_prefix_cache",
    "set_pause_state",
    "shutdown",
)

_logger = logging.getLogger(LOGGER_NAME)
_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}
_scheduler_count = 0


@dataclass(frozen=True)
class RecordLimits:
    """How much one Scheduler may write: bytes and entries per file, files in all."""

    max_bytes: int = 4 * 2**20  # below the reader's 8 MiB file limit
    max_entries: int = 50_000
    max_files: int = 16

    @classmethod
    def from_environment(cls) -> RecordLimits:
        def number(name: str, default: int) -> int:
            text = os.environ.get(name, "").strip()
            if not text:
                return default
            if not text.isdigit() or int(text) < 1:
                _logger.warning(
                    "kvgate recorder: %s=%r is not a number >= 1; using %d",
                    name,
                    text[:40],
                    default,
                )
                return default
            return int(text)

        return cls(
            number(MAX_BYTES_SWITCH, cls.max_bytes),
            number(MAX_ENTRIES_SWITCH, cls.max_entries),
            number(MAX_FILES_SWITCH, cls.max_files),
        )


class NotExpressible(Exception):
    """What the Scheduler did that a scheduler-level trace cannot say."""


def register() -> None:
    """The entry point, which vLLM calls in every process: record only if
    the user opted in (`KVGATE_RECORD=DIR`)."""
    directory = os.environ.get(RECORD_SWITCH, "").strip()
    if directory:
        install(Path(directory), RecordLimits.from_environment())


def is_installed() -> bool:
    return bool(_originals)


def install(
    directory: Path,
    limits: RecordLimits | None = None,
    opener: Callable[[Path], IO[str]] | None = None,
) -> None:
    """Wrap the `Scheduler` class's entry points in this process (idempotent):
    each Scheduler built from now on records into `directory`. `opener`
    opens a file to write (tests pass one that fails)."""
    with _lock:
        if _originals:
            return
        from vllm.v1.core.sched.scheduler import Scheduler

        settings = _Settings(directory, limits or RecordLimits(), opener or _open)
        for name in WRAPPED:
            if name not in Scheduler.__dict__:
                continue  # a release without it (pause states) never calls it
            original = Scheduler.__dict__[name]
            wrapper = (
                _wrap_init(original, settings) if name == "__init__" else _wrap(name, original)
            )
            functools.update_wrapper(
                wrapper, original, assigned=("__name__", "__qualname__", "__doc__")
            )
            wrapper.__module__ = __name__
            _originals[name] = original
            setattr(Scheduler, name, wrapper)
        if not _exit_registered:
            # An engine that exits without shutting its Scheduler down still
            # ends each file with its end line.
            atexit.register(_close_all)
            _exit_registered.append(True)


def uninstall() -> None:
    """Put vLLM's own methods back; recordings in progress are closed."""
    with _lock:
        if not _originals:
            return
        from vllm.v1.core.sched.scheduler import Scheduler

        for name, original in _originals.items():
            setattr(Scheduler, name, original)
        _originals.clear()
        _close_all("the recorder was uninstalled")


_exit_registered: list[bool] = []


def _close_all(why: str = "the process exits") -> None:
    for recording in list(_Recording.open_ones):
        recording.close(why)


def _open(path: Path) -> IO[str]:
    return path.open("x", encoding="utf-8")


@dataclass(frozen=True)
class _Settings:
    directory: Path
    limits: RecordLimits
    opener: Callable[[Path], IO[str]]


def _wrap_init(original: Callable[..., Any], settings: _Settings) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        global _scheduler_count
        try:
            with _lock:
                _scheduler_count += 1
                number = _scheduler_count
            setattr(self, ATTR, _Recording(self, settings, number))
        except Exception as error:  # never into the engine
            _logger.warning("kvgate recorder: not recording this Scheduler: %s", error)

    return __init__


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        recording: _Recording | None = getattr(self, ATTR, None)
        if recording is None or recording.stopped or recording.depth:
            # Not recording, or a call the Scheduler makes from inside one
            # that is recorded (an abort inside add_request, say).
            return original(self, *args, **kwargs)
        before = recording.guarded(lambda: recording.before(name, args, kwargs))
        recording.depth += 1
        try:
            result = original(self, *args, **kwargs)
        except BaseException:
            recording.depth -= 1
            recording.guarded(lambda: recording.stop(f"vLLM's {name} raised"))
            raise
        recording.depth -= 1
        recording.guarded(lambda: recording.after(name, args, kwargs, before, result))
        return result

    return wrapper


# ---------------------------------------------------------------- the config


def engine_config(scheduler: Any) -> tuple[Config, EngineSettings]:
    """The trace config and engine settings of a built `Scheduler`, read from
    its own KV-cache config and settings. Raises `NotExpressible`."""
    from kvgate.impl import _vllm_api
    from kvgate.impl.hold_overlay import switch_on
    from kvgate.impl.vllm_probe import (
        holds_partial_tails,
        is_mamba,
        model_runner,
        retains_retired,
    )

    api = _vllm_api.load()
    if getattr(scheduler, "connector", None) is not None:
        raise NotExpressible("a KV connector (its answers are not in scheduler-level traces)")
    manager = scheduler.kv_cache_manager
    managers = list(manager.coordinator.single_type_managers)
    groups: list[GroupConfig] = []
    modes: set[str] = set()
    for index, group in enumerate(scheduler.kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if type(spec) is api.FullAttentionSpec:
            groups.append(GroupConfig("full_attention", int(spec.block_size)))
        elif type(spec) is api.MambaSpec:
            alignment = getattr(spec, "prefill_checkpoint_alignment", None)
            groups.append(
                GroupConfig(
                    "mamba_align",
                    int(spec.block_size),
                    speculative_blocks=int(spec.num_speculative_blocks),
                    prefill_checkpoint_blocks=int(
                        getattr(spec, "num_prefill_checkpoint_blocks", 0) or 0
                    ),
                    prefill_checkpoint_alignment=None if alignment is None else int(alignment),
                )
            )
            modes.add(str(spec.mamba_cache_mode))
        else:
            raise NotExpressible(f"KV-cache group {index} is a {type(spec).__name__}")
    if len(modes) > 1:
        raise NotExpressible(f"Mamba groups in several cache modes: {sorted(modes)}")
    cache = scheduler.cache_config
    caching = bool(cache.enable_prefix_caching)
    split = int(getattr(cache, "block_size", 0) or 0)
    if "align" in modes and split and split != int(scheduler.block_size):
        # The Scheduler splits align-mode prefills at the cache config's block
        # size, which the engine left apart from its own block size (vLLM's
        # CPU platform sizes the attention block in the worker only); a
        # trace has one block size for both.
        raise NotExpressible(
            f"prefills split at block size {split} while the Scheduler's block size is "
            f"{int(scheduler.block_size)} (start the engine with --block-size "
            f"{int(scheduler.block_size)})"
        )
    lookahead = int(getattr(scheduler, "num_hash_lookahead_tokens", 0))
    attention = [g.block_size for g in groups if g.kind == "full_attention"]
    # A patched build without the per-manager flag: its switch, as its managers read it.
    switch = switch_on(_vllm_api.RETAIN_SWITCH)
    config = Config(
        num_blocks=int(manager.block_pool.num_gpu_blocks),
        # Without prefix caching nothing is hashed: the unit sizes nothing
        # compared, and the attention block stands in for it.
        hash_unit=int(scheduler.hash_block_size) if caching else min(attention or [1]),
        groups=tuple(groups),
        eagle=bool(getattr(scheduler, "use_eagle_block_drop", False)) or lookahead > 0,
        retention_interval=getattr(scheduler.kv_cache_config, "prefix_cache_retention_interval", 0),
        hold=holds_partial_tails(api, managers, switch),
        retain_retired=retains_retired(api, managers),
        scheduler_block_size=int(scheduler.block_size),
        max_model_len=int(scheduler.max_model_len),
        max_num_scheduled_tokens=int(scheduler.max_num_scheduled_tokens),
        # The recorded engine's model runner, replayed the same.
        model_runner=model_runner(scheduler)[0],
        # The engine's LoRA adapter limit (0: no LoRA config).
        max_loras=int(getattr(getattr(scheduler, "lora_config", None), "max_loras", 0) or 0),
        # A release without policies serves requests first come, first served.
        scheduling_policy=(
            "priority"
            if getattr(getattr(scheduler, "policy", None), "value", "fcfs") == "priority"
            else "fcfs"
        ),
        long_prefill_token_threshold=int(scheduler.scheduler_config.long_prefill_token_threshold),
        long_prefill_token_threshold_adaptive=bool(
            getattr(scheduler, "adaptive_long_prefill_threshold", False)
        ),
        shared_prefix_checkpoint=bool(
            getattr(cache, "enable_mamba_shared_prefix_checkpoint", False)
        ),
        hash_lookahead_tokens=lookahead,
        prefix_caching=caching,
        mamba_cache_mode="none" if "none" in modes else "align",
        async_scheduling=bool(getattr(scheduler.scheduler_config, "async_scheduling", False)),
    )
    if not any(is_mamba(api, m) for m in managers):
        raise NotExpressible("no Mamba group (kvgate models hybrid and Mamba models)")
    try:
        validate(config)
    except UnsupportedConfig as error:
        raise NotExpressible(f"config.{error.field}: {error.message}") from None
    settings = EngineSettings(
        spec=int(getattr(scheduler, "num_spec_tokens", 0)),
        max_num_seqs=int(scheduler.max_num_running_reqs),
    )
    if config.async_scheduling:
        # A replay steps the Scheduler as an engine core with this many
        # batches in flight does.
        in_flight = int(getattr(scheduler.vllm_config, "max_concurrent_batches", 1))
        if in_flight != ASYNC_BATCHES:
            raise NotExpressible(f"async scheduling with {in_flight} batches in flight")
    return config, settings


def _returned_with_drafts(output: Any, runner: Any) -> dict[str, tuple[int, int]]:
    """For each request `output` scheduled with drafts: (its drafts, the
    tokens the model runner's output `runner` returned for it)."""
    drafts = {
        str(r): len(ids)
        for r, ids in (getattr(output, "scheduled_spec_decode_tokens", None) or {}).items()
        if ids
    }
    if not drafts or runner is None:
        return {}
    sampled = getattr(runner, "sampled_token_ids", None) or []
    index = getattr(runner, "req_id_to_index", None) or {}
    return {
        r: (n, len(sampled[index[r]]) if r in index and index[r] < len(sampled) else 0)
        for r, n in drafts.items()
    }


# ------------------------------------------------------------- the recording


@dataclass
class _Renamer:
    """Token ids renamed to prefix-trie nodes; finished sequences remembered
    so a prompt continuing one is written as `all_of` it."""

    # (parent node, token) -> node; node 0 is the empty prefix.
    nodes: dict[tuple[int, int], int] = field(default_factory=dict)
    # A request's prompt: (its length, the node it ends at).
    prompts: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Finished sequences by length, then by hash: (name, sequence, end node).
    finished_by_length: dict[int, dict[int, tuple[str, tuple[int, ...], int]]] = field(
        default_factory=dict
    )

    def walk(self, tokens: Iterable[int], node: int = 0) -> list[int]:
        """The node of each prefix of `tokens` after `node` (added when new)."""
        path: list[int] = []
        nodes = self.nodes
        for token in tokens:
            key = (node, token)
            found = nodes.get(key)
            if found is None:
                found = nodes[key] = len(nodes) + 1
            node = found
            path.append(node)
        return path

    def continued(self, tokens: list[int]) -> tuple[str, int, int] | None:
        """The longest finished sequence `tokens` starts with: (its request,
        its length, its end node)."""
        for length in sorted(self.finished_by_length, reverse=True):
            if length > len(tokens):
                continue
            head = tuple(tokens[:length])
            found = self.finished_by_length[length].get(hash(head))
            if found is not None and found[1] == head:
                return found[0], length, found[2]
        return None

    def prompt(self, name: str, tokens: list[int]) -> tuple[list[dict[str, Any]], str | None]:
        """Request `name`'s prompt as segments, and the finished request it continues."""
        continued = self.continued(tokens)
        follows, start, node = continued if continued is not None else (None, 0, 0)
        path = self.walk(tokens[start:], node)
        self.prompts[name] = (len(tokens), path[-1] if path else node)
        segments: list[dict[str, Any]] = []
        if follows is not None:
            segments.append({"all_of": follows})
        if path:
            segments.append({"tokens": [RENAMED_BASE + n for n in path]})
        return segments, follows

    def finished(self, name: str, sequence: list[int]) -> None:
        """Request `name` finished with this whole sequence (prompt and output)."""
        prompt_length, node = self.prompts.pop(name)
        path = self.walk(sequence[prompt_length:], node)
        whole = tuple(sequence)
        by_hash = self.finished_by_length.setdefault(len(whole), {})
        by_hash[hash(whole)] = (name, whole, path[-1] if path else node)


def _salt(salt: str) -> str:
    return "salt-" + hashlib.sha256(salt.encode()).hexdigest()[:16]


def _adapter(name: str) -> str:
    return "lora-" + hashlib.sha256(name.encode()).hexdigest()[:16]


class _Recording:
    """One Scheduler's history, written as it happens."""

    open_ones: set[_Recording] = set()

    def __init__(self, scheduler: Any, settings: _Settings, number: int) -> None:
        self.scheduler = scheduler
        self.settings = settings
        self.stem = f"rec-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{number}"
        self.depth = 0
        self.stopped = False
        # The part being written (1 is the first file); its file is opened
        # with its first entry, so no file holds a head without entries.
        self.part = 1
        self.files = 0  # files opened so far
        self.file: IO[str] | None = None
        self.bytes = 0
        self.entries = 0
        self.config, self.engine = engine_config(scheduler)
        import vllm

        self.vllm_version = str(getattr(vllm, "__version__", "unknown"))
        # The device vLLM's platform runs the engine on: a CPU build's
        # recording names its deployment family by it.
        from vllm.platforms import current_platform

        device = str(getattr(current_platform, "device_type", "") or "")
        self.device = device if re.fullmatch(r"[a-z][a-z0-9_]{0,31}", device) else ""
        self.names: dict[str, str] = {}
        self.requests: dict[str, Any] = {}
        self.renamer = _Renamer()
        # The last arrival's time: a replay ranks equal priorities by arrival.
        self.last_arrival = -math.inf
        # Each LoRA adapter seen, by name: (its id, its path).
        self.adapters: dict[str, tuple[int, str]] = {}
        # The engine step begun by a schedule() whose update is the same
        # step's (the step's expectations so far), or None between steps.
        self.pending: dict[str, Any] | None = None
        # The batches scheduled and not yet processed, oldest first (one at
        # most without async scheduling).
        self.in_flight: deque[dict[str, Any]] = deque()
        self.deferred: list[dict[str, Any]] = []
        # Under async scheduling with drafts: the entries made but not yet
        # written, in order, and the step entries among them that scheduled a
        # batch with drafts whose output is not processed yet (by the batch's
        # output id): each gets its `accept` at that update, then is written
        # with the entries behind it.
        self.held: list[dict[str, Any]] = []
        self.awaiting_accept: dict[int, dict[str, Any]] = {}
        _Recording.open_ones.add(self)

    # -- control ----------------------------------------------------------

    def guarded(self, call: Callable[[], Any]) -> Any:
        """Run part of the recording; whatever it raises stops recording."""
        if self.stopped:
            return None
        try:
            return call()
        except NotExpressible as reason:
            self.stop(f"{reason} is not expressible in a scheduler-level trace")
        except OSError as error:
            self.stop(f"writing failed ({error})", wrote=False)
        except Exception as error:
            self.stop(f"internal error ({type(error).__name__}: {error})")
        return None

    def stop(self, why: str, wrote: bool = True) -> None:
        if self.stopped:
            return
        if wrote:
            # What was made before the inexpressible call, up to a step whose
            # accepted drafts are not known yet.
            self.write_held()
            if self.stopped:
                return
        self.held.clear()
        self.awaiting_accept.clear()
        self.stopped = True
        _logger.warning(
            "kvgate recorder: stopped recording %s after %d files: %s",
            self.stem,
            self.files,
            why,
        )
        self.close("recording stopped", write_end=wrote)
        # Nothing more is written: what the recording kept goes.
        self.requests.clear()
        self.renamer = _Renamer()
        self.deferred.clear()
        self.pending = None

    def close(self, why: str, write_end: bool = True, final: bool = True) -> None:
        """End the file being written (its end line counts its entries),
        logging `why`; `final`: nothing more is recorded (the entries held
        are written first, up to a step whose accepted drafts are not known)."""
        if final and write_end and not self.stopped:
            self.write_held()
        file, self.file = self.file, None
        if final:
            _Recording.open_ones.discard(self)
        if file is None:
            return
        with contextlib.suppress(OSError):
            try:
                if write_end:
                    file.write(recording_end(self.entries))
            finally:
                file.close()
        _logger.info(
            "kvgate recorder: %s ended (%d entries, %s): %s",
            self.path.name,
            self.entries,
            "end line written" if write_end else "no end line: replay it with --partial",
            why,
        )

    @property
    def path(self) -> Path:
        return self.settings.directory / f"{self.stem}.{self.part:03d}.yaml"

    def open_part(self) -> None:
        """Open the current part's file and write its head: part 1 starts the
        recording; each later part follows the one before it (`follows`),
        carrying on its requests' names and renamed tokens, so a replay reads
        the parts in order (docs/how-to/record-and-replay.md)."""
        self.settings.directory.mkdir(parents=True, exist_ok=True)
        self.file = self.settings.opener(self.path)
        self.files += 1
        recording: dict[str, Any] = {"vllm": self.vllm_version, "part": self.part}
        if self.device:
            recording["device"] = self.device
        if self.part > 1:
            recording["follows"] = f"{self.stem}.{self.part - 1:03d}.yaml"
        head = recording_head(
            self.path.stem,
            self.config,
            self.engine,
            recording,
            about=f"Recorded from vLLM {self.vllm_version}'s Scheduler, file {self.part}"
            + (f" (follows file {self.part - 1})" if self.part > 1 else ""),
        )
        self.entries = 0
        self.bytes = len(head.encode())
        self.file.write(head)

    def emit(self, entry: dict[str, Any]) -> None:
        """An entry made: written now, or held behind a step whose accepted
        drafts are not known yet."""
        self.held.append(entry)
        if len(self.held) == 1 and not self.awaiting(entry):
            self.held.clear()
            self.write(entry)

    def awaiting(self, entry: dict[str, Any]) -> bool:
        return any(entry is e for e in self.awaiting_accept.values())

    def write_held(self) -> None:
        """Write the entries held, up to the first still awaiting its accept."""
        while self.held and not self.awaiting(self.held[0]) and not self.stopped:
            self.write(self.held.pop(0))

    def accepted(self, batch_id: int, accept: dict[str, int]) -> None:
        """The drafts accepted in a batch, on the step entry that scheduled it."""
        entry = self.awaiting_accept.pop(batch_id, None)
        if entry is None:
            return
        if accept:
            expect = entry.pop("expect")
            entry["accept"] = accept
            entry["expect"] = expect
        self.write_held()

    def write(self, entry: dict[str, Any]) -> None:
        if self.stopped:
            return
        if self.file is None:
            self.open_part()
        assert self.file is not None
        line = recording_entry(entry)
        self.file.write(line)
        # Each entry reaches the file as it is made: a process killed later
        # leaves every entry before the kill (`kvgate replay --partial`).
        self.file.flush()
        self.bytes += len(line.encode())
        self.entries += 1
        limits = self.settings.limits
        if self.bytes >= limits.max_bytes or self.entries >= limits.max_entries:
            limit = "byte" if self.bytes >= limits.max_bytes else "entry"
            if self.part >= limits.max_files:
                self.close(f"its {limit} limit is reached", final=False)
                self.stop(f"the file limit ({limits.max_files}) is reached")
                return
            self.close(
                f"its {limit} limit is reached; the recording goes on in "
                f"{self.stem}.{self.part + 1:03d}.yaml",
                final=False,
            )
            self.part += 1

    def name(self, request_id: str) -> str:
        name = self.names.get(request_id)
        if name is None:
            raise NotExpressible(f"a request that arrived before the recording ({request_id!r})")
        return name

    # -- the calls --------------------------------------------------------

    def before(self, call: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if call == "finish_requests":
            ids = kwargs.get("request_ids", args[0] if args else None)
            if isinstance(ids, str):
                ids = (ids,)
            elif ids is not None:
                ids = set(ids)
            else:
                ids = list(self.scheduler.requests)
            return [r for r in ids if r in self.requests and not self.requests[r].is_finished()]
        if call == "reset_prefix_cache" and self.pending is not None:
            raise NotExpressible("a prefix-cache reset between schedule() and its update")
        if call == "set_pause_state" and self.pending is not None:
            raise NotExpressible("a pause between schedule() and its update")
        if call == "schedule" and self.pending is not None:
            raise NotExpressible("two schedule() calls in one engine step")
        if call == "update_from_output":
            # What each request of the batch had output before its update,
            # and, with drafts, how many tokens the model runner returned.
            output = kwargs.get("scheduler_output", args[0] if args else None)
            runner = kwargs.get("model_runner_output", args[1] if len(args) > 1 else None)
            return (
                id(output),
                {
                    r: len(self.requests[r].output_token_ids)
                    for r in map(str, getattr(output, "num_scheduled_tokens", ()))
                    if r in self.requests
                },
                _returned_with_drafts(output, runner),
            )
        return None

    def after(
        self, call: str, args: tuple[Any, ...], kwargs: dict[str, Any], before: Any, result: Any
    ) -> None:
        if call == "shutdown":
            self.close("the Scheduler shut down")
            self.stopped = True
        elif call == "add_request":
            self.arrived(args[0] if args else kwargs["request"])
        elif call == "schedule":
            self.scheduled(result)
        elif call == "update_from_output":
            self.updated(result, *(before or (0, {}, {})))
        elif call == "finish_requests":
            for request_id in before or ():
                name = self.name(request_id)
                if self.pending is None:
                    self.emit({"op": "abort", "req": name})
                elif any(e.get("req") == name for e in self.deferred):
                    # It arrived after the schedule(): its arrival and its
                    # abort follow the step.
                    self.deferred.append({"op": "abort", "req": name})
                else:
                    # Aborted after the schedule(), before its update (a
                    # client gone or a stop string met while the step ran).
                    self.pending["aborted"].append(name)
                self.forget(request_id)
        elif call == "set_pause_state":
            state = kwargs.get("pause_state", args[0] if args else None)
            mode = {"PAUSED_ALL": "keep", "PAUSED_NEW": "wait"}.get(getattr(state, "name", ""))
            self.emit({"op": "pause", "mode": mode} if mode else {"op": "resume"})
        elif call == "reset_prefix_cache":
            running = bool(kwargs.get("reset_running_requests", args[0] if args else False))
            connector = bool(kwargs.get("reset_connector", args[1] if len(args) > 1 else False))
            waiting = [self.name(r.request_id) for r in self.scheduler.waiting]
            entry: dict[str, Any] = {"op": "reset"}
            if running:
                entry["running"] = True
            if connector:
                entry["connector"] = True
            entry["expect"] = {"ok": bool(result), "waiting": waiting}
            self.emit(entry)

    def arrived(self, request: Any) -> None:
        request_id = str(request.request_id)
        if request_id in self.names:
            # A session's chunks are not recorded yet (their tokens follow
            # the session's own output, which a replay samples anew).
            raise NotExpressible("a streaming-input session's next input chunk or end")
        adapter = self.adapter(getattr(request, "lora_request", None))
        if getattr(request, "mm_features", None):
            raise NotExpressible("a multimodal input (not modelled at the scheduler level)")
        tokens = getattr(request, "prompt_token_ids", None)
        if not tokens:
            raise NotExpressible("a prompt given as embeddings")
        name = f"r{len(self.names)}"
        segments, follows = self.renamer.prompt(name, list(tokens))
        self.names[request_id] = name
        self.requests[request_id] = request
        entry: dict[str, Any] = {
            "op": "arrive",
            "req": name,
            "prompt": segments,
            "max_tokens": int(request.max_tokens),
        }
        salt = getattr(request, "cache_salt", None)
        if salt:
            entry["cache_salt"] = _salt(str(salt))
        if adapter:
            entry["lora"] = adapter
        if follows is not None:
            entry["follows"] = follows
        if getattr(request, "resumable", False):
            entry["resumable"] = True
        if self.config.scheduling_policy == "priority":
            # A replay's requests arrive in the order they were added.
            arrival = float(request.arrival_time)
            if arrival < self.last_arrival:
                raise NotExpressible("a request added after one that arrived later")
            self.last_arrival = arrival
            if int(request.priority):
                entry["priority"] = int(request.priority)
        if self.pending is not None:
            self.deferred.append(entry)
        else:
            self.emit(entry)

    def adapter(self, lora_request: Any) -> str:
        """A request's LoRA adapter as the trace names it ("" for none): a
        hash of its name, as a salt is written. A replay gives each name one
        id and one path, so an adapter whose name, id and path do not go
        together one to one is not expressible."""
        if lora_request is None:
            return ""
        name = str(lora_request.lora_name)
        identity = (int(lora_request.lora_int_id), str(lora_request.lora_path))
        if self.adapters.setdefault(name, identity) != identity or any(
            other != name and ids[0] == identity[0] for other, ids in self.adapters.items()
        ):
            raise NotExpressible("a LoRA adapter name used with two ids or paths")
        return _adapter(name)

    def scheduled(self, output: Any) -> None:
        """A batch scheduled. Under async scheduling the engine step it
        begins ends here unless the engine processes a batch's output in it
        too: as vLLM's engine core steps its batch queue, when `ASYNC_BATCHES`
        batches are in flight or nothing more can be scheduled."""
        scheduled = [[self.name(str(r)), int(n)] for r, n in output.num_scheduled_tokens.items()]
        preempted = sorted(self.name(str(r)) for r in output.preempted_req_ids)
        ids = [str(r) for r in output.num_scheduled_tokens]
        self.in_flight.append({"output": id(output), "ids": ids})
        step: dict[str, Any] = {"scheduled": scheduled, "preempted": preempted, "aborted": []}
        if self.config.async_scheduling and any(
            getattr(output, "scheduled_spec_decode_tokens", None) or {}
        ):
            step["drafts_batch"] = id(output)
        executed = bool(output.total_num_scheduled_tokens)
        if (
            self.config.async_scheduling
            and len(self.in_flight) < ASYNC_BATCHES
            and (executed or self.scheduler.has_requests())
        ):
            self.write_step(step, {}, [])
        else:
            self.pending = step

    def updated(
        self,
        outputs: Any,
        batch_id: int,
        before: dict[str, int],
        returned: dict[str, tuple[int, int]],
    ) -> None:
        """A batch's output processed: the engine step's last call.
        `returned`: for each request the batch scheduled with drafts, (its
        drafts, the tokens the model runner returned for it)."""
        pending, self.pending = self.pending, None
        if pending is None and not self.config.async_scheduling:
            raise NotExpressible("an update without a schedule() before it")
        if not self.in_flight:
            raise NotExpressible("an update without a batch in flight")
        batch = self.in_flight.popleft()
        if batch["output"] != batch_id:
            raise NotExpressible("a batch's output processed before an older batch's")
        # Without a schedule in this step (nothing left to schedule), the
        # step only processes the oldest batch.
        step = pending if pending is not None else {"scheduled": [], "preempted": [], "aborted": []}
        cached: dict[str, int] = {}
        for engine_output in outputs.values():
            for output in engine_output.outputs:
                stats = getattr(output, "prefill_stats", None)
                if stats is not None:
                    cached[self.name(str(output.request_id))] = int(stats.num_cached_tokens)
        from vllm.v1.request import RequestStatus

        finished: list[str] = []
        sessions_stopped = False
        # Finished by a stop condition (end of sequence, a stop token or string).
        stopped: list[str] = []
        # Without async scheduling: the drafts each request kept in this step.
        kept: dict[str, int] = {}
        # A request aborted while its batch ran is not the update's to finish.
        ids = [r for r in batch["ids"] if r in before]
        for request_id in ids:
            request = self.requests[request_id]
            if (
                getattr(request, "resumable", False)
                and request.stop_reason is not None
                and not request.is_finished()
            ):
                # It stopped on a stop condition and goes on: its stop is
                # no longer on the request to be read.
                raise NotExpressible("a streaming-input session stopped by a stop condition")
            if getattr(request, "resumable", False) and (
                request.status == RequestStatus.WAITING_FOR_STREAMING_REQ
                or len(request.output_token_ids) < before[request_id]
            ):
                # A session stopped and goes on: written as not finished.
                sessions_stopped = True
            # Without async scheduling, more than one token in a step is an
            # accepted draft: written as the drafts the request kept (after a
            # stop or its max_tokens trimmed the rest), on this same step.
            got = len(request.output_token_ids) - before[request_id]
            if got > 1 and not self.config.async_scheduling:
                kept[self.name(request_id)] = got - 1
            if request.is_finished():
                if request.status == RequestStatus.FINISHED_STOPPED:
                    stopped.append(self.name(request_id))
                elif request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
                    raise NotExpressible(f"a request finished as {request.status.name}")
                finished.append(self.name(request_id))
        if finished or sessions_stopped:
            step["finished"] = finished
        if kept:
            step["accept"] = kept
        # The drafts accepted in this batch, on the step that scheduled it. A
        # stop condition met among them is written as the drafts before it
        # accepted and a stop at the last token, which leaves the Scheduler
        # as the real stop does.
        accept: dict[str, int] = {}
        for request_id, (drafts, tokens) in returned.items():
            if request_id not in before:
                continue  # aborted while its batch ran: its output is skipped
            name = self.name(request_id)
            if name in stopped:
                tokens = len(self.requests[request_id].output_token_ids) - before[request_id]
            if min(drafts, tokens - 1) > 0:
                accept[name] = min(drafts, tokens - 1)
        self.accepted(batch_id, accept)
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is not None and request.is_finished():
                sequence = [*request.prompt_token_ids, *request.output_token_ids]
                self.renamer.finished(self.name(request_id), sequence)
                self.forget(request_id)
        self.write_step(step, cached, stopped)

    def write_step(self, step: dict[str, Any], cached: dict[str, int], stopped: list[str]) -> None:
        """One engine step's entry, then the arrivals it deferred."""
        expect: dict[str, Any] = {"scheduled": step["scheduled"]}
        if step["preempted"]:
            expect["preempted"] = step["preempted"]
        if cached:
            expect["cached_tokens"] = cached
        if "finished" in step:
            expect["finished"] = step["finished"]
        # Written last: at a file's limit the write closes it.
        entry: dict[str, Any] = {"op": "step"}
        if stopped:
            entry["stop"] = stopped
        if step.get("aborted"):
            entry["abort"] = step["aborted"]
        if step.get("accept"):
            entry["accept"] = step["accept"]
        entry["expect"] = expect
        if step.get("drafts_batch") is not None:
            # Its accepted drafts are known at its batch's update: held till then.
            self.awaiting_accept[step["drafts_batch"]] = entry
        self.emit(entry)
        deferred, self.deferred = self.deferred, []
        for entry in deferred:
            self.emit(entry)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        name = self.names.get(request_id)
        if name is not None:
            # An aborted request's prompt is no longer needed to rename its output.
            self.renamer.prompts.pop(name, None)
