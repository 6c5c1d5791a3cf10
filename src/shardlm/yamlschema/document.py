"""One YAML file read for people's mistakes: plain data, and for every field path its line and text.

``load_yaml`` reads one YAML document into plain dicts, lists and strings without YAML 1.1's own typing:
an unquoted scalar stays its text (``Plain``) and the schema field that receives it decides what it may
be (see ``fields``). So ``max_seq_len: 0400`` is not 256 (YAML 1.1's octal) and ``1:2`` stays the text
``1:2``. Input is bounded before the work grows with it (``Limits``: characters, nesting, values), and
aliases, tags, repeated keys and second documents are refused, each with the line and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser when present: ~25x faster
NULLS = frozenset({"", "~", "null", "Null", "NULL"})
"""Unquoted scalars that mean null (YAML 1.1 and 1.2 agree)."""
TRUE_WORDS = frozenset({"yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"})
FALSE_WORDS = frozenset({"no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"})
"""YAML 1.1's booleans, as PyYAML reads them."""
_SHOWN = 40  # characters of a value or key shown in a message; longer ones are cut
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,40}")
_SKIPPED = frozenset({yaml.StreamStartEvent, yaml.StreamEndEvent, yaml.DocumentEndEvent})
_ENDS = frozenset({yaml.MappingEndEvent, yaml.SequenceEndEvent})
_PLAIN_KEY = re.compile(r"(?!(?:yes|no|true|false|on|off|null)$)[a-z_][a-z0-9_]*", re.IGNORECASE)  # str to YAML 1.1


class Plain(str):
    """The text of an unquoted YAML scalar, typed later by the schema field that receives it."""


@dataclass(frozen=True)
class Limits:
    """What one file may hold: bounds that keep the work of refusing bad input small."""

    max_chars: int
    """Characters of text."""
    max_depth: int
    """Levels of nested mappings and lists."""
    max_values: int
    """Keys, scalars, mappings and lists together."""


@dataclass(frozen=True)
class Spot:
    """Where a value is written: its line (a mapping value's is its key's) and, for a scalar, its text."""

    line: int
    text: str | None = None
    """The scalar as written; None for a mapping or a list."""
    plain: bool = False
    """Unquoted scalar."""
    kind: str = "scalar"
    """scalar | mapping | list."""


@dataclass(frozen=True)
class Document:
    """One parsed YAML file: the plain data and, for every field path, where it is written."""

    data: Any
    source: str
    """The file name, for messages."""
    spots: dict[tuple, Spot]
    error_type: type[Exception]
    """What ``error`` builds (ManifestError, HardwareError)."""
    guide: str = "the documentation"
    """Where the schema is described, for fixes with no better hint."""
    amend: Callable[[tuple, str], str] | None = None
    """Rewrites the fix for a path (the manifest adds "or delete the predictions section")."""

    def line(self, path: tuple) -> int:
        """Line of the deepest value along ``path`` that is written (1-based)."""
        for n in range(len(path), -1, -1):
            spot = self.spots.get(tuple(path[:n]))
            if spot is not None:
                return spot.line
        return 1

    def describe(self, path: tuple) -> str:
        """How the value at ``path`` reads in a message: 'two', 5, true, null, a list, a mapping."""
        spot = self.spots.get(tuple(path))
        if spot is None:
            return "nothing"
        if spot.kind != "scalar":
            return ("a " if _value_at(self.data, path) else "an empty ") + spot.kind
        if spot.plain and spot.text in NULLS:
            return "null"
        quoted = not spot.plain or yaml11_tag(spot.text) == "str"
        return shown(spot.text, quoted)

    def error(self, path: tuple, problem: str, fix: str) -> Exception:
        """'file:line: path: problem; fix' as this document's error type, on one line (``fix`` may be in
        ``problem`` already: then pass "")."""
        if self.amend is not None:
            fix = self.amend(tuple(path), fix)
        where = f"{dotted(path)}: " if path else ""
        tail = f"; {fix}" if fix else ""
        return self.error_type(one_line(f"{self.source}:{self.line(path)}: {where}{problem}{tail}"))


def shown(text: str, quoted: bool = True, limit: int = _SHOWN) -> str:
    """A value as a message shows it: quoted with repr, cut to `limit` characters with its length."""
    cut = text if len(text) <= limit else text[:limit] + "..."
    out = repr(cut) if quoted else cut
    return out if cut is text else f"{out} ({len(text)} characters)"


def dotted(path: tuple) -> str:
    """``stages[1].devices[0]``; odd or long keys are quoted and cut."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            name = part if _NAME.fullmatch(part) else shown(part)
            out += f".{name}" if out else name
    return out


def one_line(message: str) -> str:
    """The message with line breaks turned into spaces: errors are printed as one line."""
    return " ".join(message.splitlines())  # every line break Python knows, \u2028 included


def _value_at(data: Any, path: tuple) -> Any:
    for part in path:
        data = data[part]
    return data


def yaml11_tag(text: str) -> str:
    """What YAML 1.1 (PyYAML's resolver) would make of an unquoted scalar: str, int, float, bool, null..."""
    tag = yaml.resolver.Resolver().resolve(yaml.ScalarNode, text, (True, False))
    return tag.rsplit(":", 1)[-1]


def yaml11_value(text: str) -> Any:
    """What YAML 1.1 (PyYAML's SafeLoader) would make of an unquoted scalar: 256 for ``0400``."""
    node = yaml.ScalarNode(f"tag:yaml.org,2002:{yaml11_tag(text)}", text)
    return yaml.constructor.SafeConstructor().construct_object(node, deep=True)


# ---------------------------------------------------------------------------------------------- loading


@dataclass
class _Open:
    """A mapping or list being filled while the events stream in."""

    value: dict | list
    path: tuple
    key: str | None = None
    """A mapping's key waiting for its value."""
    key_line: int = 0


@dataclass
class _Build:
    """The state of one load: the source, its limits, what is built so far."""

    source: str
    error_type: type[Exception]
    limits: Limits
    what: str
    spots: dict[tuple, Spot] = field(default_factory=dict)
    stack: list[_Open] = field(default_factory=list)
    root: Any = None
    documents: int = 0
    values: int = 0

    def fail(self, line: int, path: tuple, problem: str, fix: str) -> Exception:
        where = f"{dotted(path)}: " if path else ""
        return self.error_type(one_line(f"{self.source}:{line}: {where}{problem}; {fix}"))


def _too_deep(limits: Limits, what: str) -> tuple[str, str]:
    """The problem and the fix for a document nested deeper than the cap (ours, or the parser's own)."""
    return (f"nested more than {limits.max_depth} levels deep",
            f"check the indentation and brackets: a {what} is a few levels deep")


def load_yaml(text: str, source: str, error_type: type[Exception], limits: Limits, what: str = "file",
              guide: str = "the documentation", amend: Callable[[tuple, str], str] | None = None) -> Document:
    """Parse one YAML document of at most ``limits`` into a ``Document``; any problem is ``error_type``.

    Refused, each with the line and the fix: text over the size cap (before parsing), invalid YAML, more
    than one document, nesting or value counts over the caps, aliases and tags, keys that are not plain
    names, repeated keys. An empty document (or only comments) is refused as empty. ``what`` names the
    kind of file in messages ("manifest").
    """
    if len(text) > limits.max_chars:
        raise error_type(f"{source}: {len(text)} characters, more than the {limits.max_chars} a {what} may have; "
                         f"check that it is a {what} (a {what} is a short YAML file)")
    build = _Build(source, error_type, limits, what)
    try:
        for event in yaml.parse(text, Loader=_LOADER):
            _take(build, event)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        problem = ": ".join(filter(None, (e.context, e.problem)))
        if "maximum nesting depth" in problem:  # PyYAML >= 6.0.3 caps flow nesting in its scanner, before our check
            raise build.fail(mark.line + 1 if mark else 1, (), *_too_deep(limits, what)) from e
        raise error_type(one_line(f"{source}:{mark.line + 1 if mark else 1}: not valid YAML ({problem}); fix the "
                                  "syntax on this line or the one before: indentation, a missing ':', or an "
                                  "unquoted value containing ': ' or ' #'")) from e
    except yaml.reader.ReaderError as e:  # a character YAML does not allow
        line = text.count("\n", 0, e.position) + 1
        char = e.character if isinstance(e.character, str) else chr(e.character)
        raise error_type(f"{source}:{line}: not valid YAML (character {char!r} is not allowed); remove it") from e
    except UnicodeEncodeError as e:  # a lone surrogate: not text any file could hold
        line = text.count("\n", 0, e.start) + 1
        raise error_type(f"{source}:{line}: not valid text (a lone surrogate {text[e.start]!r}); "
                         "save the file as UTF-8") from e
    if build.root is None:
        raise error_type(f"{source}:1: the {what} is empty; write its fields, as {guide} describes")
    return Document(build.root, source, build.spots, error_type, guide, amend)


def _take(b: _Build, event: yaml.Event) -> None:
    """Add one parser event to the document being built."""
    kind = type(event)
    if kind in _SKIPPED:
        return
    line = event.start_mark.line + 1
    if kind is yaml.DocumentStartEvent:
        b.documents += 1
        if b.documents > 1:
            raise b.fail(line, (), "a second YAML document starts here", f"a {b.what} is one document: "
                         "remove the '---' line and what follows, or merge it into the first")
        return
    if kind in _ENDS:
        b.stack.pop()
        return
    b.values += 1  # keys count too: what the work of reading grows with
    if b.values > b.limits.max_values:
        raise b.fail(line, (), f"more than {b.limits.max_values} keys and values in one {b.what}",
                     f"check that it is a {b.what}: a {b.what} holds far fewer")
    top = b.stack[-1] if b.stack else None
    if top is not None and top.key is None and type(top.value) is dict:
        _take_key(b, top, event, line)
        return
    _take_value(b, top, event, line)


def _take_key(b: _Build, top: _Open, event: yaml.Event, line: int) -> None:
    """A mapping key: a plain name, not seen before in this mapping."""
    if not isinstance(event, yaml.ScalarEvent) or event.tag is not None or (
            not event.style and not _PLAIN_KEY.fullmatch(event.value) and yaml11_tag(event.value) != "str"):
        got = "a mapping" if isinstance(event, yaml.MappingStartEvent) else (
            "a list" if isinstance(event, yaml.SequenceStartEvent) else shown(getattr(event, "value", "?"), False))
        raise b.fail(line, top.path, f"keys must be plain names, got {got}", "use a field name from " + b.what
                     + " documentation, e.g. `name: value`")
    key = event.value
    if key in top.value:
        first = b.spots[top.path + (key,)].line
        raise b.fail(line, top.path + (key,), f"appears twice (first on line {first})", "keep only one of them")
    top.key, top.key_line = key, line


def _take_value(b: _Build, top: _Open | None, event: yaml.Event, line: int) -> None:
    """A scalar, or the start of a mapping or list, as the next value of ``top`` (or the root)."""
    if top is None:
        path, at = (), line
    elif isinstance(top.value, dict):
        path, at = top.path + (top.key,), top.key_line
    else:
        path, at = top.path + (len(top.value),), line
    if isinstance(event, yaml.AliasEvent):
        raise b.fail(line, path, f"an alias (*{event.anchor}) is not supported", "write the value out in full")
    if event.tag is not None:
        raise b.fail(line, path, f"a YAML tag ({shown(event.tag, False)}) is not supported",
                     "remove the tag; quote the value to mean text")
    if isinstance(event, yaml.ScalarEvent):
        plain = not event.style  # None (pure-Python parser) or "" (libyaml)
        value = (None if event.value in NULLS else Plain(event.value)) if plain else event.value
        b.spots[path] = Spot(at, event.value, plain)
    else:
        if len(b.stack) >= b.limits.max_depth:
            raise b.fail(line, path, *_too_deep(b.limits, b.what))
        value = {} if isinstance(event, yaml.MappingStartEvent) else []
        b.spots[path] = Spot(at, kind="mapping" if isinstance(value, dict) else "list")
    if top is None:
        b.root = value
    elif isinstance(top.value, dict):
        top.value[top.key] = value
        top.key = None
    else:
        top.value.append(value)
    if isinstance(value, (dict, list)):
        b.stack.append(_Open(value, path))
