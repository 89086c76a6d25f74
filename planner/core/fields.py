"""Reading YAML mappings field by field, with errors that name the file, the field path and the fix.

Shared by the device catalog (costmodel.catalog) and the cluster spec (planner.frontend.cluster):
`read_yaml` parses a file with a safe loader that rejects repeated keys, aliases that expand past a
small budget and nesting deeper than any spec needs; `Fields` reads one mapping's values with their
types and raises `SpecError` on the first one that is wrong. A message never quotes a value whole
(`echo`): at most MAX_ECHO_CHARS characters of it.
"""

from __future__ import annotations

import difflib
import math
import re
import reprlib
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import yaml

from planner.core.errors import SpecError

if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:
        from importlib.abc import Traversable

MAX_SPEC_BYTES = 1 << 20          # 10^5 devices in a thousand groups are 80 kB; PyYAML reads 1 MiB in ~1 s
MAX_ALIAS_NODES = 10_000          # YAML nodes aliases may add when expanded (an alias bomb adds billions)
MAX_DEPTH = 32                    # nesting levels; a spec needs five
MAX_ECHO_CHARS = 60               # of a value quoted in a message
MAX_TEXT_CHARS = 200              # free text (a cluster's name, a device's source)
MAX_FIGURE = 1e12                 # any figure in its field's unit (TFLOP/s, GiB, GB/s, us, $): beyond hardware

# names become device labels (`group/node:local`), file names and report cells: a safe set only
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
NAME_RULE = "letters, digits and . _ + - only, starting with a letter or digit, at most 64 characters"

# YAML 1.1 reads `1e-9` and `1e5` as strings (its floats need a dot and a signed exponent): read them
# as the numbers everyone means
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
_FLOAT_TAG = "tag:yaml.org,2002:float"
_MERGE_TAG = "tag:yaml.org,2002:merge"

_echo = reprlib.Repr()
_echo.maxstring, _echo.maxother, _echo.maxlist, _echo.maxdict, _echo.maxlevel = MAX_ECHO_CHARS, 40, 4, 3, 2


def echo(value: object) -> str:
    """`value` as a message quotes it: its repr, at most MAX_ECHO_CHARS characters."""
    text = _echo.repr(value)
    return text if len(text) <= MAX_ECHO_CHARS else text[:MAX_ECHO_CHARS - 3] + "..."


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """Safe loader (libyaml's if built) that rejects a key given twice in a mapping (PyYAML keeps the
    last), and a document whose aliases expand past MAX_ALIAS_NODES or that nests past MAX_DEPTH."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _check_expansion(node)      # before constructing: the values themselves may not fit in memory
        return self.construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()   # a set: linear in the keys (a list was quadratic: 16k keys took 9 s)
        for k, _ in node.value:
            if k.tag == _MERGE_TAG:     # `<<:` may repeat keys
                continue
            key = self.construct_object(k, deep=deep)
            if isinstance(key, str | int | float):
                if key in seen:         # report the repeat
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {echo(key)}", k.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_implicit_resolver(_FLOAT_TAG, _EXPONENT_FLOAT, list("-+0123456789"))


class _TooLarge(Exception):
    def __init__(self, message: str, fix: str = "write the values out instead of through aliases") -> None:
        super().__init__(message)
        self.fix = fix


def _check_expansion(root: yaml.Node) -> None:
    """Raise _TooLarge when the document, aliases expanded, has MAX_ALIAS_NODES nodes more than it
    writes out, nests deeper than MAX_DEPTH, or contains itself. Each distinct node is visited once
    (sizes are memoised), so an alias bomb costs what its text costs; recursion stops at MAX_DEPTH."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()

    def size(node: yaml.Node, depth: int) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if isinstance(node, yaml.ScalarNode):
            sizes[key] = 1
            return 1
        if key in on_path:
            raise _TooLarge("an alias refers to a node that contains it (a recursive structure)")
        if depth > MAX_DEPTH:
            raise _TooLarge(f"nested deeper than {MAX_DEPTH} levels", "flatten the document")
        on_path.add(key)
        items = node.value if isinstance(node, yaml.SequenceNode) else [part for pair in node.value for part in pair]
        total = 1 + sum(size(child, depth + 1) for child in items)
        on_path.discard(key)
        sizes[key] = total
        return total

    if size(root, 1) - len(sizes) > MAX_ALIAS_NODES:
        raise _TooLarge(f"aliases expand to more than {MAX_ALIAS_NODES} values beyond those written out")


def read_yaml(path: Path | Traversable, file: str) -> object:
    """The YAML document in `path`, safely: a file over MAX_SPEC_BYTES, an alias bomb, deep nesting or
    a repeated key is a SpecError naming `file`."""
    if isinstance(path, Path) and path.exists() and not path.is_file():  # a folder, a FIFO, a device
        fail(file, "", "cannot read the file (not a regular file)", "pass a readable UTF-8 YAML file")
    try:
        with path.open("rb") as stream:
            raw = stream.read(MAX_SPEC_BYTES + 1)
        if len(raw) > MAX_SPEC_BYTES:
            fail(file, "", f"the file is larger than {MAX_SPEC_BYTES >> 20} MiB",
                 "a spec lists node groups, not devices: give each group a count")
        text = raw.decode("utf-8")
    except FileNotFoundError:
        fail(file, "", "file not found", "check the path; a relative one starts at the working directory")
    except (OSError, UnicodeDecodeError) as exc:
        fail(file, "", f"cannot read the file ({str(exc)[:200]})", "pass a readable UTF-8 YAML file")
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except _TooLarge as exc:
        fail(file, "", f"YAML document refused: {exc}", exc.fix)
    except RecursionError:
        fail(file, "", f"YAML document refused: nested deeper than {MAX_DEPTH} levels", "flatten the document")
    except yaml.YAMLError as exc:
        if "nesting depth" in str(getattr(exc, "problem", "")):   # PyYAML >= 6.0.4 has its own depth limit
            fail(file, "", f"YAML document refused: nested deeper than {MAX_DEPTH} levels", "flatten the document")
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = str(getattr(exc, "problem", None) or "not YAML")  # the problem only: never the text around it
        fail(file, where, f"malformed YAML: {problem[:120]}", "fix the YAML there")
    except (ValueError, OverflowError) as exc:  # a tagged value PyYAML cannot build (`2001-02-30`)
        fail(file, "", f"malformed YAML value: {str(exc)[:120]}", "quote the value, or write a plain number")


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
        unknown = [echo(key)[1:-1] if isinstance(key, str) else echo(key) for key in data
                   if not isinstance(key, str) or allowed is not None and key not in allowed]
        if unknown:  # a non-string key (`100:`) is never a valid name either
            listed = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            self.fail(unknown[0], f"unknown key(s) {listed}",
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
            self.fail(key, f"expected {want}, got {yaml_kind(value)} {echo(value)}", fix)
        return value

    def text(self, key: str, default: str | None = None, max_chars: int = MAX_TEXT_CHARS) -> str:
        """Free text: printable characters (no control characters, no line breaks), at most `max_chars`."""
        value = str(self._get(key, default, lambda v: isinstance(v, str) and bool(v.strip()),
                              "a non-empty string", "write a name (quote it if it looks like a number)"))
        if not value.isprintable() or len(value) > max_chars:
            self.fail(key, f"{echo(value)} is not one line of at most {max_chars} printable characters",
                      "write it on one line, without control characters (tabs, escapes, line breaks)")
        return value

    def name(self, key: str, what: str) -> str:
        """A name that becomes part of device labels, file names and reports: NAME_PATTERN only."""
        value = str(self._get(key, None, lambda v: isinstance(v, str) and bool(v), "a non-empty string",
                              "write a name (quote it if it looks like a number)"))
        check_name(value, what, self.file, self.at(key))
        return value

    def flag(self, key: str, default: bool) -> bool:
        return bool(self._get(key, default, lambda v: isinstance(v, bool), "true or false",
                              "write true or false, unquoted"))

    def number(self, key: str, *, positive: bool = True, default: float | None = None) -> float:
        """A finite number: > 0 when `positive`, else >= 0 (latencies, prices); at most MAX_FIGURE."""
        value = self._get(key, default, _is_finite_number, "a finite number", "write a plain number, e.g. 0.5 or 1e-9")
        if abs(value) > MAX_FIGURE:     # also keeps a huge integer from overflowing float()
            self.fail(key, f"must be at most {MAX_FIGURE:g}, got {echo(value)}", "give the figure in the field's unit")
        value = float(value)
        if value <= 0 if positive else value < 0:
            self.fail(key, f"must be {'> 0' if positive else '>= 0'}, got {value:g}",
                      f"give a {'positive' if positive else 'non-negative'} value")
        return value

    def choice(self, key: str, options: Iterable[str], what: str, also: str = "") -> str:
        """A string naming one of `options`; the fix lists them, closest to what was written first."""
        value = self.text(key)
        if value not in options:
            self.fail(key, f"unknown {what} {echo(value)}", f"use one of: {ranked(value, options)}{also}")
        return value

    def integer(self, key: str, maximum: int | None = None) -> int:
        """A whole number >= 1 (and <= `maximum` when given)."""
        value = self._get(key, None, lambda v: isinstance(v, int) and not isinstance(v, bool),
                          "a whole number", "write e.g. 1, 2 or 8")
        if value <= 0:
            self.fail(key, f"must be >= 1, got {value}", "give a positive count")
        if maximum is not None and value > maximum:
            self.fail(key, f"must be at most {maximum}, got {echo(value)}", f"give a count up to {maximum}")
        return int(value)


def _is_finite_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return isinstance(value, int) or math.isfinite(value)   # an int of any size is finite (and too big for float)


def check_name(value: str, what: str, file: str, field_path: str) -> None:
    """Raise SpecError unless `value` is a safe name (NAME_PATTERN)."""
    if not NAME_PATTERN.fullmatch(value):
        fail(file, field_path, f"{what} {echo(value)} is not a safe name",
             f"use {NAME_RULE}, e.g. a100-east or cpu_fast")
