"""The workload's table (terminal), plot (PNG) and summary (JSON)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate.conformance.report import divergence_lines
from kvgate.workload.runner import ArmResult

# (header, width) of each table column, in order.
COLUMNS: tuple[tuple[str, int], ...] = (
    ("unit", 5),
    ("hold", 4),
    ("follow-ups", 10),
    ("total misses", 12),
    ("after partial-tail", 18),
    ("after block-aligned", 19),
    ("aligned tail", 12),
    ("prefix evicted", 14),
    ("mean cached", 11),
    ("steps", 7),
    ("replay", 7),
)

LEGEND = (
    "total misses: follow-ups admitted with hit 0 while the previous prompt's whole "
    "attention prefix was cached (check attention_cached);",
    "after partial-tail / block-aligned: how the previous turn itself resumed "
    "(its hit % Mamba block != 0 / == 0; a cold first turn is block-aligned);",
    "aligned tail: total misses whose previous turn's own tail state sits on a Mamba "
    "block boundary (a whole-block key the partial-tail hold does not cover);",
    "prefix evicted: hit 0 with the attention prefix gone too (plain eviction, not a "
    "total miss); mean cached: mean hit / prompt tokens over follow-ups.",
)


def table_lines(results: Sequence[ArmResult]) -> list[str]:
    lines = ["  ".join(f"{h:>{w}}" for h, w in COLUMNS)]
    for r in results:
        hold = "on" if r.arm.hold else "off"
        if r.counts is None or r.replay is None:
            lines.append(f"{r.arm.unit:>5}  {hold:>4}  not run: {r.skipped}")
            continue
        c = r.counts
        cells: list[object] = [
            r.arm.unit,
            hold,
            len(c.follow_ups),
            c.total_misses,
            c.after_partial,
            c.after_aligned,
            c.aligned_tail,
            c.prefix_evicted,
            f"{c.mean_cached_fraction:.3f}",
            r.replay.steps_run,
            f"{r.replay.seconds:.1f}s",
        ]
        row = "  ".join(f"{v!s:>{w}}" for v, (_, w) in zip(cells, COLUMNS, strict=True))
        lines.append(row + ("" if r.replay.passed else "  DIVERGED"))
    return lines


def divergence_report(results: Sequence[ArmResult]) -> list[str]:
    lines: list[str] = []
    for r in results:
        if r.replay is not None and not r.replay.passed:
            lines += ["", *divergence_lines(r.replay)]
    return lines


def summary(results: Sequence[ArmResult], header: dict[str, Any]) -> dict[str, Any]:
    arms = []
    for r in results:
        arm: dict[str, Any] = {"unit": r.arm.unit, "hold": r.arm.hold, "trace": str(r.trace.path)}
        if r.counts is None or r.replay is None:
            arm["skipped"] = r.skipped
        else:
            c = r.counts
            arm |= {
                "passed": r.replay.passed,
                "steps": r.replay.steps_run,
                "seconds": round(r.replay.seconds, 3),
                "follow_ups": len(c.follow_ups),
                "total_misses": c.total_misses,
                "after_partial_tail": c.after_partial,
                "after_block_aligned": c.after_aligned,
                "aligned_tail": c.aligned_tail,
                "prefix_evicted": c.prefix_evicted,
                "mean_cached_fraction": round(c.mean_cached_fraction, 4),
                "misses": [f.name for f in c.follow_ups if f.total_miss],
            }
        arms.append(arm)
    return {**header, "arms": arms}


def write_summary(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def plot(results: Sequence[ArmResult], path: Path, title: str) -> None:
    """Misses by unit (stacked by how the previous turn resumed, one bar per
    hold arm) and the mean cached fraction by unit."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never a display
    import matplotlib.pyplot as plt

    ran = [r for r in results if r.counts is not None]
    units = sorted({r.arm.unit for r in ran})
    holds = sorted({r.arm.hold for r in ran})
    by_arm = {(r.arm.unit, r.arm.hold): r.counts for r in ran if r.counts is not None}
    width = 0.8 / max(len(holds), 1)
    fig, (misses, cached) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, hold in enumerate(holds):
        xs = [x + (i - (len(holds) - 1) / 2) * width for x in range(len(units))]
        partial = [_get(by_arm, u, hold, "after_partial") for u in units]
        aligned = [_get(by_arm, u, hold, "after_aligned") for u in units]
        name = f"hold {'on' if hold else 'off'}"
        misses.bar(
            xs,
            partial,
            width,
            label=f"{name}: after partial-tail resume",
            color="tab:red" if not hold else "tab:green",
        )
        misses.bar(
            xs,
            aligned,
            width,
            bottom=partial,
            label=f"{name}: after block-aligned resume",
            color="lightcoral" if not hold else "lightgreen",
            hatch="//",
        )
        fractions = [_fraction(by_arm, u, hold) for u in units]
        cached.plot(
            range(len(units)),
            fractions,
            marker="o",
            label=name,
            color="tab:red" if not hold else "tab:green",
        )
    blocks = {r.trace.config.scheduler_block_size for r in ran}
    labels = [f"{u}\n(= Mamba block)" if u in blocks else str(u) for u in units]
    for axis in (misses, cached):
        axis.set_xticks(range(len(units)), labels)
        axis.set_xlabel("prefix-match unit (tokens)")
    misses.set_ylabel("total misses (follow-ups)")
    misses.set_title("follow-ups resumed at 0 with the attention prefix cached")
    misses.legend(fontsize=8)
    cached.set_ylabel("mean cached fraction")
    cached.set_ylim(0, 1)
    cached.set_title("mean cached tokens / prompt tokens")
    cached.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _get(by_arm: dict[tuple[int, bool], Any], unit: int, hold: bool, what: str) -> int:
    counts = by_arm.get((unit, hold))
    return 0 if counts is None else int(getattr(counts, what))


def _fraction(by_arm: dict[tuple[int, bool], Any], unit: int, hold: bool) -> float:
    counts = by_arm.get((unit, hold))
    return float("nan") if counts is None else float(counts.mean_cached_fraction)
