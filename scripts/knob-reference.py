#!/usr/bin/env python3
"""Write the knob reference page from the config schema.

    scripts/knob-reference.py [--check]

Writes docs/reference/knobs.md from `kvgate.conformance.schema` (every
trace config field) and `kvgate.explore.knobs` (which knobs vary each).
`--check` writes nothing and exits 1 when the page differs from what the
table makes (tests/test_config_schema.py runs the same comparison).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvgate.conformance.schema import REFERENCE_PAGE, reference_page  # noqa: E402
from kvgate.explore.knobs import knobs_by_field  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if stale")
    args = parser.parse_args()
    page = ROOT / REFERENCE_PAGE
    text = reference_page(knobs_by_field())
    if args.check:
        if not page.exists() or page.read_text() != text:
            print(f"{REFERENCE_PAGE} is stale: run scripts/knob-reference.py", file=sys.stderr)
            return 1
        return 0
    page.write_text(text)
    print(f"wrote {REFERENCE_PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
