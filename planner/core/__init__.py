"""The leaf every layer shares: errors, units, the cluster's records, the plan IR, schedules, block
records, and the YAML field reader. It imports nothing else of the project (tests/layering.py)."""
