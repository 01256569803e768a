"""The shared-prefix junction and the scheduler's chunk inputs, as vLLM's
`Scheduler` drives them: the model's predictions, checked against the
installed vLLM where it is present.

- a lookup whose groups disagree reports the junction (the attention-only
  hit), and the driver stores it on the request;
- the align-mode split stops a chunk at the block-floored junction, and
  honours `long_prefill_token_threshold` (the model's `chunk_tokens` against
  vLLM's own `Scheduler._mamba_block_aligned_split` over a grid);
- sparse retention keeps the junction's state (and with eagle the one a
  block below), so a sibling resumes there;
- `auto`'s offer caps at the threshold only when another request is held.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from configs import EXAMPLE_CONFIG

from kvgate.driver.op_driver import OpDriver, chunk_offer
from kvgate.model import ModelTarget
from kvgate.model.request import Request
from kvgate.model.split import chunk_tokens
from kvgate.vocabulary.config import Config, GroupConfig
from kvgate.vocabulary.ops import Segment, Step

HAS_VLLM = importlib.util.find_spec("vllm") is not None

CONFIG = replace(EXAMPLE_CONFIG, eagle=False, hold=False)


def vllm_target(config: Config) -> OpDriver[Any]:
    from kvgate.impl.vllm_target import VllmTarget

    return VllmTarget(config)


TARGETS: dict[str, Callable[[Config], OpDriver[Any]]] = {
    "model": ModelTarget,
    "vllm": vllm_target,
}


@pytest.fixture(params=list(TARGETS))
def make(request: pytest.FixtureRequest) -> Iterator[Callable[[Config], OpDriver[Any]]]:
    if request.param == "vllm" and not HAS_VLLM:
        pytest.skip("vLLM is not installed")
    made: list[OpDriver[Any]] = []

    def build(config: Config) -> OpDriver[Any]:
        made.append(TARGETS[request.param](config))
        return made[-1]

    yield build
    for target in made:
        target.close()


class Ops:
    """Primitive ops on one target, numbered as a trace would be."""

    def __init__(self, target: OpDriver[Any]) -> None:
        self.target = target
        self.index = 0

    def __call__(self, op: str, **fields: Any) -> dict[str, Any]:
        self.index += 1
        return self.target.apply(Step(op, self.index, **fields))

    def arrive(self, req: str, *segments: Segment) -> None:
        self("arrive", req=req, prompt=segments)

    def prefill(self, req: str) -> tuple[int, int, list[int]]:
        """lookup, then auto chunks to the prompt's end: (hit, junction, chunks)."""
        found = self("lookup", req=req)
        chunks = []
        while True:
            done = self("allocate", req=req, tokens="auto", lookahead=3)
            assert done["ok"]
            chunks.append(done["tokens"])
            self("step")
            self("drain")
            if done["prompt_done"]:
                return found["hit"], found["junction"], chunks

    def decode(self, req: str, steps: int) -> None:
        for _ in range(steps):
            assert self("decode1", req=req, spec=3)["ok"]
            self("step")
            self("drain")

    def finish(self, req: str) -> None:
        self("free", req=req, how="finish")
        self("drain")


def fresh(n: int) -> Segment:
    return Segment("fresh", count=n)


def all_of(req: str) -> Segment:
    return Segment("all_of", req=req)


def total_miss(ops: Ops) -> None:
    """T1 resumes T0's conversation; a burst while T1 decodes evicts every
    free Mamba state, so attention alone keeps T1's prefix (the seed's
    scenario, upstream)."""
    ops.arrive("T0", fresh(150))
    ops.prefill("T0")
    ops.decode("T0", 3)
    ops.finish("T0")
    ops.arrive("T1", all_of("T0"), fresh(27))
    ops.prefill("T1")
    ops.decode("T1", 3)
    ops("evict", blocks="all")
    ops.finish("T1")


def after_total_miss(target: OpDriver[Any]) -> Ops:
    """`total_miss` on `target`, then T2 arrives to follow T1 up."""
    ops = Ops(target)
    total_miss(ops)
    ops.arrive("T2", all_of("T1"), fresh(21))
    return ops


def test_a_total_miss_reports_the_attention_hit_as_junction(
    make: Callable[[Config], OpDriver[Any]],
) -> None:
    ops = after_total_miss(make(CONFIG))
    attention = ops.target.check_values({"attention_cached": ["T2"]})["attention_cached"]["T2"]
    found = ops("lookup", req="T2")
    assert found["hit"] == 0
    assert found["junction"] == attention == 184
    # The groups agree on a fresh prompt: no junction.
    ops.arrive("X", fresh(100))
    found = ops("lookup", req="X")
    assert (found["hit"], found["junction"]) == (0, 0)


def test_the_chunk_stops_at_the_junction_and_a_sibling_resumes_there(
    make: Callable[[Config], OpDriver[Any]],
) -> None:
    ops = after_total_miss(make(CONFIG))
    hit, junction, chunks = ops.prefill("T2")
    assert (hit, junction, chunks) == (0, 184, [160, 32, 8, 6])
    ops.finish("T2")
    # Sparse retention kept the state at the floored junction (block 4).
    assert ops.target.check_values({"ref": {"T2": {1: [160]}}})["ref"] == {"T2": {1: {160: 0}}}
    ops.arrive("U", all_of("T1"), fresh(40))
    hit, junction, _ = ops.prefill("U")
    assert (hit, junction) == (160, 184)


@pytest.mark.parametrize("eagle", [False, True], ids=["eagle-off", "eagle-on"])
def test_sparse_retention_keeps_the_junction_state(
    make: Callable[[Config], OpDriver[Any]], eagle: bool
) -> None:
    """A junction set by hand on a fresh request, chunks of one block (so a
    state exists at every block end): sparse retention keeps the state at
    the junction; without a junction not (only the prompt's own replay
    boundaries). With eagle too, and not the one a block below: vLLM keeps
    that only in a group flagged as the drafter's, and the Mamba group is
    not one (tests/test_eagle_groups.py)."""
    config = replace(CONFIG, eagle=eagle, max_num_scheduled_tokens=32)
    kept = {}
    for junction in (0, 128):
        ops = Ops(make(config))
        ops.arrive("R", fresh(300))
        ops("lookup", req="R")
        ops.target.set_junction(ops.target.requests["R"].request, junction)
        while not ops("allocate", req="R", tokens="auto")["prompt_done"]:
            ops("step")
        ops.finish("R")
        refs = ops.target.check_values({"ref": {"R": {1: [64, 96, 128, 160]}}})["ref"]
        kept[junction] = {p for p, ref in refs["R"][1].items() if ref is not None}
    assert kept[0] == set()
    assert kept[128] == {128}


def test_preempt_keeps_the_junction_until_the_next_lookup(
    make: Callable[[Config], OpDriver[Any]],
) -> None:
    ops = after_total_miss(make(CONFIG))
    ops("lookup", req="T2")
    assert ops("allocate", req="T2", tokens="auto")["tokens"] == 160
    ops("free", req="T2", how="preempt")
    # Re-admitted without a lookup: the split still stops at the junction
    # (160, floored from 128; without it the chunk would run to 192).
    ops("step")
    assert ops("allocate", req="T2", tokens=128)["ok"]
    assert ops("allocate", req="T2", tokens="auto")["tokens"] == 32


def test_the_offer_caps_at_the_threshold_only_beside_another_request() -> None:
    config = replace(CONFIG, long_prefill_token_threshold=48)
    assert chunk_offer(config, 300, 8192, num_live=1) == 300
    assert chunk_offer(config, 300, 8192, num_live=2) == 48
    assert chunk_offer(config, 300, 40, num_live=2) == 40
    assert chunk_offer(config, 30, 8192, num_live=2) == 30
    assert chunk_offer(CONFIG, 300, 8192, num_live=5) == 300


def test_the_adaptive_threshold_is_floored_at_a_fair_share_of_the_budget() -> None:
    config = replace(
        CONFIG,
        long_prefill_token_threshold=48,
        long_prefill_token_threshold_adaptive=True,
        max_num_scheduled_tokens=256,
    )
    assert chunk_offer(config, 300, 256, num_live=2) == 128  # 256 // 2 beats 48
    assert chunk_offer(config, 300, 256, num_live=8) == 48  # 256 // 8 = 32 is below it
    assert chunk_offer(config, 300, 256, num_live=1) == 256  # alone: no cap at all
    # Without a threshold the flag does nothing, as in vLLM.
    off = replace(config, long_prefill_token_threshold=0)
    assert chunk_offer(off, 300, 256, num_live=2) == 256


def test_auto_chunks_honour_the_threshold(make: Callable[[Config], OpDriver[Any]]) -> None:
    config = replace(CONFIG, long_prefill_token_threshold=48)
    ops = Ops(make(config))
    ops.arrive("A", fresh(200))
    ops("lookup", req="A")
    # Alone: the whole budget (up to the last cacheable boundary).
    assert ops("allocate", req="A", tokens="auto")["tokens"] == 192
    ops.arrive("B", fresh(200))
    ops("lookup", req="B")
    # Beside A: 48 offered, cut back to the block boundary.
    assert ops("allocate", req="B", tokens="auto")["tokens"] == 32
    narrow = replace(config, long_prefill_token_threshold=16)
    ops = Ops(make(narrow))
    ops.arrive("A", fresh(200))
    ops.arrive("B", fresh(200))
    ops("lookup", req="A")
    # A block wider than any chunk the threshold allows is advanced sub-block.
    assert ops("allocate", req="A", tokens="auto")["tokens"] == 16


SPLIT_CONFIGS = {
    "unit8-eagle": replace(CONFIG, eagle=True),
    "unit8": CONFIG,
    "unit32": replace(
        CONFIG,
        hash_unit=32,
        groups=(GroupConfig("full_attention", 32), GroupConfig("mamba_align", 32, 3)),
    ),
}


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
@pytest.mark.parametrize("name", list(SPLIT_CONFIGS))
def test_the_model_split_is_vllms_split(name: str) -> None:
    """`chunk_tokens` against `Scheduler._mamba_block_aligned_split` on every
    combination of start, offer, hit, junction and threshold in a grid."""
    from kvgate.impl.vllm_target import VllmTarget

    base = SPLIT_CONFIGS[name]
    checked = 0
    for threshold in (0, 16, 48):
        config = replace(base, long_prefill_token_threshold=threshold)
        target = VllmTarget(config)
        prompt = list(range(1, 206))
        real = target.new_request("R", prompt)
        model = Request("R", prompt, config.hash_unit)
        try:
            for start, hit, junction, offer in itertools.product(
                range(0, 205, 24), (0, 8, 40), (0, 20, 64, 100, 160, 184, 192, 200), (205, 50, 8)
            ):
                real.num_computed_tokens = model.num_computed_tokens = start
                real.shared_prefix_boundary = model.shared_prefix_boundary = junction
                offered = min(offer, len(prompt) - start - hit)
                if offered <= 0:
                    continue
                expected = target.split(real, offered, hit)
                got = chunk_tokens(config, model, offered, hit)
                assert got == expected, (threshold, start, hit, junction, offered)
                checked += 1
        finally:
            target.close()
    assert checked > 500
