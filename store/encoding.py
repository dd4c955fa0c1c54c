"""Events to rows: the core's schema check, made cheap enough for the write path.

Rules kept here:
- The core is the authority: an event is stored only if `kvplane.core.events.encode` accepts
  it and its payload passes the same checks `kvplane.core.events.validate` makes. Whatever the
  core refuses comes back as `EventRefused`, with the core's own message.
- On top of the core's rules the store refuses what the two backends cannot hold alike:
  non-finite numbers (JSON has no NaN or infinity; SQLite turns a NaN time into NULL) and the
  NUL character (PostgreSQL text cannot hold it, nor its JSON operators unescape it).

How it stays cheap: `validate` rebuilds the whole event through generic annotation walking,
about 50 us for a TransferPlanned with two 16-block lists. Here each event type gets a checker
generated once from the same dataclass annotations, using exact types only (`type(v) is int`), so that
it accepts strictly less than the core does. When the checker says no, or meets an annotation
it does not know, the event goes the slow way: the core's `validate`, which either raises the
real `SchemaError` or accepts (a subclass of int, say), and then the store's own two rules.
So the fast path can only ever say "yes" where the core says yes too; `tests/store` checks
the two agree on random and broken events.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypedDict, Union

from ._core import EVENT_TYPES, Event, SchemaError, encode, validate
from .errors import EventRefused

_COMMON = ("at", "instance", "request")


class EncodedEvent(TypedDict):
    """One event as a row of the `events` table, less `run` and `seq` (given on append)."""

    time: float
    type: str
    request: str | None
    instance: str
    payload: dict[str, Any]


def encode_event(event: Event, index: int | None = None) -> EncodedEvent:
    """Check `event` and turn it into a row; `EventRefused` (naming `index`) if it is unfit."""
    try:
        name, payload = encode(event)
    except SchemaError as exc:
        raise EventRefused(index, type(event).__name__, str(exc)) from None
    check = _checker(name)
    try:
        fits = check is not None and check(event, payload)
    except Exception:  # noqa: BLE001 - an odd value (unhashable, say): the core judges it
        fits = False
    if not fits:
        try:
            validate(event)
        except SchemaError as exc:
            raise EventRefused(index, name, str(exc)) from None
        problem = _unstorable(event, payload)
        if problem is not None:
            raise EventRefused(index, name, problem)
    return {
        "time": event.at,
        "type": name,
        "request": event.request,
        "instance": event.instance,
        "payload": payload,
    }


def encode_batch(events: Sequence[Event]) -> list[EncodedEvent]:
    """Every event of a batch as rows, or `EventRefused` for the first unfit one."""
    return [encode_event(event, index) for index, event in enumerate(events)]


# --- compiled checkers ----------------------------------------------------------------------

EventCheck = Callable[[Event, dict[str, Any]], bool]

_CHECKERS: dict[str, EventCheck | None] = {}


def _checker(name: str) -> EventCheck | None:
    if name not in _CHECKERS:
        _CHECKERS[name] = _compile_event(EVENT_TYPES[name])
    return _CHECKERS[name]


def _compile_event(cls: type[Event]) -> EventCheck | None:
    """One function per event type: a straight line of field tests, generated as source.

    Generated rather than a loop over per-field closures because it runs for every event
    recorded, and inlining the tests halves its cost (the way `dataclasses` writes `__init__`).
    """
    hints = typing.get_type_hints(cls)
    constants: dict[str, Any] = {"_isfinite": math.isfinite, "_INT": {int}, "_STR": {str},
                                 "_NUM": {int, float}}  # fmt: skip
    lines = ["def check(event, payload):"]
    for index, (name, hint) in enumerate(hints.items()):
        var = f"v{index}"
        expr = _expr(hint, var, constants)
        if expr is None:
            return None
        lines.append(
            f"    {var} = " + (f"event.{name}" if name in _COMMON else f"payload[{name!r}]")
        )
        lines.append(f"    if not {expr}:")
        lines.append("        return False")
    lines.append("    return True\n")
    source = "\n".join(lines)
    namespace: dict[str, Any] = dict(constants)
    exec(compile(source, f"<kvplane.store check {cls.__name__}>", "exec"), namespace)  # noqa: S102
    return typing.cast(EventCheck, namespace["check"])


def _expr(hint: Any, var: str, constants: dict[str, Any]) -> str | None:
    """A strict test of `var` against one annotation, or None if we do not know it exactly."""
    if hint is int:
        return f"type({var}) is int"
    if hint is float:
        return f"((type({var}) is float and _isfinite({var})) or type({var}) is int)"
    if hint is str:
        return f"(type({var}) is str and '\\x00' not in {var})"
    if hint is bool:
        return f"type({var}) is bool"
    if hint is type(None):
        return f"{var} is None"
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        if not all(type(a) in (str, int, bool) for a in args):
            return None
        name = f"_L{len(constants)}"
        constants[name] = frozenset((type(a), a) for a in args)
        return f"(type({var}), {var}) in {name}"
    if origin in (Union, types.UnionType):
        options = [_expr(a, var, constants) for a in args]
        if any(o is None for o in options):
            return None
        return "(" + " or ".join(f"({o})" for o in options) + ")"
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        # encode() turns tuples into lists; C-level map/set/join keep long block lists cheap.
        item = args[0]
        if item is int:
            return f"(type({var}) is list and set(map(type, {var})) <= _INT)"
        if item is str:
            return (f"(type({var}) is list and set(map(type, {var})) <= _STR"
                    f" and '\\x00' not in ''.join({var}))")  # fmt: skip
        if item is float:
            return (f"(type({var}) is list and set(map(type, {var})) <= _NUM"
                    f" and all(map(_isfinite, {var})))")  # fmt: skip
        inner_var = f"{var}_"
        inner = _expr(item, inner_var, constants)
        if inner is None:
            return None
        return f"(type({var}) is list and all({inner} for {inner_var} in {var}))"
    return None


# --- the store's own rules, the slow way ---------------------------------------------------


def _unstorable(event: Event, payload: dict[str, Any]) -> str | None:
    values: list[tuple[str, Any]] = [(n, getattr(event, n)) for n in _COMMON]
    values += list(payload.items())
    for name, value in values:
        problem = _unstorable_value(value)
        if problem is not None:
            return f"field {name!r}: {problem}"
    return None


def _unstorable_value(value: Any) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value!r} cannot be stored (JSON has no NaN or infinity)"
    if isinstance(value, str) and "\x00" in value:
        return "the NUL character cannot be stored (PostgreSQL refuses it)"
    if isinstance(value, (list, tuple)):
        for item in value:
            problem = _unstorable_value(item)
            if problem is not None:
                return problem
    return None
