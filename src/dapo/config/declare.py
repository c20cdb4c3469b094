"""How a setting is declared: its ``Rule`` (what it accepts beyond its type, and what its error says), ``field``
(a dataclass field that carries one), ``ConfigError`` and ``resolve_type``. The tree itself is ``schema``'s."""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """What one setting accepts beyond its type, and what its error message says."""

    gt: float | None = None  # bounds of a number: > gt, >= ge, < lt, <= le
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    unit: str = ""  # said after the bound: "must be > 0 seconds"
    null: str = ""  # what null (unset) means, for a setting that may be null: "must be > 0, or null (no cap)"
    why: str = ""  # said after the range: "must be in (0, 1); the paper uses 0.2"
    check: Callable[[typing.Any], bool] | None = None  # a rule bounds cannot say ...
    must: str = ""  # ... and what it wants: "run.name='a/b': must be one plain directory name ..."

    def broken(self, key: str, value) -> str | None:
        """The one-line error for ``value``, or None where it is fine."""
        if self.check is not None and not self.check(value):
            return f"{key}={value!r}: {self.must}"
        if all(OPS[op](value, b) for op, b in self.bounds()):
            return None
        return f"{key}={value!r}: must be {self.allowed()}"

    def bounds(self) -> list[tuple[str, float]]:
        return [
            (op, b) for op, b in ((">", self.gt), (">=", self.ge), ("<", self.lt), ("<=", self.le)) if b is not None
        ]

    def allowed(self) -> str:
        """The bounds as an error says them: "in (0, 1] seconds, or null (no cap); the paper uses 0.2"."""
        bounds = self.bounds()
        if len(bounds) == 2:  # an interval: (0, 1]
            (lo, a), (hi, b) = bounds
            text = f"in {'(' if lo == '>' else '['}{a:g}, {b:g}{')' if hi == '<' else ']'}"
        else:
            text = f"{bounds[0][0]} {bounds[0][1]:g}"
        unit, null = f" {self.unit}" if self.unit else "", f", or null ({self.null})" if self.null else ""
        return f"{text}{unit}{null}" + (f"; {self.why}" if self.why else "")


OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


class ConfigError(ValueError):
    """A bad config value; the message names the key and the fix."""


def resolve_type(tp):
    """(base type, allows None) for the annotations of the config tree (dapo.config)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return resolve_type(args[0])[0], True
    return tp, False


def field(default=dataclasses.MISSING, *, default_factory=dataclasses.MISSING, **rule) -> typing.Any:
    """A dataclass field with its ``Rule``: ``eps_high: float = field(0.28, gt=0, le=10)``."""
    metadata = {"rule": Rule(**rule)} if rule else {}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)
