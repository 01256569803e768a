"""`kvgate deployment`: a serve command line resolved as vLLM's engine
resolves it. Each printed setting is checked against the `VllmConfig` vLLM's
own `EngineArgs` builds from the same settings, for three command lines: a
Qwen3-Next-class model with a multi-module MTP drafter (the seed's kind of
deployment), the same family with one MTP layer reused for its drafts, and
a Mamba2 hybrid of another family (Nemotron-H) without drafts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from configs import MTP, SEED_BLOCK_FLAGS, needs_vllm

from kvgate import cli
from kvgate.impl.vllm_scheduler_config import model_dir

pytestmark = needs_vllm


def nemotron_h_dir(folder: Path) -> Path:
    """A tiny Mamba2 hybrid of another family (Nemotron-H): config.json only."""
    from transformers import NemotronHConfig

    settings: dict[str, Any] = dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        hybrid_override_pattern="M*",
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        mamba_num_heads=4,
        mamba_head_dim=32,
        n_groups=1,
        ssm_state_size=16,
        expand=2,
        max_position_embeddings=1 << 16,
        architectures=["NemotronHForCausalLM"],
    )
    config = NemotronHConfig(**settings)
    config.save_pretrained(folder)
    return folder


def printed(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, str]:
    """`kvgate deployment ARGV`'s settings, by name."""
    assert cli.main(["deployment", *argv]) == 0
    values: dict[str, str] = {}
    for line in capsys.readouterr().out.splitlines():
        name, sep, value = line.strip().partition(": ")
        if line.startswith("  ") and not line.startswith("    ") and sep:
            values.setdefault(name.rstrip(":"), value.strip())
    return values


def vllm_resolved(**flags: Any) -> Any:
    """vLLM's own resolution of the same settings, by its EngineArgs."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(skip_tokenizer_init=True, **flags).create_engine_config()


def check(values: dict[str, str], config: Any) -> None:
    from vllm.v1.core import kv_cache_utils  # noqa: F401  (vLLM loaded as the engine loads it)

    cache, scheduler = config.cache_config, config.scheduler_config
    spec = config.speculative_config
    assert values["prefix caching"] == json.dumps(bool(cache.enable_prefix_caching))
    assert values["mamba cache mode"] == str(cache.mamba_cache_mode)
    assert values["drafts"] == str(spec.num_speculative_tokens if spec else 0)
    assert values["prefill lookahead"] == str(config.num_prefill_lookahead_tokens)
    assert values["hash lookahead"] == str(config.num_hash_lookahead_tokens)
    budget = scheduler.max_num_scheduled_tokens or scheduler.max_num_batched_tokens
    assert values["token budget"] == str(budget)
    assert values["max_num_seqs"] == str(scheduler.max_num_seqs)
    assert values["max_model_len"] == str(config.model_config.max_model_len)
    if cache.prefix_match_unit is not None:
        assert values["hash unit"] == str(cache.prefix_match_unit)
    # The served blocks: the worker's update raises the attention block to
    # hold a Mamba page, at least the configured block, and in align mode
    # sets the Mamba block to it (checked against the worker's own update
    # on real layers in the test below).
    block = int(values["attention block"])
    assert block >= cache.block_size
    if cache.mamba_cache_mode == "align":
        assert values["mamba block"] == str(block)
        assert values["groups"].startswith(
            f"full_attention block {block}, mamba_align block {block}"
        )


def test_three_command_lines_resolve_as_vllm_resolves_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The seed's kind: three MTP modules, three drafts, prefix caching in
    # align mode, unit 64, 8 sequences; async scheduling left to vLLM.
    qwen3 = str(model_dir(3))
    seed_flags = dict(
        enable_prefix_caching=True,
        block_size=64,
        mamba_block_size=256,
        prefix_match_unit=64,
        max_num_seqs=8,
        max_model_len=32768,
    )
    values = printed(
        capsys,
        [
            qwen3,
            "--enable-prefix-caching",
            "--mamba-cache-mode",
            "align",
            "--block-size",
            "64",
            "--mamba-block-size",
            "256",
            "--prefix-match-unit",
            "64",
            "--max-num-seqs",
            "8",
            "--max-model-len",
            "32768",
            "--speculative-config",
            MTP,
        ],
    )
    check(values, vllm_resolved(model=qwen3, speculative_config=json.loads(MTP), **seed_flags))
    assert values["prefill lookahead"] == "3"  # a module per draft
    assert values["hash unit"] == "64"
    assert values["attention backend"] == "FLASH_ATTN"  # assumed, and said so
    # vLLM's default on a GPU; the CPU platform's override is set aside.
    assert values["async scheduling"] == "true"

    # One MTP layer reused for three drafts (as Qwen3-Next ships): lookahead 1.
    qwen3_one = str(model_dir(1))
    values = printed(
        capsys,
        [
            "vllm",
            "serve",
            qwen3_one,
            "--enable-prefix-caching",
            "--block-size",
            "64",
            "--mamba-block-size",
            "256",
            "--max-num-batched-tokens",
            "4096",
            "--no-async-scheduling",
            "--speculative-config",
            MTP,
        ],
    )
    check(
        values,
        vllm_resolved(
            model=qwen3_one,
            enable_prefix_caching=True,
            block_size=64,
            mamba_block_size=256,
            max_num_batched_tokens=4096,
            speculative_config=json.loads(MTP),
        ),
    )
    assert values["prefill lookahead"] == "1"
    assert values["async scheduling"] == "false"

    # Another family, no drafts.
    hybrid = str(nemotron_h_dir(tmp_path / "nemotron-h"))
    values = printed(
        capsys,
        [hybrid, "--enable-prefix-caching", "--mamba-block-size", "128", "--max-num-seqs", "4"],
    )
    check(
        values,
        vllm_resolved(
            model=hybrid, enable_prefix_caching=True, mamba_block_size=128, max_num_seqs=4
        ),
    )
    assert values["drafts"] == "0" and values["prefill lookahead"] == "0"
    assert values["model"].endswith("(NemotronHForCausalLM)")


def test_the_trace_config_block_builds_vllms_scheduler(capsys: pytest.CaptureFixture[str]) -> None:
    """The printed config block is a trace config (standard output holds it
    alone), and vLLM's real Scheduler built from it by the gate's
    scheduler-level target derives every size and setting it states (the
    target refuses, by name, any it resolves otherwise)."""
    import yaml

    from kvgate import targets
    from kvgate.conformance.trace import parse_trace
    from kvgate.conformance.writer import config_dict

    argv = [
        "--trace-config",
        str(model_dir(3)),
        *SEED_BLOCK_FLAGS,
        "--max-model-len",
        "32768",
        "--num-gpu-blocks-override",
        "512",
        "--max-num-seqs",
        "8",
        "--speculative-config",
        MTP,
    ]
    assert cli.main(["deployment", *argv]) == 0
    out = capsys.readouterr().out
    block = yaml.safe_load(out)
    assert list(block) == ["config"]
    # The block, as a trace's config, read by the trace reader.
    head = "format: kvgate-trace/1\nname: deployment\n"
    # Async scheduling on: a scheduler-level trace (engine steps).
    engine = (
        "scheduler: {spec: 3, max_num_seqs: 8}\nengine:\n"
        "  - {op: arrive, req: A, prompt: [{fresh: 8}], max_tokens: 1}\n  - {op: step}\n"
    )
    config = parse_trace(head + out + engine).config
    assert config_dict(config) == block["config"]
    # The tiny model's Mamba page fits a 64-token attention page: the worker
    # keeps 64 and serves the Mamba block at 64, over the asked 256.
    assert (config.num_blocks, config.hash_unit, config.scheduler_block_size) == (512, 64, 64)
    assert [g.block_size for g in config.groups] == [64, 64]
    assert config.hash_lookahead_tokens == 3 and config.async_scheduling

    factory: Any = targets.target_factory("vllm-scheduler")
    scheduler = factory(config, spec_tokens=3, max_num_seqs=8)
    real = scheduler.scheduler
    assert int(real.num_prefill_lookahead) == 3
    assert int(real.hash_block_size) == 64
    scheduler.close()


def test_bad_command_lines_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["deployment", str(tmp_path)]) == 2
    assert "not a local directory holding config.json" in capsys.readouterr().err
    assert cli.main(["deployment", str(model_dir(1)), "--no-such-flag"]) == 2
    err = capsys.readouterr().err
    assert "vLLM's serve parser refuses it" in err and "Traceback" not in err
    assert cli.main(["deployment", "--trace-config", str(model_dir(1))]) == 2
    assert "pool size" in capsys.readouterr().err


WORKER_BLOCK_UPDATE = Path(__file__).resolve().parent.parent / "scripts" / "worker_block_update.py"


def test_served_blocks_are_what_vllms_worker_computes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The served blocks `kvgate deployment` prints are those vLLM's worker
    computes: its platform's update run on the model's real layers (built
    on the meta device by scripts/worker_block_update.py, in a child
    process: it starts vLLM's distributed state), on this machine's CPU
    attention backend, which kvgate is told to assume. The first command
    line is the served CPU probe's (64/256/64 served as 320/320/64)."""
    import subprocess
    import sys

    sys.path.insert(0, str(WORKER_BLOCK_UPDATE.parent))
    from served_e2e import tiny_qwen3_next  # type: ignore[import-not-found]

    qwen3 = tmp_path / "tiny-qwen3-next"
    tiny_qwen3_next(eos_token_id=1).save_pretrained(qwen3)
    hybrid = nemotron_h_dir(tmp_path / "nemotron-h")
    lines: list[tuple[dict[str, Any], list[str]]] = [
        (
            dict(
                model=str(qwen3),
                enable_prefix_caching=True,
                block_size=64,
                mamba_block_size=256,
                prefix_match_unit=64,
            ),
            [
                str(qwen3),
                *SEED_BLOCK_FLAGS,
            ],
        ),
        (
            dict(model=str(qwen3), enable_prefix_caching=True, mamba_block_size=128),
            [str(qwen3), "--enable-prefix-caching", "--mamba-block-size", "128"],
        ),
        (
            dict(model=str(hybrid), enable_prefix_caching=True, mamba_block_size=128),
            [str(hybrid), "--enable-prefix-caching", "--mamba-block-size", "128"],
        ),
    ]
    child = subprocess.run(
        [sys.executable, str(WORKER_BLOCK_UPDATE), *(json.dumps(s) for s, _ in lines)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    workers = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    assert len(workers) == len(lines)
    for worker, (_, argv) in zip(workers, lines, strict=True):
        assert worker["attention_backends"] == ["CPU_ATTN"]
        values = printed(capsys, ["--assume-attention-backend", "CPU_ATTN", *argv])
        assert values["attention block"] == str(worker["block_size"])
        assert values["mamba block"] == str(worker["mamba_block_size"])
        unit = worker["prefix_match_unit"] or worker["block_size"]
        assert values["hash unit"] == str(unit)
    # The served CPU probe's blocks for 64/256/64.
    assert (workers[0]["block_size"], workers[0]["mamba_block_size"]) == (320, 320)
