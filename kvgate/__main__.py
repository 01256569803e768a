"""`python -m kvgate`: the same as the `kvgate` command."""

import sys

from kvgate.cli import main

sys.exit(main())
