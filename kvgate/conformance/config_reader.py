"""A trace's `config` read: each field as its row in `schema.CONFIG_FIELDS`
says, its groups, and the config validated.

Each field's default is its row's (docs/reference/knobs.md lists them).
`retention_interval` must be written (`null` = unset), because null and 0
are different modes and a silent default would hide which one a trace tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from kvgate.conformance.field_reader import FieldReader, got, is_count
from kvgate.conformance.limits import over
from kvgate.conformance.trace_error import TraceError
from kvgate.model.scope import validate
from kvgate.vocabulary.config import (
    GROUP_KINDS,
    Config,
    GroupConfig,
    GroupKind,
    UnsupportedConfig,
)
from kvgate.vocabulary.schema import (
    CONFIG_FIELDS,
    CONFIG_KEYS,
    GROUP_KEYS,
    REQUIRED_KEYS,
    ConfigField,
)

# The config keys as errors list them: the required ones first.
LISTED_CONFIG_KEYS = REQUIRED_KEYS + tuple(k for k in CONFIG_KEYS if k not in REQUIRED_KEYS)


class ConfigReader(FieldReader):
    """Reads a trace's `config` mapping."""

    def read_config(self, raw: object, refused: str | None = None) -> Config:
        if not isinstance(raw, dict):
            raise self.error(None, "config", f"must be a mapping, got {got(raw)}")
        self.unknown_keys(None, "config.", raw, LISTED_CONFIG_KEYS, "config key")
        self.missing_keys(None, "config.", raw, REQUIRED_KEYS)

        groups = self.read_groups(raw["groups"])
        values: dict[str, Any] = {"groups": groups}
        for field in CONFIG_FIELDS:
            if field.read_as != "groups":
                values[field.attribute] = self.config_value(raw, field, groups)
        config = Config(**values)
        try:
            # A refusal trace's config is the verdict's to refuse, by which
            # field (`refusal.py`), not the reader's.
            if refused is None:
                validate(config)
        except UnsupportedConfig as error:
            raise TraceError.unsupported(self.path, error) from None
        if config.num_blocks > self.limits.num_blocks:
            raise self.error(
                None, "config.num_blocks", over("num_blocks", config.num_blocks, self.limits)
            )
        return config

    def config_value(
        self, raw: Mapping[Any, Any], field: ConfigField, groups: tuple[GroupConfig, ...]
    ) -> Any:
        """One config field's value, as its row says to read it."""
        if field.key in raw:
            value = raw[field.key]
        elif field.derive_default is not None:
            value = field.derive_default(groups)
        else:
            value = field.default
        where = f"config.{field.key}"
        if field.read_as == "count" and not is_count(value):
            raise self.error(None, where, f"must be an integer >= 0, got {got(value)}")
        if field.read_as == "flag" and not isinstance(value, bool):
            raise self.error(None, where, f"must be true or false, got {got(value)}")
        if field.read_as == "word" and not isinstance(value, str):
            # Any string reads: one outside `choices` is refused by name (`validate`).
            raise self.error(None, where, f"must be a string, got {got(value)}")
        if field.read_as == "rate":
            # Any number reads: one outside (0, 1] is vLLM's to refuse.
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise self.error(None, where, f"must be a number, got {got(value)}")
            return float(value)
        # Any integer reads: a negative one is vLLM's to refuse (`validate`).
        if field.read_as == "interval" and value is not None and type(value) is not int:
            raise self.error(None, where, f"must be null or an integer, got {got(value)}")
        return value

    def read_groups(self, raw: object) -> tuple[GroupConfig, ...]:
        if not isinstance(raw, list):
            raise self.error(None, "config.groups", f"must be a list, got {got(raw)}")
        groups = []
        for i, group in enumerate(raw):
            where = f"config.groups[{i}]"
            if not isinstance(group, dict):
                raise self.error(None, where, f"must be a mapping, got {got(group)}")
            self.unknown_keys(None, f"{where}.", group, GROUP_KEYS, "group key")
            self.missing_keys(None, f"{where}.", group, ("kind", "block_size"))
            kind = group["kind"]
            if kind not in GROUP_KINDS:
                raise self.error(
                    None, f"{where}.kind", f"{got(kind)} is not one of {', '.join(GROUP_KINDS)}"
                )
            sizes: list[int] = []
            for key in ("block_size", "speculative_blocks", "prefill_checkpoint_blocks"):
                value = group.get(key, 0)
                if not is_count(value):
                    raise self.error(
                        None, f"{where}.{key}", f"must be an integer >= 0, got {got(value)}"
                    )
                sizes.append(value)
            alignment = group.get("prefill_checkpoint_alignment")
            if alignment is not None and (not is_count(alignment) or alignment < 1):
                raise self.error(
                    None,
                    f"{where}.prefill_checkpoint_alignment",
                    f"must be an integer >= 1, got {got(alignment)}",
                )
            groups.append(
                GroupConfig(
                    cast(GroupKind, kind),
                    block_size=sizes[0],
                    speculative_blocks=sizes[1],
                    prefill_checkpoint_blocks=sizes[2],
                    prefill_checkpoint_alignment=alignment,
                )
            )
        return tuple(groups)
