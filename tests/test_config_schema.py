"""The config schema (`kvgate.vocabulary.schema`) is the one home of a trace
config's fields: `Config`, the reader, the writer, exploration's knobs and
the knob reference page all agree with it."""

from __future__ import annotations

from dataclasses import MISSING, fields, replace
from typing import Any, get_args, get_type_hints

import pytest
import yaml
from configs import EXAMPLE_CONFIG
from docs_reference import stale_parts

from kvgate.conformance.trace import TraceError, parse_trace
from kvgate.conformance.writer import dump_trace
from kvgate.explore.knobs import KNOBS, build, knobs_by_field
from kvgate.model.scope import SCHEDULER_LEVEL_ONLY
from kvgate.vocabulary.config import Config, GroupConfig
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.schema import (
    BY_KEY,
    CONFIG_FIELDS,
    CONFIG_KEYS,
    FROM_CONFIG,
)

# The config each case changes one field of: the docs' example, eagle and
# the hold off (their defaults).
BASE = replace(EXAMPLE_CONFIG, eagle=False, hold=False)

# Each field at a value other than its default (or, for a required field,
# other than `BASE`'s), with the other attributes that value needs to be a
# config kvgate models.
NON_DEFAULT: dict[str, tuple[Any, dict[str, Any]]] = {
    "num_blocks": (64, {}),
    "hash_unit": (4, {}),
    "scheduler_block_size": (64, {}),
    "max_model_len": (4096, {}),
    "max_num_scheduled_tokens": (512, {}),
    "eagle": (True, {}),
    "hash_lookahead_tokens": (1, {"eagle": True}),
    "retention_interval": (None, {}),
    "retain_checkpoint": (True, {}),
    "retain_retired": (True, {}),
    "long_prefill_token_threshold": (48, {}),
    "long_prefill_token_threshold_adaptive": (True, {}),
    "shared_prefix_checkpoint": (True, {}),
    "kv_events": (True, {}),
    "kv_events_full": (True, {}),
    "reserve_full_sequence": (True, {}),
    "disable_log_stats": (True, {}),
    "prefix_caching": (False, {}),
    "mamba_cache_mode": ("none", {"prefix_caching": False}),
    "kv_connector": (True, {}),
    "kv_connector_divergent_hits": (True, {"kv_connector": True}),
    "kv_load_failure_policy": ("fail", {"kv_connector": True}),
    "async_scheduling": (True, {}),
    "kv_cache_metrics": (True, {}),
    "kv_cache_metrics_sample": (0.5, {}),
    "model_runner": ("v2", {}),
    "scheduling_policy": ("priority", {}),
    "vllm_defects": ("fixed", {}),
    "max_loras": (2, {}),
    "prefill_schedule_interval": (3, {}),
    "encoder_compute_budget": (96, {}),
    "encoder_cache_size": (128, {}),
    "groups": (
        (
            GroupConfig("full_attention", 8),
            GroupConfig(
                "mamba_align", 32, prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=8
            ),
        ),
        {},
    ),
}


@pytest.mark.parametrize("key", CONFIG_KEYS)
def test_each_field_round_trips_at_a_value_other_than_its_default(key: str) -> None:
    field = BY_KEY[key]
    value, needs = NON_DEFAULT[key]
    if not field.required and field.derive_default is None:
        assert value != field.default
    config = replace(BASE, **needs, **{field.attribute: value})
    assert config != replace(BASE, **needs)
    text = dump_trace("round-trip", config, [Step("check", 0, check={"pool_clean": True})])
    if key in SCHEDULER_LEVEL_ONLY:
        # Only a scheduler-level trace models it (a manager-level one is refused).
        from kvgate.conformance.writer import dump_engine_trace
        from kvgate.vocabulary.scheduling import EngineSettings, EngineStep

        with pytest.raises(TraceError, match=rf"config\.{key}: "):
            parse_trace(text, "round-trip.yaml")
        text = dump_engine_trace("round-trip", config, EngineSettings(), [EngineStep("step", 0)])
    written = yaml.safe_load(text)["config"]
    assert key in written
    assert parse_trace(text, "round-trip.yaml").config == config


def test_every_config_attribute_is_one_row_and_every_row_has_a_round_trip_case() -> None:
    attributes = [f.attribute for f in CONFIG_FIELDS]
    assert sorted(attributes) == sorted(f.name for f in fields(Config))
    assert len(set(CONFIG_KEYS)) == len(CONFIG_KEYS)
    assert set(NON_DEFAULT) == set(CONFIG_KEYS)


def test_a_default_is_stated_once() -> None:
    """A row states a default only where `Config` has none (else the
    dataclass's is the field's); an enumerated field's choices are its type's."""
    dataclass_defaults = {f.name: f.default for f in fields(Config)}
    hints = get_type_hints(Config)
    for field in CONFIG_FIELDS:
        from_config = field.trace_default == FROM_CONFIG and field.derive_default is None
        assert (dataclass_defaults[field.attribute] is not MISSING) == from_config, field.key
        if field.choices:
            assert field.read_as == "word"
            assert field.choices == get_args(hints[field.attribute]), field.key


def test_the_writer_writes_in_the_tables_order() -> None:
    config = replace(BASE, eagle=True, hash_lookahead_tokens=1, kv_events=True)
    written = yaml.safe_load(
        dump_trace("w", config, [Step("check", 0, check={"pool_clean": True})])
    )
    assert list(written["config"]) == [
        k for k in CONFIG_KEYS if k in written["config"]
    ]  # the table's order
    assert {"hash_lookahead_tokens", "kv_events"} <= set(written["config"])


def test_every_field_is_explored_by_a_knob_or_says_why_not() -> None:
    by_field = knobs_by_field()
    assert set(by_field) <= set(CONFIG_KEYS), set(by_field) - set(CONFIG_KEYS)
    for field in CONFIG_FIELDS:
        assert (field.key in by_field) != bool(field.not_explored), field.key


def test_a_knob_sets_only_the_fields_it_names() -> None:
    bases = (build({}), build({"kv_connector": "on"}), build({"eagle": False}))
    for knob in KNOBS:
        named = {BY_KEY[k].attribute for k in knob.fields}
        for base in bases:
            for value in knob.values:
                changed = {
                    f.name
                    for f in fields(Config)
                    if getattr(knob.set(base, value), f.name) != getattr(base, f.name)
                }
                assert changed <= named, (knob.name, value, changed - named)


def test_the_reference_page_is_generated_from_the_table() -> None:
    stale = [part for part in stale_parts() if part.startswith("docs/reference/knobs.md")]
    assert not stale, f"regenerate with `python tests/docs_reference.py`: {stale}"
