"""What a replay run tells people (the terminal) and CI (JUnit XML).

Terminal shape, in order: the target's capabilities, a line per trace as it
finishes (`PASS`, `FAIL`, `LACKS` naming the capability the build lacks,
`SKIP` when the target refuses the trace's config, or `ERROR` with its
one-line reason when the trace got no verdict), each diverging trace's first
divergence in a few lines, the named differences (strict-view exclusions
that hid raw state of the target: a release that keeps unobservable state
differently), one line per missing capability (how many traces, what they
show it costs, the remedy, whether it is required), the verdict, and a last
line `N passed, M failed` (then the other causes' counts when there are
any) on its own, for CI parsers.

Every piece of text from input (trace names, values, messages, paths) goes
through `printable`: a report line is one physical line, and nothing in a
trace can print a line of its own (a forged `PASS`) or break the XML.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from kvgate.conformance.differences import explain
from kvgate.conformance.replay import Divergence, Outcome, ReplayResult, TraceRunError
from kvgate.conformance.selection import INVALID_CLASSNAME, classname
from kvgate.conformance.trace import Trace, TraceError
from kvgate.conformance.verdict import (
    CAPABILITIES,
    DEFAULT_REQUIRED,
    Verdict,
    cost,
    fails_requirement,
    lacking,
    verdict,
)
from kvgate.errors import printable
from kvgate.vocabulary.snapshot import EXCLUSIONS
from kvgate.vocabulary.target import Capabilities

if TYPE_CHECKING:
    import xml.etree.ElementTree as ET

# How much of one value a terminal line shows.
WIDTH = 100
# How many differing positions (or keys) of a long value are shown.
SHOWN_DIFFERENCES = 6

_EXPECTED_FROM = {"expect": "the trace", "api": "the model", "strict": "the model"}


class TerminalReport:
    """Writes the report while the run goes, so a long gate shows progress."""

    def __init__(
        self,
        out: TextIO,
        required: Sequence[str] = DEFAULT_REQUIRED,
        explain_lacking: bool = False,
        quiet: bool = False,
        measured_costs: Mapping[str, str] | None = None,
    ) -> None:
        self.out = out
        # Capability name -> what lacking it costs, measured elsewhere (at
        # the deployment a gate was given), added to its line.
        self.measured_costs = dict(measured_costs or {})
        # Quiet: no header and no line per passing trace; failures, errors
        # and the summary still print.
        self.quiet = quiet
        self.required = tuple(required)
        self.invalid = 0  # traces that could not be read
        # Whether a trace that lacks a capability shows its misses in full
        # too (a replay of named traces, to look into them), or only its line.
        self.explain_lacking = explain_lacking
        self.results: list[Outcome] = []
        # Strict-view exclusion name -> the traces whose target it hid raw
        # state of (named, explained differences rather than failures).
        self.excluded: dict[str, list[str]] = {}

    def exclusions(self, trace: str, names: Iterable[str]) -> None:
        """The strict view's exclusions that hid raw state during `trace`."""
        for name in names:
            self.excluded.setdefault(name, []).append(trace)

    def target(self, capabilities: Capabilities | None, name: str = "") -> None:
        """The header; None when no trace's config could be built on target `name`."""
        if self.quiet:
            return
        if capabilities is None:
            self._line(f"target: {name} (no trace's config could be built on it)")
        else:
            self._line(capabilities_line(capabilities))

    def corpora(self, counts: Sequence[str]) -> None:
        """The header's second line: the corpora that run, and how many
        traces of each kind each holds."""
        if not self.quiet:
            self._line("corpora: " + "; ".join(counts))

    def add(self, result: Outcome) -> None:
        self.results.append(result)
        if not (self.quiet and not self.fails(result)):
            self._line(trace_line(result))

    def fails(self, result: Outcome) -> bool:
        """Whether `result` fails the run (quiet shows only those): a
        divergence, an error, or a capability `--require` names; not a
        trace that passed, lacks what is not required, or does not apply."""
        cause = verdict(result)
        failing = (Verdict.DIVERGES, Verdict.ERROR, Verdict.BUG)
        return cause in failing or fails_requirement(result, self.required)

    def add_invalid(self, error: TraceError) -> None:
        """A trace that could not be read: its line, and a count in the summary."""
        self.invalid += 1
        self._line(f"ERROR {error}")

    def finish(self, verdict_text: str = "", notes: Sequence[str] = ()) -> None:
        """The details and the summary; `notes` (e.g. how much vLLM logged)
        and `verdict_text` (what the exit code means) go before the counts,
        which stay the last line for CI parsers."""
        shown = {Verdict.DIVERGES, Verdict.LACKS} if self.explain_lacking else {Verdict.DIVERGES}
        diverged = [r for r in self.results if isinstance(r, ReplayResult) and verdict(r) in shown]
        for result in diverged:
            self._line("")
            for line in divergence_lines(result):
                self._line(line)
        if diverged:
            self._line("")
        for line in difference_lines(self.excluded):
            self._line(line)
        for line in capability_lines(self.results, self.required, self.measured_costs):
            self._line(line)
        for line in unrun_corpus_lines(self.results):
            self._line(line)
        for note in notes:
            self._line(note)
        if verdict_text:
            self._line(verdict_text)
        self._line(summary_line(self.results, self.invalid))

    def _line(self, text: str) -> None:
        print(printable(text), file=self.out, flush=True)


def difference_lines(excluded: Mapping[str, Sequence[str]]) -> list[str]:
    """Each strict-view exclusion that hid something, as a named difference:
    how many traces, what the view leaves out, whose raw state differs, why
    no caller can observe it (in `EXCLUSIONS` order)."""
    lines: list[str] = []
    for exclusion in EXCLUSIONS:
        traces = excluded.get(exclusion.name)
        if not traces:
            continue
        lines.append(
            f"difference {exclusion.name} ({len(traces)} traces, e.g. {traces[0]}): "
            f"not compared: {exclusion.what}"
        )
        lines.append(f"  {exclusion.releases}; not a bug: {exclusion.why}")
    if lines:
        lines.append("")
    return lines


def capabilities_line(capabilities: Capabilities) -> str:
    """`target: vllm 0.33.0 (partial hits: yes, hold: no)`."""
    hold = "yes" if capabilities.hold else "no"
    if capabilities.hold and capabilities.hold_source:
        hold += f" ({capabilities.hold_source})"
    partial = "yes" if capabilities.partial_hits else "no"
    # Named only when on: no trace but `retain_retired` ones asks for it.
    retired = ", retired states: held" if capabilities.retain_retired else ""
    return f"target: {capabilities.implementation} (partial hits: {partial}, hold: {hold}{retired})"


# The word a trace's report line starts with, by its verdict.
VERDICT_WORD = {
    Verdict.CONFORMS: "PASS",
    Verdict.DIVERGES: "FAIL",
    Verdict.LACKS: "LACKS",
    Verdict.NOT_APPLICABLE: "SKIP",
    Verdict.ERROR: "ERROR",
    Verdict.BUG: "ERROR",
}


def trace_line(result: Outcome) -> str:
    cause = verdict(result)
    word = VERDICT_WORD[cause]
    if isinstance(result, TraceRunError):
        return f"{word} {result.trace.name} ({error_kind(result)}: {result.message})"
    refused = result.trace.expect_refused
    done = f"{result.steps_run} steps" if refused is None else f"refusal by {refused}"
    if cause is Verdict.LACKS:
        done = f"{' and '.join(c.name for c in lacking(result))}: {done}"
    return f"{word} {result.trace.name} ({done}, {result.seconds:.2f}s){cut_note(result.trace)}"


def cut_note(trace: Trace) -> str:
    """What a trace line adds for a recording replayed up to its cut (`--partial`)."""
    return f"; {cut_text(trace)}" if trace.cut else ""


def cut_text(trace: Trace) -> str:
    return f"recording cut at {trace.cut}; replayed the entries before the cut"


def error_kind(error: TraceRunError) -> str:
    if error.bug:
        return "kvgate bug"
    return "not applicable, the target refuses the config" if error.config_refused else "refused"


def capability_lines(
    results: Sequence[Outcome],
    required: Sequence[str],
    measured_costs: Mapping[str, str] | None = None,
) -> list[str]:
    """One line per capability some trace lacked: how many traces, what they
    show it costs (and what it costs as `measured_costs` has it measured
    elsewhere), the remedy, and whether the gate requires it."""
    measured = measured_costs or {}
    lines: list[str] = []
    lacks = [r for r in results if isinstance(r, ReplayResult) and verdict(r) is Verdict.LACKS]
    for capability in CAPABILITIES:
        group = [r for r in lacks if capability in lacking(r)]
        if not group:
            continue
        policy = (
            f"required (--require {capability.name}): fails the gate"
            if capability.name in required
            else "not required: reported only"
        )
        lines.append(
            f"lacks {capability.name}: {len(group)} traces need {capability.what}, which "
            f"this build lacks; cost: {cost(group).text()}"
            + (f"; {measured[capability.name]}" if capability.name in measured else "")
            + f"; remedy: {capability.remedy}; "
            f"{policy}"
        )
    if lines:
        lines.append("")
    return lines


def unrun_corpus_lines(results: Sequence[Outcome]) -> list[str]:
    """A line for each kind of trace of which none ran, every one refused
    by the target (its config): what the run did not gate, and why, said
    once rather than only counted."""
    lines = []
    for scheduler_level, kind, what in (
        (False, "manager-level", "the KV-cache manager"),
        (True, "scheduler-level", "vLLM's Scheduler"),
    ):
        group = [r for r in results if r.trace.scheduler_level == scheduler_level]
        if not group or any(verdict(r) != Verdict.NOT_APPLICABLE for r in group):
            continue
        first = group[0]
        reason = first.message if isinstance(first, TraceRunError) else ""
        prefix = f"{first.trace.path}: "
        reason = reason[len(prefix) :] if reason.startswith(prefix) else reason
        lines.append(
            f"{kind} traces: none of the {len(group)} ran, the target refuses their config "
            f"(the first: {reason}); {what} is not gated by this run"
        )
    if lines:
        lines.append("")
    return lines


def summary_line(results: Sequence[Outcome], invalid: int = 0) -> str:
    """`N passed, M failed`, then the other causes' counts when there are any
    (`invalid` traces that could not be read are errors)."""
    causes = [verdict(r) for r in results]
    passed = causes.count(Verdict.CONFORMS)
    line = f"{passed} passed, {causes.count(Verdict.DIVERGES)} failed"
    lacks = causes.count(Verdict.LACKS)
    if lacks:
        line += f", {lacks} lacking a capability"
    skipped = causes.count(Verdict.NOT_APPLICABLE)
    if skipped:
        line += f", {skipped} not applicable"
    errors = causes.count(Verdict.ERROR) + causes.count(Verdict.BUG) + invalid
    return line + (f", {errors} error{'s' if errors > 1 else ''}" if errors else "")


def divergence_lines(result: ReplayResult) -> list[str]:
    """A failing trace's first divergence, short enough for a terminal."""
    d = result.divergence
    if d is None:
        return []
    expected, actual = show_pair(d.expected, d.actual)
    lines = [
        f"{d.trace}: first divergence at {d.step.where()}, level {d.level}",
        f"  what:     {d.what}",
        f"  expected: {expected}   (from {_EXPECTED_FROM[d.level]})",
        f"  actual:   {actual}",
    ]
    lines += [f"  note:     {note}" for note in (d.note, *result.notes) if note]
    lines += release_lines(result)
    known = explain(d)
    if known is not None:
        lines.append(f"  known:    difference {known.name}: {known.explanation}; {known.verdict}")
    lines += [f"  also:     {divergence_summary(later)}" for later in result.also]
    lines.append(f"  trace:    {d.path}")
    return lines


def release_lines(result: ReplayResult) -> list[str]:
    """For a recording replayed on another vLLM release than the one it
    recorded: both releases, and whether they alone differ at the divergence
    (the recording's expectation unmet, while the build and the model agree
    with each other at that step)."""
    d = result.divergence
    recorded, replaying = result.trace.recorded_by, result.capabilities.release
    if d is None or not recorded or not replaying or recorded == replaying:
        return []
    on_model = not result.capabilities.implementation.startswith("vllm")
    target = f"kvgate's model of vLLM {replaying}" if on_model else f"vLLM {replaying}"
    lockstep = [x for x in result.also if x.step.index == d.step.index and x.level != "expect"]
    if d.level != "expect" or lockstep:
        return [f"  releases: recorded by vLLM {recorded}, replayed on {target}"]
    known = "the known differences between releases: docs/how-to/gate-another-release.md"
    if on_model:
        return [
            f"  releases: recorded by vLLM {recorded}, replayed on {target}: the expected "
            f"value is what vLLM {recorded} did, and the model does otherwise at this step, "
            f"as it does wherever vLLM {recorded} and {replaying} differ ({known})"
        ]
    return [
        f"  releases: recorded by vLLM {recorded}, replayed on {target}, with which the "
        f"model agrees at this step: the expected value is what vLLM {recorded} did, so the "
        f"two releases differ here ({known})"
    ]


def divergence_summary(d: Divergence) -> str:
    """The divergence in one line, as a JUnit failure message."""
    expected, actual = show_pair(d.expected, d.actual)
    return f"{d.step.where()}: {d.level}: {d.what}: expected {expected}, actual {actual}"


def show_pair(expected: object, actual: object) -> tuple[str, str]:
    """Both values as text; of two long sequences or mappings, only what differs."""
    a, b = _text(expected), _text(actual)
    if len(a) <= WIDTH and len(b) <= WIDTH:
        return a, b
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        return _sequence_differences(expected, actual)
    if isinstance(expected, Mapping) and isinstance(actual, Mapping):
        return _mapping_differences(expected, actual)
    return _cut(a), _cut(b)


def _sequence_differences(expected: Sequence[object], actual: Sequence[object]) -> tuple[str, str]:
    missing = object()
    positions = [
        i
        for i in range(max(len(expected), len(actual)))
        if (expected[i] if i < len(expected) else missing)
        != (actual[i] if i < len(actual) else missing)
    ]
    shown, more = positions[:SHOWN_DIFFERENCES], len(positions) - SHOWN_DIFFERENCES

    def side(values: Sequence[object]) -> str:
        items = " ".join(f"[{i}]={_text(values[i]) if i < len(values) else '-'}" for i in shown)
        tail = f" ... ({more} more differ)" if more > 0 else ""
        return _cut(f"len {len(values)}: {items}{tail}")

    return side(expected), side(actual)


def _mapping_differences(
    expected: Mapping[object, object], actual: Mapping[object, object]
) -> tuple[str, str]:
    missing = object()
    keys = [
        k
        for k in sorted({*expected, *actual}, key=str)
        if expected.get(k, missing) != actual.get(k, missing)
    ]
    shown = keys[:SHOWN_DIFFERENCES]
    tail = f" ... ({len(keys) - len(shown)} more differ)" if len(keys) > len(shown) else ""

    def side(values: Mapping[object, object]) -> str:
        items = ", ".join(f"{k}: {_text(values[k]) if k in values else '-'}" for k in shown)
        return _cut(f"{{{items}}}{tail} (differing keys only)")

    return side(expected), side(actual)


def _text(value: object) -> str:
    return value if isinstance(value, str) else repr(value)


def _cut(text: str) -> str:
    return text if len(text) <= WIDTH else text[: WIDTH - 3] + "..."


def write_junit(
    results: Sequence[Outcome],
    path: str | Path,
    suite: str = "kvgate",
    unloaded: Sequence[tuple[str, str]] = (),
    required: Sequence[str] = DEFAULT_REQUIRED,
) -> None:
    """One testcase per trace; a failing one carries its first divergence, an
    errored one its reason; one that lacks a capability fails when `required`
    names it and is skipped otherwise, as is one not applicable. `unloaded`
    adds an error case per (file, reason) that could not even be loaded, so
    CI sees why nothing ran."""
    causes = [verdict(r) for r in results]
    replayed = [r for r in results if isinstance(r, ReplayResult)]
    failed = causes.count(Verdict.DIVERGES) + sum(fails_requirement(r, required) for r in results)
    skipped = causes.count(Verdict.NOT_APPLICABLE) + causes.count(Verdict.LACKS)
    errors = causes.count(Verdict.ERROR) + causes.count(Verdict.BUG) + len(unloaded)
    # Imported only here: a run without --junit-xml writes no XML.
    import xml.etree.ElementTree as ET

    root = ET.Element("testsuites")
    suite_element = ET.SubElement(
        root,
        "testsuite",
        name=suite,
        tests=str(len(results) + len(unloaded)),
        failures=str(failed),
        errors=str(errors),
        skipped=str(skipped - sum(fails_requirement(r, required) for r in results)),
        time=f"{sum(r.seconds for r in results):.3f}",
    )
    if replayed:
        # As the terminal header: a run with the hold on, if any, names its source.
        built = [r for r in replayed if r.trace.expect_refused is None] or replayed
        shown = next((r for r in built if r.capabilities.hold), built[0])
        properties = ET.SubElement(suite_element, "properties")
        _element(
            properties,
            "property",
            name="target",
            value=capabilities_line(shown.capabilities).removeprefix("target: "),
        )
    for result in results:
        case = _element(
            suite_element,
            "testcase",
            classname=classname(result.trace),
            name=result.trace.name,
            file=str(result.trace.path),
            time=f"{result.seconds:.3f}",
        )
        cause = verdict(result)
        if result.trace.cut:
            # A recording replayed up to its cut (`--partial`): where it was cut.
            cut_properties = _element(case, "properties")
            _element(cut_properties, "property", name="cut", value=result.trace.cut)
        if isinstance(result, TraceRunError):
            tag = "skipped" if cause is Verdict.NOT_APPLICABLE else "error"
            _element(case, tag, message=result.message, type=error_kind(result))
        elif result.divergence is not None:
            lacks = ", ".join(c.name for c in lacking(result))
            if cause is not Verdict.LACKS:
                tag, kind = "failure", str(result.divergence.level)
            elif fails_requirement(result, required):
                tag, kind = "failure", f"lacks a required capability: {lacks}"
            else:
                tag, kind = "skipped", f"lacks a capability not required: {lacks}"
            failure = _element(case, tag, message=divergence_summary(result.divergence), type=kind)
            failure.text = "\n".join(printable(line) for line in divergence_lines(result))
        if result.trace.cut:
            _element(case, "system-out").text = printable(cut_text(result.trace))
    for file, reason in unloaded:
        case = _element(
            suite_element, "testcase", classname=INVALID_CLASSNAME, name=file, file=file, time="0"
        )
        _element(case, "error", message=reason, type="invalid trace")
    ET.indent(root)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def _element(parent: ET.Element, tag: str, **attributes: str) -> ET.Element:
    """A child element whose attribute values are escaped to printable text:
    XML 1.0 cannot hold most control characters at all, escaped or not."""
    child = parent.makeelement(tag, {k: printable(v) for k, v in attributes.items()})
    parent.append(child)
    return child
