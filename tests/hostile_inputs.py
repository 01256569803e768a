"""Hostile and absurd input for kvgate's command line, and what a run of it may do.

`make_variant(rng)` draws one variant: trace files (a valid base trace with
one mutation: a hostile value, a deleted or unknown key, a hostile name,
deep nesting, a long integer, aliases, a doubling chain, an impossible step,
truncated or non-UTF-8 text, YAML tags, a special file, several traces at
once) or a hostile command-line flag of another command. `run_variant` runs
it in this process through `cli.main` and lists every way the run broke the
contract (`problems`): an exception escaping (a traceback), an exit code
other than 0/1/2 (3 only for a model bug), an error of more than one line,
a control character in the output, a verdict line that no trace owns (a
forged `PASS`), an impossible step that passed, unparsable JUnit XML.

Used by `tests/test_fuzz_input.py` (a Hypothesis test in the default run)
and `scripts/fuzz-input.py` (the longer campaign whose table is in the
README). Both draw from a `random.Random`; in the test it is Hypothesis's.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvgate import cli

BASE_CONFIG: dict[str, Any] = {
    "num_blocks": 96,
    "hash_unit": 8,
    "eagle": True,
    "retention_interval": 0,
    "retain_checkpoint": True,
    "groups": [
        {"kind": "full_attention", "block_size": 8},
        {"kind": "mamba_align", "block_size": 32, "speculative_blocks": 3},
    ],
}
BASE_STEPS: list[dict[str, Any]] = [
    {"op": "arrive", "req": "A", "prompt": [{"fresh": 150}]},
    {"op": "prefill", "req": "A", "lookahead": 3, "expect": {"hit": 0}},
    {"op": "decode", "req": "A", "steps": 3, "spec": 3},
    {"op": "free", "req": "A", "how": "finish"},
    {"op": "drain"},
    {"op": "arrive", "req": "B", "prompt": [{"all_of": "A"}, {"fresh": 26}]},
    {"op": "lookup", "req": "B"},
    {"op": "reserve", "req": "B"},
    {"op": "allocate", "req": "B", "tokens": "auto", "lookahead": 3},
    {"op": "step"},
    {"op": "evict", "blocks": 4},
    {"op": "check", "free_blocks": 80, "holds": {}},
    {"op": "pop", "req": "B"},
    {"op": "release", "req": "B"},
    {"op": "drain"},
    {"op": "check", "pool_clean": False},
]

HOSTILE_VALUES: list[object] = [
    -1,
    0,
    1,
    2**31,
    2**63,
    2**64,
    10**8,
    10**12,
    10**19,
    1.5,
    float("inf"),
    "",
    "x",
    "auto",
    "all",
    "\n",
    "PASS forged\nPASS forged",
    "\x00\x07\x1b[2J",
    "\u2028\u202e",
    None,
    True,
    [],
    {},
    [[[[[]]]]],
    {"op": "arrive"},
]
HOSTILE_TEXT = [
    "\n",
    "\r",
    "\x1b[31m",
    "\x00",
    "\x07",
    "\u2028",
    "\u202e",
    "\ufeff",
    "\udcff",
    "PASS ",
    "FAIL ",
    "ERROR ",
    "<&>",
    "]]>",
    "é",
]


@dataclass
class Variant:
    """One run: the files to write, the arguments (`{dir}` is the work dir)."""

    kind: str
    argv: list[str]
    files: dict[str, bytes] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)  # the traces' names, as written
    impossible: bool = False  # a trace asks for a step no manager can run
    fifo: str | None = None  # a file name to create as a FIFO
    junit: bool = False


@dataclass
class Outcome:
    kind: str
    code: int | None
    out: str
    err: str
    seconds: float
    problems: list[str]
    traceback: bool = False
    impossible_passed: bool = False
    forged: int = 0


# -- traces ----------------------------------------------------------------------


def base_doc(name: str = "base") -> dict[str, Any]:
    return {
        "format": "kvgate-trace/1",
        "name": name,
        "config": yaml.safe_load(yaml.safe_dump(BASE_CONFIG)),
        "steps": yaml.safe_load(yaml.safe_dump(BASE_STEPS)),
    }


def dump(doc: object) -> bytes:
    return yaml.dump(doc, allow_unicode=True, sort_keys=False, width=10**6).encode(
        "utf-8", "surrogatepass"
    )


def _paths(doc: object, prefix: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """Every key path into `doc` (mappings and lists), parents before children."""
    found: list[tuple[object, ...]] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            found.append((*prefix, key))
            found += _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            found.append((*prefix, i))
            found += _paths(value, (*prefix, i))
    return found


def _set(doc: Any, path: tuple[object, ...], value: object) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def _delete(doc: Any, path: tuple[object, ...]) -> None:
    for key in path[:-1]:
        doc = doc[key]
    del doc[path[-1]]


def hostile_text(rng: random.Random, length: int) -> str:
    return "".join(
        rng.choice(HOSTILE_TEXT) if rng.random() < 0.3 else rng.choice("abcXYZ0 -_.:")
        for _ in range(length)
    )


def _value_swap(rng: random.Random) -> Variant:
    doc = base_doc()
    path = rng.choice(_paths(doc))
    _set(doc, path, rng.choice(HOSTILE_VALUES))
    return _one(doc, "value-swap")


def _delete_key(rng: random.Random) -> Variant:
    doc = base_doc()
    _delete(doc, rng.choice(_paths(doc)))
    return _one(doc, "delete-key")


def _unknown_key(rng: random.Random) -> Variant:
    doc = base_doc()
    containers = [p for p in _paths(doc) if isinstance(_get(doc, p), dict)]
    target = _get(doc, rng.choice(containers)) if containers and rng.random() < 0.8 else doc
    target[hostile_text(rng, rng.randint(1, 12))] = rng.choice(HOSTILE_VALUES)
    return _one(doc, "unknown-key")


def _get(doc: Any, path: tuple[object, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _hostile_name(rng: random.Random) -> Variant:
    name = hostile_text(rng, rng.choice([1, 5, 20, 250]))
    return _one(base_doc(name), "hostile-name", name=name)


def _hostile_request(rng: random.Random) -> Variant:
    doc = base_doc()
    name = hostile_text(rng, rng.randint(1, 10))
    for step in doc["steps"]:
        if step.get("req") == "A":
            step["req"] = name
        for segment in step.get("prompt", []):
            if segment.get("all_of") == "A":
                segment["all_of"] = name
    # The expectation fails, so the report shows the request in its values.
    doc["steps"][1]["expect"]["hit"] = 8
    return _one(doc, "hostile-request")


def _deep_nesting(rng: random.Random) -> Variant:
    depth = rng.choice([10, 33, 200, 500, 999, 1000, 3000, 20000])
    broken = rng.random() < 0.5
    tail = "]" * (depth - 1) + "}" if broken else "]" * depth
    text = dump(base_doc()) + b"about: " + (b"[" * depth) + tail.encode() + b"\n"
    return _files("deep-nesting", {"t.yaml": text})


def _long_int(rng: random.Random) -> Variant:
    digits = rng.choice([19, 20, 21, 64, 4300, 4301, 10000])
    doc = base_doc()
    path = rng.choice([p for p in _paths(doc) if isinstance(_get(doc, p), int)])
    _set(doc, path, 424242)
    text = dump(doc).replace(b"424242", b"9" * digits, 1)
    return _files("long-int", {"t.yaml": text}, names=["base"])


def _alias_bomb(rng: random.Random) -> Variant:
    per_alias = rng.choice([10**3, 10**6, 10**7])
    aliases = rng.choice([10, 100, 1000])
    doc = base_doc()
    doc["config"]["max_model_len"] = 10**12
    text = dump(doc).replace(b"- fresh: 150", b"- &seg {fresh: %d}" % per_alias, 1)
    text = text.replace(b"- fresh: 26", b"- fresh: 26" + b"\n    - *seg" * aliases, 1)
    return _files("alias-bomb", {"t.yaml": text})


def _doubling_chain(rng: random.Random) -> Variant:
    doc = base_doc()
    doc["config"]["max_model_len"] = 10**12
    steps = [{"op": "arrive", "req": "R0", "prompt": [{"fresh": 64}]}]
    for i in range(1, rng.choice([10, 30, 80])):
        prev = f"R{i - 1}"
        steps.append({"op": "arrive", "req": f"R{i}", "prompt": [{"all_of": prev}] * 2})
    doc["steps"] = steps
    return _one(doc, "doubling-chain")


IMPOSSIBLE_STEPS: list[dict[str, Any]] = [
    {"op": "allocate", "req": "C", "tokens": 500},
    {"op": "allocate", "req": "C", "tokens": 10**30},
    {"op": "allocate", "req": "C", "tokens": 10**15},
    {"op": "allocate", "req": "C", "tokens": 16, "lookahead": 10**12},
    {"op": "allocate", "req": "C", "tokens": 16, "lookahead": 10**5},
    {"op": "decode1", "req": "C", "spec": 10**30},
    {"op": "decode1", "req": "C", "spec": 10**6},
    {"op": "decode", "req": "C", "steps": 10**7},
    {"op": "evict", "blocks": 1000},
    {"op": "evict", "blocks": 95},
    {"op": "arrive", "req": "D", "prompt": [{"fresh": 10**9}]},
    {"op": "arrive", "req": "D", "prompt": [{"tokens": [1, 2**63]}]},
    {"op": "arrive", "req": "D", "prompt": [{"fresh": 9000}]},
]


def _impossible_step(rng: random.Random) -> Variant:
    doc = base_doc()
    # A request of 100 tokens, looked up, then the impossible step; no
    # expectations, so nothing but the step itself can fail the trace.
    steps: list[dict[str, Any]] = [
        {"op": "arrive", "req": "C", "prompt": [{"fresh": 100}]},
        {"op": "lookup", "req": "C"},
        {"op": "allocate", "req": "C", "tokens": 16},
        dict(rng.choice(IMPOSSIBLE_STEPS)),
    ]
    if steps[-1]["op"] == "allocate":
        del steps[2]
    doc["steps"] = steps
    variant = _one(doc, "impossible-step")
    variant.impossible = True
    return variant


def _config_mismatch(rng: random.Random) -> Variant:
    doc = base_doc()
    change = rng.choice(
        [
            ("scheduler_block_size", 0),
            ("scheduler_block_size", 48),
            ("hash_unit", 3),
            ("hash_unit", 0),
            ("max_model_len", 64),
            ("max_model_len", 0),
            ("max_num_scheduled_tokens", 0),
            ("num_blocks", 10**8),
            ("num_blocks", 1),
            ("retention_interval", 7),
            ("retain_retired", True),
        ]
    )
    doc["config"][change[0]] = change[1]
    return _one(doc, "config-mismatch")


def _truncated(rng: random.Random) -> Variant:
    text = dump(base_doc())
    cut = rng.randint(0, len(text))
    return _files("truncated", {"t.yaml": text[:cut]}, names=["base"])


def _garbage_bytes(rng: random.Random) -> Variant:
    text = bytearray(dump(base_doc()))
    for _ in range(rng.randint(1, 8)):
        text.insert(rng.randint(0, len(text)), rng.randint(0, 255))
    return _files("garbage-bytes", {"t.yaml": bytes(text)})


TAGS = [
    b"!!python/object/apply:os.system ['echo pwned']",
    b"!!python/name:os.system",
    b"!!binary aGVsbG8=",
    b"!!set {a, b}",
    b"!!timestamp 2001-12-14",
    b"!!omap [{a: 1}]",
    b"!custom 1",
    b"*undefined_alias",
]


def _yaml_tag(rng: random.Random) -> Variant:
    doc = base_doc()
    path = rng.choice(_paths(doc))
    _set(doc, path, "TAGHERE")
    text = dump(doc).replace(b"TAGHERE", rng.choice(TAGS), 1)
    return _files("yaml-tag", {"t.yaml": text})


def _merge_keys(rng: random.Random) -> Variant:
    text = dump(base_doc()).replace(
        b"- op: arrive\n  req: B", b"- <<: {op: lookup, req: Z}\n  op: arrive\n  req: B", 1
    )
    if rng.random() < 0.5:
        text = text.replace(b"<<: {op: lookup, req: Z}", b"<<: 5", 1)
    return _files("merge-keys", {"t.yaml": text}, names=["base"])


def _special_file(rng: random.Random) -> Variant:
    choice = rng.choice(["/dev/zero", "/dev/null", "fifo", "/proc/self/status", "dir", "missing"])
    if choice == "fifo":
        return Variant(
            "special-file", ["replay", "{dir}/pipe.yaml", "--target", "model"], fifo="pipe.yaml"
        )
    path = {"dir": "{dir}", "missing": "{dir}/missing.yaml"}.get(choice, choice)
    return Variant("special-file", ["replay", path, "--target", "model"])


def _several_traces(rng: random.Random) -> Variant:
    names = ["one", "two", "three"]
    if rng.random() < 0.3:
        names[2] = "one"  # a duplicate
    files: dict[str, bytes] = {}
    impossible = False
    for i, name in enumerate(names):
        doc = base_doc(name)
        if i == 1 and rng.random() < 0.7:
            doc["steps"] = [
                {"op": "arrive", "req": "C", "prompt": [{"fresh": 100}]},
                {"op": "lookup", "req": "C"},
                {"op": "allocate", "req": "C", "tokens": 16},
                # More blocks than are free: refused at run time (or, past
                # the pool, while reading).
                dict(rng.choice(IMPOSSIBLE_STEPS[-5:-3])),
            ]
            impossible = True
        files[f"{i}.yaml"] = dump(doc)
    command = rng.choice(["replay", "gate"])
    if command == "replay":
        argv = ["replay", *[f"{{dir}}/{f}" for f in files], "--target", "model"]
    else:
        argv = ["gate", "--no-bundled", "--corpus", "{dir}", "--target", "model"]
    argv += ["--junit-xml", "{dir}/out.xml"]
    return Variant("several-traces", argv, files, names, impossible, junit=True)


# -- other commands' flags ---------------------------------------------------------------

FLAG_VALUES = [
    "-1",
    "0",
    "100000",
    "9" * 30,
    "9" * 5000,
    "nan",
    "inf",
    "1e400",
    "",
    "x",
    "١٢",
    "²",
    "5\n",
    "\x1b[2J",
    "/proc/kvgate",
    "/dev/zero",
]
COMMAND_FLAGS: dict[str, tuple[list[str], list[str]]] = {
    # command: (flags to make hostile, a cheap baseline)
    "workload": (
        ["--sessions", "--turns", "--seed", "--scale", "--units", "--hold", "--out", "--level"],
        [
            "workload",
            "--target",
            "model",
            "--scale",
            "64",
            "--units",
            "4096",
            "--hold",
            "off",
            "--sessions",
            "1",
            "--turns",
            "1",
            "--out",
            "{dir}/wl",
        ],
    ),
    "prove": (["--blocks", "--requests", "--groups", "--jobs", "--depth", "--mutation"], ["prove"]),
    "explore": (
        ["--budget", "--seed", "--profile", "--hold", "--retired"],
        ["explore", "--budget", "1", "--out", "{dir}/ex"],
    ),
    "mutate": (["--jobs", "--explore", "--timeout", "--faults", "--level"], ["mutate"]),
    "replay": (["--level", "--limit", "--target"], ["replay", "{dir}/t.yaml", "--target", "model"]),
}
# Commands whose valid values do real work (a proof, a fault campaign on
# vLLM, an exploration): their flags get only values that must be refused.
_EXPENSIVE = ("prove", "mutate", "explore")
# Values some flag of those accepts (int() reads "5\n" and Arabic-Indic digits).
_ACCEPTED = ("0", "100000", "5\n", "١٢")


def _hostile_flag(rng: random.Random, refusals_only: bool = False) -> Variant:
    command = rng.choice(sorted(COMMAND_FLAGS))
    flags, baseline = COMMAND_FLAGS[command]
    flag = rng.choice(flags)
    values = FLAG_VALUES + (["/etc/passwd"] if flag == "--out" else [])
    if command in _EXPENSIVE or refusals_only:
        values = [v for v in values if v not in _ACCEPTED]
    value = rng.choice(values)
    argv = [*baseline]
    if flag in argv:
        i = argv.index(flag)
        argv[i + 1] = value
    else:
        argv += [flag, value]
    files = {"t.yaml": dump(base_doc())} if command == "replay" else {}
    return Variant(f"flag-{command}", argv, files)


MUTATORS: dict[str, Callable[[random.Random], Variant]] = {
    "value-swap": _value_swap,
    "delete-key": _delete_key,
    "unknown-key": _unknown_key,
    "hostile-name": _hostile_name,
    "hostile-request": _hostile_request,
    "deep-nesting": _deep_nesting,
    "long-int": _long_int,
    "alias-bomb": _alias_bomb,
    "doubling-chain": _doubling_chain,
    "impossible-step": _impossible_step,
    "config-mismatch": _config_mismatch,
    "truncated": _truncated,
    "garbage-bytes": _garbage_bytes,
    "yaml-tag": _yaml_tag,
    "merge-keys": _merge_keys,
    "special-file": _special_file,
    "several-traces": _several_traces,
    "hostile-flag": _hostile_flag,
}


def make_variant(
    rng: random.Random, kind: str | None = None, refusals_only: bool = False
) -> Variant:
    """One variant, of `kind` or of a kind drawn; `refusals_only` keeps the
    flag variants to values every command refuses (no workload runs)."""
    kind = kind or rng.choice(sorted(MUTATORS))
    if kind == "hostile-flag":
        return _hostile_flag(rng, refusals_only)
    return MUTATORS[kind](rng)


def _one(doc: object, kind: str, name: str | None = None) -> Variant:
    name = name if name is not None else (doc.get("name") if isinstance(doc, dict) else None)
    names = [name] if isinstance(name, str) else []
    return Variant(
        kind,
        ["replay", "{dir}/t.yaml", "--target", "model", "--junit-xml", "{dir}/out.xml"],
        {"t.yaml": dump(doc)},
        names,
        junit=True,
    )


def _files(kind: str, files: dict[str, bytes], names: list[str] | None = None) -> Variant:
    return Variant(kind, ["replay", "{dir}/t.yaml", "--target", "model"], files, names or [])


# -- running one, and judging it ----------------------------------------------------------

VERDICTS = ("PASS ", "FAIL ", "ERROR ")


def run_variant(variant: Variant, workdir: Path) -> Outcome:
    for name, data in variant.files.items():
        (workdir / name).write_bytes(data)
    if variant.fifo is not None:
        os.mkfifo(workdir / variant.fifo)
    argv = [a.replace("{dir}", str(workdir)) for a in variant.argv]
    out, err = io.StringIO(), io.StringIO()
    code: int | None = None
    escaped: BaseException | None = None
    started = time.perf_counter()
    try:
        # In the work dir: a relative path among the flags (`--out 5`) writes there.
        with (
            contextlib.chdir(workdir),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            code = cli.main(argv)
    except (Exception, SystemExit) as error:  # a traceback, had it run as a command
        escaped = error
    seconds = time.perf_counter() - started
    return judge(variant, workdir, code, out.getvalue(), err.getvalue(), seconds, escaped)


def judge(
    variant: Variant,
    workdir: Path,
    code: int | None,
    out: str,
    err: str,
    seconds: float,
    escaped: BaseException | None = None,
) -> Outcome:
    problems: list[str] = []
    traceback = escaped is not None or "Traceback" in out + err
    if traceback:
        problems.append(f"traceback: {type(escaped).__name__ if escaped else 'in output'}")
    # Exit 3 is kvgate's own bug: allowed by the contract, but a finding here.
    if code not in (0, 1, 2):
        problems.append(f"exit code {code}")
    for line in (out + err).splitlines():
        if any(not c.isprintable() for c in line):
            problems.append(f"a raw control character in {line[:60]!r}")
            break
    err_lines = err.splitlines()
    # Other commands print progress on stderr; replay and gate print errors only.
    if not variant.kind.startswith("flag-"):
        if code == 2 and variant.kind != "several-traces" and len(err_lines) != 1:
            problems.append(f"{len(err_lines)} stderr lines for one error")
        if any(not line.startswith("kvgate: ") for line in err_lines):
            problems.append("a stderr line not from kvgate")
    verdict_lines = [line for line in out.splitlines() if line.startswith(VERDICTS)]
    owned = [
        line
        for line in verdict_lines
        if any(line.split(" ", 1)[1].startswith(n + " ") for n in variant.names)
        # An invalid trace's line names its file (one of this variant's).
        or line.startswith(f"ERROR {workdir}/")
    ]
    forged = max(len(verdict_lines) - len(owned), len(verdict_lines) - len(variant.names))
    if forged > 0:
        problems.append(f"{forged} verdict lines no trace owns")
    passed_lines = [line for line in out.splitlines() if line.startswith("PASS two ")]
    impossible_passed = variant.impossible and (
        code == 0 or (variant.kind == "several-traces" and bool(passed_lines))
    )
    if impossible_passed:
        problems.append("an impossible step passed")
    if variant.junit and (workdir / "out.xml").exists():
        try:
            ET.parse(workdir / "out.xml")
        except ET.ParseError as error:
            problems.append(f"unparsable JUnit: {error}")
    return Outcome(
        variant.kind,
        code,
        out,
        err,
        seconds,
        problems,
        traceback,
        impossible_passed,
        max(forged, 0),
    )
