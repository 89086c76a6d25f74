"""Argument parsing for every command and for the emitted program's train.py: a bad argument is one line
and exit 2, like any other bad input."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

from planner.core.errors import OptionError


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are OptionError (one line naming the argument, exit 2 through
    planner.cli.main), not argparse's usage block and SystemExit."""

    def error(self, message: str) -> NoReturn:
        raise OptionError(message, fix=f"see `{self.prog} --help`")


def positive_number(what: str) -> Callable[[str], float]:
    """An argparse type: a finite number > 0 (not nan, not inf), for `what`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text[:40]!r}")
        return value

    parse.__name__ = what   # argparse names the type in some messages
    return parse


def whole_number(what: str, maximum: int) -> Callable[[str], int]:
    """An argparse type: a whole number from 1 to `maximum`, for `what`."""

    def parse(text: str) -> int:
        if not text.strip().isdigit() or not 1 <= int(text) <= maximum:
            raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {maximum}, got {text[:40]!r}")
        return int(text)

    parse.__name__ = what
    return parse


def count(what: str, least: int) -> Callable[[str], int]:
    """An argparse type: a whole number, at least `least`, for `what`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text[:40]!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    parse.__name__ = what
    return parse
