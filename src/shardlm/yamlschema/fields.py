"""Field types for schemas of YAML written by people: each decides what an unquoted scalar may be.

``Int`` takes plain decimal only (not ``0400``, ``0x10``, ``1_000``, ``4:16``, ``2.0`` or ``"2"``);
``NUMBER`` a finite decimal >= 0 (``1e-3`` included); ``FLAG`` true/false (and YAML 1.1's yes/no,
on/off); ``TEXT`` any string as written (``name: 7b``, ``1:2``) but not an unquoted boolean; ``choice``
one of a few words. Each carries an ``Expect`` marker, the noun phrase messages use ("an integer >= 1").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from annotated_types import Ge, Le
from pydantic import BaseModel, BeforeValidator, ConfigDict, Strict

from shardlm.yamlschema.document import FALSE_WORDS, TRUE_WORDS, Plain

DECIMAL_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]{0,29})")
"""Integers as shardlm reads them: plain decimal, at most 30 digits."""
DECIMAL = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
"""Numbers as shardlm reads them: decimal, with an optional exponent."""
MAX_TEXT = 4096
"""Longest string a field takes: a name or a path (PATH_MAX on Linux)."""

@dataclass(frozen=True)
class Expect:
    """Marker on a field type: what the field holds, as a noun phrase ("an integer >= 1")."""

    text: str
    number: bool = False
    """A number field: a YAML 1.1 number form (0400, 0x10, 1_000, 4:16) gets a note."""
    quote: bool = False
    """A text field: a YAML 1.1 boolean written unquoted (yes, on) gets a "quote it" note."""


class Invalid(ValueError):
    """Raised by a field validator with the exact problem and fix to report (fix "" when it is in problem)."""

    def __init__(self, problem: str, fix: str = ""):
        super().__init__(problem)
        self.problem, self.fix = problem, fix


def _to_int(value: Any) -> Any:
    return int(value) if type(value) is Plain and DECIMAL_INT.fullmatch(value) else value


def _to_number(value: Any) -> Any:
    return float(value) if type(value) is Plain and DECIMAL.fullmatch(value) else value


def _to_flag(value: Any) -> Any:
    if type(value) is Plain:
        return True if value in TRUE_WORDS else False if value in FALSE_WORDS else value
    return value


def _to_text(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_TEXT:
        raise Invalid(f"is {len(value)} characters long", f"shorten it to at most {MAX_TEXT} (a name or a path)")
    if type(value) is Plain:
        if value in TRUE_WORDS or value in FALSE_WORDS:
            raise ValueError("a YAML boolean where text is expected")
        return str(value)
    return value


def Int(minimum: int = 0, maximum: int | None = None) -> Any:
    """An integer in plain decimal (``2``, ``-1``; not ``0400``, ``0x10``, ``1_000``, ``4:16``, ``2.0``, ``"2"``)."""
    want = f"an integer >= {minimum}" if maximum is None else f"an integer in {minimum}..{maximum}"
    bounds = (Ge(minimum),) if maximum is None else (Ge(minimum), Le(maximum))
    return Annotated[int, BeforeValidator(_to_int), Strict(), *bounds, Expect(want, number=True)]


NUMBER = Annotated[float, BeforeValidator(_to_number), Strict(), Ge(0),
                   Expect("a number >= 0", number=True)]
"""A finite number >= 0 in decimal (``0.5``, ``3``, ``1e-3``, ``1.25e-2``)."""
FLAG = Annotated[bool, BeforeValidator(_to_flag), Strict(), Expect("true or false")]
"""A boolean: true/false (and YAML 1.1's yes/no, on/off)."""
TEXT = Annotated[str, BeforeValidator(_to_text), Strict(), Expect("a string", quote=True)]
"""A string as written: an unquoted number keeps its text (``name: 7b``, ``1:2``); ``yes`` is refused."""


def choice(values: tuple[str, ...]) -> Any:
    """One of ``values``, written as text."""
    return Annotated[Literal[values], BeforeValidator(_to_text), Expect("one of " + ", ".join(values), quote=True)]


class Section(BaseModel):
    """Base of every schema mapping: unknown keys refused, nothing coerced, values frozen."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)
