"""`kvgate hold-check LOGFILE`: whether a running vLLM server has the hold,
from the line kvgate's hold overlay logs at startup (`impl/hold_check.py`).
Exit 0 when the log shows the hold on, 1 when it does not."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvgate.errors import EXIT_DIVERGED, EXIT_OK, printable
from kvgate.impl.hold_check import check_log


def register(subparsers: Any) -> None:
    cmd = subparsers.add_parser(
        "hold-check",
        help="read a vLLM server's log and say whether it runs with kvgate's hold overlay on",
        description="Read a vLLM server's log (its standard error, as captured) and find the "
        "line kvgate's hold overlay logs when the server builds its first Mamba manager with "
        "the hold on. Exit 0 if it is there, 1 if not (docs/how-to/use-the-overlay.md).",
    )
    cmd.add_argument("log", type=Path, metavar="LOGFILE", help="the server's log")
    cmd.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    found = check_log(args.log)
    if found.on:
        print(f"hold: yes (line {found.number}: {printable(found.line or '')})")
        return EXIT_OK
    if found.line is not None:
        print(f"hold: no (line {found.number}: {printable(found.line)})")
    else:
        print(
            "hold: no (no line of kvgate's hold overlay in the log: the server started without "
            "VLLM_E2_MAMBA_RETAIN_CHECKPOINT=1 or without kvgate installed, or its hash unit "
            "equals its Mamba block, where no partial tail is ever held)"
        )
    return EXIT_DIVERGED
