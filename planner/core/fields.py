"""Reading YAML mappings field by field, with errors that name the file, the field path and the fix.

Shared by the device catalog (costmodel.catalog) and the cluster spec (planner.frontend.cluster):
`read_yaml` parses a file with a safe loader that rejects repeated keys, `Fields` reads one mapping's
values with their types and raises `SpecError` on the first one that is wrong.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import yaml

from planner.core.errors import SpecError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """Safe loader (libyaml's if built) that rejects a key given twice in a mapping; PyYAML keeps the last."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        own = [k for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"]  # `<<:` may repeat keys
        keys = [self.construct_object(k, deep=deep) for k in own]
        for index, (k, key) in enumerate(zip(own, keys, strict=True)):
            if isinstance(key, str | int | float) and key in keys[:index]:  # report the repeat
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", k.start_mark)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path | Traversable, file: str) -> object:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        fail(file, "", "file not found", "check the path; a relative one starts at the working directory")
    except (OSError, UnicodeDecodeError) as exc:
        fail(file, "", f"cannot read the file ({exc})", "pass a readable UTF-8 YAML file")
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        fail(file, where, f"malformed YAML: {getattr(exc, 'problem', None) or exc}", "fix the YAML there")


def fail(file: str, field_path: str, message: str, fix: str) -> NoReturn:
    raise SpecError(message, file=file, field=field_path or None, fix=fix)


def yaml_kind(value: object) -> str:
    """A value's type in YAML words, for error messages."""
    words = {"NoneType": "nothing (null)", "bool": "a boolean", "int": "an integer", "float": "a number",
             "str": "a string", "list": "a list", "dict": "a mapping"}
    return words.get(type(value).__name__, type(value).__name__)


def ranked(word: str, names: Iterable[str]) -> str:
    """`names` comma-separated, closest to `word` first: those containing it, then by difflib ratio."""
    wanted = word.lower()
    def distance(name: str) -> tuple[bool, float, str]:
        return wanted not in name.lower(), -difflib.SequenceMatcher(None, wanted, name.lower()).ratio(), name
    return ", ".join(sorted(set(names), key=distance))


class Fields:
    """One YAML mapping at field path `path` of `file`: keys checked, values read with their types."""

    def __init__(self, file: str, data: object, path: str, allowed: tuple[str, ...] | None,
                 required: Iterable[str] = (), what: str = "a mapping") -> None:
        self.file, self.path = file, path
        if not isinstance(data, dict):
            empty = data is None and not path
            fail(file, path, "the file is empty" if empty else f"expected {what}, got {yaml_kind(data)}",
                  f"write {path or 'the file'} as {what}, in `key: value` form")
        self.data: dict[str, object] = data
        unknown = [str(key) for key in data
                   if not isinstance(key, str) or allowed is not None and key not in allowed]
        if unknown:  # a non-string key (`100:`) is never a valid name either
            self.fail(unknown[0], f"unknown key(s) {', '.join(unknown)}",
                      f"allowed keys here: {ranked(unknown[0], allowed)}" if allowed else "quote the key")
        self.require(required)

    def at(self, key: str) -> str:
        """Field path of `key` inside this mapping."""
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, message: str, fix: str) -> NoReturn:
        fail(self.file, self.at(key), message, fix)

    def require(self, keys: Iterable[str], why: str = "", fix: str = "") -> None:
        """Fail on the first of `keys` that is missing; `why` says why it is needed here."""
        for key in keys:
            if key not in self.data:
                self.fail(key, "missing required field" + (f" ({why})" if why else ""),
                          fix or f"add `{key}:` to {self.path or 'the top level'}")

    def sub(self, key: str, allowed: tuple[str, ...] | None, required: Iterable[str] = (),
            what: str = "a mapping") -> Fields:
        return Fields(self.file, self.data.get(key), self.at(key), allowed, required, what)

    def _get(self, key: str, default: object, check: Callable[[object], bool], want: str, fix: str) -> Any:
        if default is None:
            self.require((key,))  # no default: the field is required
        value = self.data.get(key, default)
        if not check(value):
            self.fail(key, f"expected {want}, got {yaml_kind(value)} {value!r}", fix)
        return value

    def text(self, key: str, default: str | None = None) -> str:
        return str(self._get(key, default, lambda v: isinstance(v, str) and bool(v.strip()),
                             "a non-empty string", "write a name (quote it if it looks like a number)"))

    def flag(self, key: str, default: bool) -> bool:
        return bool(self._get(key, default, lambda v: isinstance(v, bool), "true or false",
                              "write true or false, unquoted"))

    def number(self, key: str, *, positive: bool = True, default: float | None = None) -> float:
        """A finite number: > 0 when `positive`, else >= 0 (latencies, prices)."""
        value = float(self._get(key, default, lambda v: isinstance(v, int | float) and not isinstance(v, bool)
                                and math.isfinite(v), "a finite number", "write a plain number"))
        if value <= 0 if positive else value < 0:
            self.fail(key, f"must be {'> 0' if positive else '>= 0'}, got {value:g}",
                      f"give a {'positive' if positive else 'non-negative'} value")
        return value

    def choice(self, key: str, options: Iterable[str], what: str, also: str = "") -> str:
        """A string naming one of `options`; the fix lists them, closest to what was written first."""
        value = self.text(key)
        if value not in options:
            self.fail(key, f"unknown {what} {value!r}", f"use one of: {ranked(value, options)}{also}")
        return value

    def integer(self, key: str) -> int:
        value = self._get(key, None, lambda v: isinstance(v, int) and not isinstance(v, bool),
                          "a whole number", "write e.g. 1, 2 or 8")
        if value <= 0:
            self.fail(key, f"must be >= 1, got {value}", "give a positive count")
        return int(value)
