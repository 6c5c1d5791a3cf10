"""Pydantic's validation errors as one-line messages: file, line, field path, problem and fix.

``validate(doc, Schema)`` reports the first problem (unknown keys first, then the earliest line) as

    m.yaml:5: parallelism.tensor: expected an integer >= 1, got 'two'; set it to the tensor-parallel degree, e.g. 2

"expected ..." comes from the field type's ``Expect`` marker (or its kind: a mapping, a list); "got ..."
is the value as written (cut when long); "set it to ..." is the field's ``description``. ``hint`` gives
the same description to cross-field checks that run after the schema.
"""

from __future__ import annotations

import difflib
import re
import types
from dataclasses import dataclass
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from shardlm.yamlschema.document import Document, dotted, yaml11_tag, yaml11_value
from shardlm.yamlschema.fields import DECIMAL, Expect, Invalid

_SHOWN = 40  # longest key that gets a "did you mean"
_LEADING_ZERO = re.compile(r"[-+]?0[0-9]")  # 0400: octal to YAML 1.1


def validate(doc: Document, schema: type[BaseModel]) -> Any:
    """``schema`` validated from ``doc.data``; the first problem raised as ``doc.error``.

    Unknown keys are reported first (a typo also makes its field "missing"), then the problem on the
    earliest line.
    """
    try:
        return schema.model_validate(doc.data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
    first = min(errors, key=lambda err: (err["type"] != "extra_forbidden", doc.line(err["loc"])))
    raise doc.error(*_explain(doc, schema, first))


def hint(schema: type[BaseModel], path: tuple, doc: Document | None = None) -> str:
    """What the field at ``path`` should hold, for "set it to ...": its description, else its kind."""
    spot = _field_at(schema, path)
    if spot is not None:
        described = next((m.description for m in spot.meta if isinstance(m, FieldInfo) and m.description), None)
        if described:
            return described
        if spot.expect is not None:
            return spot.expect.text
    return f"a valid value (see {doc.guide if doc else 'the documentation'})"


def _explain(doc: Document, schema: type[BaseModel], err: dict) -> tuple[tuple, str, str]:
    """(path, problem, fix) for one pydantic error."""
    path = tuple(err["loc"])
    if err["type"] == "extra_forbidden":
        return path, *_unknown_key(schema, path)
    if err["type"] == "missing":
        where = f"under {dotted(path[:-1])}" if path[:-1] else "at the top level"
        return path, "missing", f"add it {where}, set to {hint(schema, path, doc)}"
    raised = (err.get("ctx") or {}).get("error")
    if isinstance(raised, Invalid):
        return path, raised.problem, raised.fix or f"set it to {hint(schema, path, doc)}"
    spot = _field_at(schema, path)
    expect = spot.expect if spot is not None else None
    want = expect.text if expect is not None else _kind(spot.base if spot else None)
    return path, f"expected {want}, got {doc.describe(path)}{_note(doc, path, expect)}", \
        f"set it to {hint(schema, path, doc)}{_quote_note(doc, path, expect)}"


def _unknown_key(schema: type[BaseModel], path: tuple) -> tuple[str, str]:
    parent = _field_at(schema, path[:-1])
    allowed = list(parent.base.model_fields) if parent is not None and _is_model(parent.base) else []
    key = path[-1]
    close = difflib.get_close_matches(key, allowed, n=1) if len(key) <= _SHOWN else []
    where = f"under {dotted(path[:-1])}" if path[:-1] else "at the top level"
    return (f"unknown key{f' (did you mean {close[0]!r}?)' if close else ''}",
            f"the keys allowed {where} are: {', '.join(allowed)}")


def _note(doc: Document, path: tuple, expect: Expect | None) -> str:
    """For a number field given a YAML 1.1 number form: what YAML 1.1 would have made of it."""
    spot = doc.spots.get(path)
    if expect is None or not expect.number or spot is None or not spot.plain or spot.text is None:
        return ""
    if yaml11_tag(spot.text) not in ("int", "float") or (DECIMAL.fullmatch(spot.text) and not _LEADING_ZERO.match(
            spot.text)):
        return ""
    return f" (YAML 1.1 would read that as {yaml11_value(spot.text)!r}; shardlm reads plain decimal only)"


def _quote_note(doc: Document, path: tuple, expect: Expect | None) -> str:
    spot = doc.spots.get(path)
    if expect is None or not expect.quote or spot is None or not spot.plain or yaml11_tag(spot.text) != "bool":
        return ""
    return f' (to mean the text, quote it: "{spot.text}")'


@dataclass(frozen=True)
class _Field:
    """A schema field found by path: its type without Optional/Annotated, and the metadata stripped off."""

    base: Any
    meta: tuple
    expect: Expect | None


def _unwrap(tp: Any, meta: list) -> Any:
    """``tp`` without Optional and Annotated layers; their metadata is appended to ``meta``."""
    while True:
        if get_origin(tp) is Annotated:
            args = get_args(tp)
            meta.extend(args[1:])
            tp = args[0]
        elif get_origin(tp) in (Union, types.UnionType):
            rest = [a for a in get_args(tp) if a is not type(None)]
            if len(rest) != 1:
                return tp
            tp = rest[0]
        else:
            return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _field_at(schema: type[BaseModel], path: tuple) -> _Field | None:
    """The field at ``path`` (keys and list indexes) in ``schema``, or None where the path leaves it."""
    tp, meta = schema, []
    for part in path:
        base = _unwrap(tp, [])
        if isinstance(part, str) and _is_model(base) and part in base.model_fields:
            info = base.model_fields[part]
            tp, meta = info.annotation, [info, *info.metadata]
        elif isinstance(part, int) and get_origin(base) in (list, tuple):
            tp, meta = get_args(base)[0], []
        elif isinstance(part, str) and get_origin(base) is dict:
            tp, meta = get_args(base)[1], []
        else:
            return None
    base = _unwrap(tp, meta)
    expect = next((m for m in reversed(meta) if isinstance(m, Expect)), None)  # the outermost type's
    return _Field(base, tuple(meta), expect)


def _kind(tp: Any) -> str:
    if _is_model(tp) or get_origin(tp) is dict:
        return "a mapping"
    if get_origin(tp) in (list, tuple):
        return "a list"
    return "a valid value"
