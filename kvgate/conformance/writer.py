"""Write traces: what Hypothesis runs, Z3 counterexamples, the workload
generator and the shrinker produce, in the format people write by hand
(version 1): manager-level `steps`, or a scheduler-level trace's `engine`."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from kvgate.vocabulary.config import Config, GroupConfig
from kvgate.vocabulary.ops import ACTIONS, Segment, Step
from kvgate.vocabulary.scheduling import EngineSettings, EngineStep
from kvgate.vocabulary.schema import CONFIG_FIELDS, FORMAT
from kvgate.vocabulary.tokens import MmItem


def config_dict(config: Config) -> dict[str, Any]:
    """A config as a trace's `config` mapping: each field as its row in
    `schema.CONFIG_FIELDS` says to write it."""
    out: dict[str, Any] = {}
    for field in CONFIG_FIELDS:
        value = getattr(config, field.attribute)
        if field.read_as == "groups":
            out[field.key] = [group_dict(g) for g in value]
        elif field.write == "always" or value != field.default:
            out[field.key] = value
    return out


def group_dict(group: GroupConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": group.kind, "block_size": group.block_size}
    if group.kind == "mamba_align":
        out["speculative_blocks"] = group.speculative_blocks
        # Additive: written only when set, so older traces read back unchanged.
        if group.prefill_checkpoint_blocks:
            out["prefill_checkpoint_blocks"] = group.prefill_checkpoint_blocks
        if group.prefill_checkpoint_alignment is not None:
            out["prefill_checkpoint_alignment"] = group.prefill_checkpoint_alignment
    return out


def segment_dict(segment: Segment) -> dict[str, Any]:
    if segment.kind == "fresh":
        return {"fresh": segment.count}
    if segment.kind == "tokens":
        return {"tokens": list(segment.token_ids)}
    return {segment.kind: segment.req}


def mm_dict(item: MmItem) -> dict[str, Any]:
    """A multimodal item as a trace writes it."""
    return {"offset": item.offset, "length": item.length, "id": item.identifier}


def step_dict(step: Step) -> dict[str, Any]:
    """One step as written in a trace (macros keep their own fields)."""
    if step.op == "check":
        return {"op": "check", **plain(step.check)}
    action = ACTIONS[step.op]
    out: dict[str, Any] = {"op": step.op}
    for field in (*action.required, *action.optional):
        value = getattr(step, field)
        if field == "prompt":
            value = [segment_dict(s) for s in value]
        if field == "mm":
            value = [mm_dict(m) for m in value]
        if field in action.optional and not value:  # 0, false, "", none
            continue
        out[field] = value
    if step.expect:
        out["expect"] = plain(step.expect)
    return out


def dump_trace(
    name: str,
    config: Config,
    steps: Iterable[Step],
    about: str | None = None,
    expect_refused: str | None = None,
) -> str:
    """A trace's text; with `expect_refused`, a refusal trace (no steps)."""
    doc: dict[str, Any] = {"format": FORMAT, "name": name}
    if about:
        doc["about"] = " ".join(about.split())
    doc["config"] = config_dict(config)
    if expect_refused is not None:
        doc["expect_refused"] = expect_refused
    else:
        doc["steps"] = [step_dict(s) for s in steps]
    return _Dumper.dump(doc)


def engine_step_dicts(
    engine: Iterable[EngineStep], each_step: bool = False
) -> list[dict[str, Any]]:
    """Engine steps as written in a scheduler-level trace: a run of engine
    steps that expect nothing as one `{op: step, steps: N}`, unless
    `each_step` (an entry each, for `bless` to fill)."""
    out: list[dict[str, Any]] = []
    for event in engine:
        bare = not (event.expect or event.stop or event.accept or event.aborted)
        if each_step and event.op == "step" and bare:
            out.append({"op": "step"})
            continue
        if event.op == "step" and bare:
            last = out[-1] if out else {}
            # Only a plain step takes the ones after it (`stop`, `accept`,
            # `abort` and `expect` apply to one step).
            if last.get("op") == "step" and not {"expect", "stop", "accept", "abort"} & last.keys():
                last["steps"] = last.get("steps", 1) + 1
            else:
                out.append({"op": "step"})
            continue
        entry: dict[str, Any] = {"op": event.op}
        if event.op in ("arrive", "abort", "chunk"):
            entry["req"] = event.req
        if event.op == "arrive":
            entry["prompt"] = [segment_dict(s) for s in event.prompt]
            entry["max_tokens"] = event.max_tokens
            if event.cache_salt:
                entry["cache_salt"] = event.cache_salt
            if event.lora:
                entry["lora"] = event.lora
            if event.mm:
                entry["mm"] = [mm_dict(m) for m in event.mm]
            if event.follows is not None:
                entry["follows"] = event.follows
            if event.resumable:
                entry["resumable"] = True
            if event.priority:
                entry["priority"] = event.priority
            if event.skip_prefix_cache:
                entry["skip_prefix_cache"] = True
            remote = event.remote
            if remote is not None:
                entry["remote_hit"] = remote.tokens
                if remote.load_async:
                    entry["remote_async"] = True
                if remote.delay:
                    entry["remote_delay"] = remote.delay
                if remote.fails:
                    entry["remote_fails"] = True
                if remote.undecided:
                    entry["remote_undecided"] = remote.undecided
        if event.op == "chunk" and event.end:
            entry["end"] = True
        elif event.op == "chunk":
            entry["prompt"] = [segment_dict(s) for s in event.prompt]
            entry["max_tokens"] = event.max_tokens
        if event.op == "reset" and event.running:
            entry["running"] = True
        if event.op == "reset" and event.connector:
            entry["connector"] = True
        if event.op == "pause":
            entry["mode"] = event.mode
        if event.stop:
            entry["stop"] = list(event.stop)
        if event.accept:
            entry["accept"] = dict(event.accept)
        if event.aborted:
            entry["abort"] = list(event.aborted)
        if event.expect:
            entry["expect"] = plain(event.expect)
        out.append(entry)
    return out


def dump_engine_trace(
    name: str,
    config: Config,
    settings: EngineSettings,
    engine: Iterable[EngineStep],
    about: str | None = None,
    tags: Iterable[str] = (),
    each_step: bool = False,
) -> str:
    """A scheduler-level trace's text (docs/scheduler-traces.md); `each_step`:
    every engine step an entry of its own."""
    doc = _engine_head(name, config, settings, about, tags)
    doc["engine"] = engine_step_dicts(engine, each_step)
    return _Dumper.dump(doc)


def _engine_head(
    name: str,
    config: Config,
    settings: EngineSettings,
    about: str | None,
    tags: Iterable[str],
) -> dict[str, Any]:
    """A scheduler-level trace's keys before its `engine` list."""
    doc: dict[str, Any] = {"format": FORMAT, "name": name}
    if about:
        doc["about"] = " ".join(about.split())
    if tags:
        doc["tags"] = list(tags)
    doc["config"] = config_dict(config)
    doc["scheduler"] = {"spec": settings.spec, "max_num_seqs": settings.max_num_seqs}
    return doc


def save_trace(
    directory: Path,
    name: str,
    config: Config,
    steps: Iterable[Step],
    about: str | None = None,
    expect_refused: str | None = None,
) -> Path:
    return save_text(directory, name, dump_trace(name, config, steps, about, expect_refused))


def save_engine_trace(
    directory: Path,
    name: str,
    config: Config,
    settings: EngineSettings,
    engine: Iterable[EngineStep],
    about: str | None = None,
) -> Path:
    return save_text(directory, name, dump_engine_trace(name, config, settings, engine, about))


def save_text(directory: Path, name: str, text: str) -> Path:
    """A trace's `text` saved as `directory/name.yaml` (the folder made)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text(text)
    return path


def recording_head(
    name: str,
    config: Config,
    settings: EngineSettings,
    recording: Mapping[str, Any],
    about: str,
) -> str:
    """A recording's text up to its `engine:` line: the entries follow one a
    line (`recording_entry`), then its end line (`recording_end`)."""
    doc = _engine_head(name, config, settings, about, ["recorded"])
    doc["recording"] = dict(recording)
    return _Dumper._dump(doc, default_flow_style=None, width=100) + "engine:\n"


def engine_trace_head(
    name: str, config: Config, settings: EngineSettings, about: str | None = None
) -> str:
    """A scheduler-level trace's text up to its `engine:` line, for a writer
    that writes its entries one a line as it makes them (`recording_entry`)."""
    doc = _engine_head(name, config, settings, about, ())
    return _Dumper._dump(doc, default_flow_style=None, width=100) + "engine:\n"


def recording_entry(entry: Mapping[str, Any]) -> str:
    """One `engine` entry (of a recording, or any trace written entry by
    entry): one line, a flow mapping, so a write cut inside it leaves a
    line the reader cannot parse."""
    return f"  - {_flow(entry)}\n"


# Strings written bare in a recording's entries (request names, hashed salts):
# YAML reads them back as the same strings.
_BARE = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


def _flow(value: Any) -> str:
    """`value` as YAML flow text. A recorder writes an entry per Scheduler
    call: this is PyYAML's output for the values entries hold, several
    times faster; anything else goes through PyYAML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str) and _BARE.fullmatch(value) and value.lower() not in _YAML_WORDS:
        return value
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_flow(k)}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    text: str = yaml.dump(value, Dumper=_Dumper.safe_dumper, default_flow_style=True, width=1 << 30)
    return text.strip().removesuffix("...").strip()


# Bare words YAML reads as something other than a string.
_YAML_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "null", "y", "n"})


def recording_end(entries: int) -> str:
    """A recording's last line: how many `engine` entries it holds."""
    return f"end: {{entries: {entries}}}\n"


def plain(value: Any) -> Any:
    """Tuples to lists and mappings to dicts, so YAML writes plain flow."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


class _Dumper:
    """Top-level block style, one flow mapping per step, as people write them."""

    # libyaml's emitter where PyYAML has it: the same text, several times
    # faster on the long traces the workload generator writes.
    safe_dumper: Any = yaml.CSafeDumper if yaml.__with_libyaml__ else yaml.SafeDumper

    @classmethod
    def dump(cls, doc: dict[str, Any]) -> str:
        body = "engine" if "engine" in doc else "steps"
        head = {k: v for k, v in doc.items() if k != body}
        text = cls._dump(head, default_flow_style=None, width=100)
        if body not in doc:  # a refusal trace
            return text
        lines = [text.rstrip("\n"), f"{body}:"]
        for step in doc[body]:
            flow = cls._dump(step, default_flow_style=True, width=10_000)
            lines.append(f"  - {flow.strip()}")
        return "\n".join(lines) + "\n"

    @classmethod
    def _dump(cls, data: dict[str, Any], default_flow_style: bool | None, width: int) -> str:
        return yaml.dump(
            data,
            Dumper=cls.safe_dumper,
            sort_keys=False,
            default_flow_style=default_flow_style,
            width=width,
        )
