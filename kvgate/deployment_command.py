"""`kvgate deployment`: a `vllm serve` command line resolved as vLLM's
engine resolves it (`impl/serve_flags.py`), printed setting by setting with
the vLLM setting each came from, what only the serving machine decides, and
every setting kvgate cannot model, by name; `--trace-config` prints it as a
trace's `config:` block instead."""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from kvgate import options
from kvgate.conformance.writer import config_dict
from kvgate.errors import EXIT_OK, InputError, printable
from kvgate.impl.serve_flags import Deployment, resolve, serve_args
from kvgate.output import QUIET


def register(subparsers: Any) -> None:
    cmd = subparsers.add_parser(
        "deployment",
        help="resolve a vllm serve command line as vLLM's engine would, and print the deployment",
        description="Resolve a `vllm serve` command line with vLLM's own serve parser and "
        "engine config (on CPU; the model a local directory holding config.json, no weights) "
        "and print the deployment: each resolved setting with the vLLM setting it came from, "
        "what only the serving machine decides, and what kvgate cannot model. kvgate's own "
        "options come first; everything from the model on is the serve command line "
        "(docs/how-to/gate-your-deployment.md).",
    )
    cmd.add_argument(
        "--trace-config",
        action="store_true",
        help="print the deployment as a kvgate trace's config: block instead",
    )
    cmd.add_argument(
        "--num-blocks",
        type=int,
        metavar="N",
        help="the pool size for --trace-config when the serve command line does not fix it "
        "(--num-gpu-blocks-override); vLLM sizes the pool from the serving GPU's memory",
    )
    options.add_serving_machine(cmd)
    cmd.add_argument(
        "serve",
        nargs=argparse.REMAINDER,
        metavar="SERVE-ARGS",
        help="the vllm serve command line: MODEL-DIR [FLAG...] (a leading 'vllm serve' is dropped)",
    )
    cmd.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.num_blocks is not None and args.num_blocks < 2:
        raise InputError(f"--num-blocks: {args.num_blocks} is too small (at least 2)")
    options.check_serving_machine(args)
    deployment = resolve(
        serve_args(args.serve),
        args.num_blocks,
        args.assume_attention_backend,
        args.assume_checkpoint_alignment,
    )
    if args.trace_config:
        print(trace_config(deployment), end="")
        # Standard output is the config block alone, ready to paste or pipe:
        # the count of vLLM's lines is left out (-v still shows the lines).
        logs = getattr(args, "vllm_logs", None)
        if logs is not None:
            logs.verbosity = min(logs.verbosity, QUIET)
    else:
        print("\n".join(lines(deployment)))
    return EXIT_OK


def trace_config(deployment: Deployment) -> str:
    if deployment.config is None:
        raise InputError(f"--trace-config: kvgate needs {deployment.config_missing}")
    return yaml.safe_dump(
        {"config": config_dict(deployment.config)},
        default_flow_style=None,
        sort_keys=False,
        width=100,
    )


def lines(deployment: Deployment) -> list[str]:
    """The report: a line per setting (`name: value`, then where it came
    from), then what the serving machine decides, then what kvgate cannot
    model."""
    out = ["deployment, as vLLM's engine resolves the serve command line:"]
    width = max(len(s.name) for s in deployment.settings) + 1
    for setting in deployment.settings:
        out.append(f"  {setting.name + ':':<{width}} {printable(setting.value)}")
        out.append(f"  {'':<{width}}   from {setting.source}")
    out.append("decided only on the serving machine:")
    out.extend(f"  {name}: {why}" for name, why in deployment.unresolved)
    out.append("kvgate cannot model:")
    if deployment.unmodelled:
        out.extend(f"  {name}: {printable(why)}" for name, why in deployment.unmodelled)
    else:
        out.append("  nothing: every resolved setting is one kvgate models")
    return out
