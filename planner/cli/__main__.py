"""`python3 -m planner.cli`: the same as the `plan` console script."""

from planner.cli.main import entry

entry()
