"""`python3 -m planner.cli`: the same as the `plan` console script."""

import sys

from planner.cli.main import main

sys.exit(main())
