"""`python -m tensorfold.cli ARGS`: the `tensorfold` command."""

import sys

from .commands import main

sys.exit(main())
