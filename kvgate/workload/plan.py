"""A seeded plan of agent sessions: what each turn sends and how long it runs.

A session is a multi-turn agent: its first turn sends a shared system prompt
and a long task context; every follow-up sends the previous turn's prompt
and output again plus new text (a tool result, the user's reply). Prompts
grow to a final length drawn from `final_prompt` (80-100K tokens by
default), so the last turns run on 80-100K prompts as in the measurement.

The plan depends only on the knobs and the seed, never on a manager: every
arm (unit x hold) runs the same sessions. Sizes come from `random.Random`'s
`random()` alone (its sequence is stable across Python versions), turned
into log-uniform draws here rather than by `random`'s distribution methods.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Turn:
    fresh: int  # new prompt tokens (the first turn: the task context)
    output: int  # output tokens the turn generates (>= 2, see `generator`)
    # Steps before the turn arrives: the session's start for the first
    # turn, else the tool call's latency after the previous turn finished.
    delay: int


@dataclass(frozen=True)
class Session:
    index: int
    turns: tuple[Turn, ...]
    # The tenant's `cache_salt` every turn carries ("": none).
    cache_salt: str = ""

    def request(self, turn: int) -> str:
        return f"s{self.index:02d}t{turn:02d}"

    @property
    def final_prompt(self) -> int:
        return sum(t.fresh for t in self.turns) + sum(t.output for t in self.turns[:-1])


@dataclass(frozen=True)
class Workload:
    """The knobs, in full-size tokens and steps (`Deployment.scale` divides them)."""

    # 9 agents x 8 turns: 63 follow-ups (the measurement had 61), and the
    # pool under moderate pressure (see the README's workload section).
    sessions: int = 9
    turns: int = 8
    seed: int = 0
    system_prompt: int = 6144  # shared by every session's first turn
    final_prompt: tuple[int, int] = (80_000, 100_000)  # the last turn's prompt
    output: tuple[int, int] = (96, 1536)  # a turn's output (tool call, reasoning)
    growth: tuple[int, int] = (512, 8192)  # a follow-up's new text (tool result)
    tool_latency: tuple[int, int] = (16, 512)  # steps between a turn and its follow-up
    start_spread: int = 1024  # sessions start within this many steps
    # Sessions belong to this many tenants in turn, each with a cache salt
    # of its own (vLLM's `cache_salt`); 1: no salt, the workload as measured.
    tenants: int = 1

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns < 1 or self.tenants < 1:
            raise ValueError("sessions, turns and tenants must be >= 1")
        for name in ("final_prompt", "output", "growth", "tool_latency"):
            low, high = getattr(self, name)
            if not 0 < low <= high:
                raise ValueError(f"{name}: need 0 < low <= high, got {low}, {high}")
        if self.output[0] < 2:
            raise ValueError("output: a turn generates at least 2 tokens")


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return round(math.exp(math.log(low) + rng.random() * (math.log(high) - math.log(low))))


def make_plan(workload: Workload, scale: int = 1) -> tuple[Session, ...]:
    """The sessions of `workload`, every size and delay divided by `scale`
    (rounded down; new text and follow-up delays at least 1, outputs at
    least 2)."""
    rng = random.Random(workload.seed)
    sessions = []
    for index in range(workload.sessions):
        final = round(
            workload.final_prompt[0]
            + rng.random() * (workload.final_prompt[1] - workload.final_prompt[0])
        )
        outputs = [_log_uniform(rng, *workload.output) for _ in range(workload.turns)]
        growths = [_log_uniform(rng, *workload.growth) for _ in range(workload.turns - 1)]
        latencies = [_log_uniform(rng, *workload.tool_latency) for _ in range(workload.turns - 1)]
        start = int(rng.random() * workload.start_spread)
        # The task context is whatever the final prompt leaves after the
        # system prompt and every follow-up's growth and previous output.
        context = final - workload.system_prompt - sum(growths) - sum(outputs[:-1])
        if context < 1:
            raise ValueError(
                f"session {index}: turns grow past the final prompt length; "
                "use fewer turns or smaller outputs/growth"
            )
        fresh = [context, *growths]
        delays = [start, *latencies]
        sessions.append(
            Session(
                index,
                tuple(
                    Turn(
                        fresh=max(f // scale, 1),
                        output=max(o // scale, 2),
                        # A follow-up arrives at least one step later.
                        delay=d // scale if turn == 0 else max(d // scale, 1),
                    )
                    for turn, (f, o, d) in enumerate(zip(fresh, outputs, delays, strict=True))
                ),
                f"tenant-{index % workload.tenants}" if workload.tenants > 1 else "",
            )
        )
    return tuple(sessions)
