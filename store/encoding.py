"""Events to rows: the core's schema check, made cheap enough for the write path.

Rules kept here:
- The core is the authority: an event is stored only if `kvplane.core.events.encode` accepts
  it and its payload passes the same checks `kvplane.core.events.validate` makes. Whatever the
  core refuses comes back as `EventRefused`, with the core's own message.
- On top of the core's rules the store refuses what the two backends cannot hold alike:
  non-finite numbers (JSON has no NaN or infinity; SQLite turns a NaN time into NULL) and the
  NUL character (PostgreSQL text cannot hold it, nor its JSON operators unescape it).

How it stays cheap: `validate` rebuilds the whole event through generic annotation walking,
about 50 us for a TransferPlanned with two 16-block lists. Here each event type gets an
encoder generated once from the same dataclass annotations: it tests every field of the event
with exact types only (`type(v) is int`), so that it accepts strictly less than the core does,
and builds the payload `encode` would build. When it says no, or meets an annotation it does
not know, the event goes the slow way: the core's `encode` and `validate`, which either raise
the real `SchemaError` or accept (a subclass of int, say), and then the store's own two rules.
So the fast path can only ever say "yes" where the core says yes too; `tests/store` checks
the two agree on random and broken events.

Block-id lists are most of a recording's bytes and work (a 16k-token prompt is a list of 1,024
ids, and the same list is in about six events of its request: reserved, registration sent
and arrived, prefill finished, transfer planned, freed). The core hands the same tuple object
from event to event, so each list is checked and turned into JSON once, then reused by
identity (a small cache that holds the tuple itself, so an id is never mistaken), and the
payload's JSON text is made here, once (`payload_json`), with the lists spliced in. The
stored JSON is the same as before, so old stores, SQL on payloads and readers are unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal, NotRequired, TypedDict, Union

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
    payload_json: NotRequired[str]  # `payload` as JSON text, when made on the fast path


_dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def encode_event(event: Event, index: int | None = None) -> EncodedEvent:
    """Check `event` and turn it into a row; `EventRefused` (naming `index`) if it is unfit."""
    fast = _BY_CLASS.get(type(event))
    if fast is None:
        fast = _by_class(type(event))
    try:
        done = fast(event)
    except Exception:  # noqa: BLE001 - an odd value (unhashable, say): the core judges it
        done = None
    if done is not None:
        payload, text = done
        name = fast.__name__
    else:
        name = type(event).__name__
        try:
            name, payload = encode(event)
            validate(event)
        except SchemaError as exc:
            raise EventRefused(index, name, str(exc)) from None
        problem = _unstorable(event, payload)
        if problem is not None:
            raise EventRefused(index, name, problem)
        text = _dumps(payload)
    return {
        "time": event.at,
        "type": name,
        "request": event.request,
        "instance": event.instance,
        "payload": payload,
        "payload_json": text,
    }


def encode_batch(events: Sequence[Event]) -> list[EncodedEvent]:
    """Every event of a batch as rows, or `EventRefused` for the first unfit one."""
    return [encode_event(event, index) for index, event in enumerate(events)]


# --- block-id lists and hash chains, once per tuple ----------------------------------------

_LIST_CACHE_SIZE = 1024  # lists of the requests in flight; the oldest is forgotten first
_INTS_JSON: dict[int, tuple[tuple[Any, ...], str]] = {}  # id(tuple) -> (tuple, JSON text)
_STRS_JSON: dict[int, tuple[tuple[Any, ...], str]] = {}


def _ints_json(value: Any) -> str | None:
    """The JSON array of a tuple of exact ints, or None if `value` is not one."""
    hit = _INTS_JSON.get(id(value))
    if hit is not None and hit[0] is value:
        return hit[1]
    if type(value) is not tuple or not set(map(type, value)) <= _INT_SET:
        return None
    return _remember(_INTS_JSON, value, "[" + ",".join(map(str, value)) + "]")


def _strs_json(value: Any) -> str | None:
    """The JSON array of a tuple of exact strs without NUL, or None if `value` is not one."""
    hit = _STRS_JSON.get(id(value))
    if hit is not None and hit[0] is value:
        return hit[1]
    if (type(value) is not tuple or not set(map(type, value)) <= _STR_SET
            or "\x00" in "".join(value)):
        return None
    return _remember(_STRS_JSON, value, _dumps(list(value)))


def _remember(cache: dict[int, tuple[tuple[Any, ...], str]], value: tuple[Any, ...],
              text: str) -> str:
    if len(cache) >= _LIST_CACHE_SIZE:
        try:  # another recording thread may evict at the same moment: either one will do
            cache.pop(next(iter(cache)), None)
        except (RuntimeError, StopIteration):
            pass
    cache[id(value)] = (value, text)  # holding the tuple keeps its id from being reused
    return text


_INT_SET = {int}
_STR_SET = {str}
_TUPLE_JSON = {tuple[int, ...]: "_ints_json", tuple[str, ...]: "_strs_json"}


# --- compiled encoders ---------------------------------------------------------------------

FastEncoder = Callable[[Event], "tuple[dict[str, Any], str] | None"]

_ENCODERS: dict[str, FastEncoder | None] = {}


_BY_CLASS: dict[type, FastEncoder] = {}


def _slow(event: Event) -> None:
    return None


def _by_class(cls: type) -> FastEncoder:
    """The fast encoder of an event class (named after its type), `_slow` for anything else."""
    name = cls.__name__
    fast = _encoder(name) if EVENT_TYPES.get(name) is cls else None
    _BY_CLASS[cls] = fast or _slow
    return _BY_CLASS[cls]


def _encoder(name: str) -> FastEncoder | None:
    if name not in _ENCODERS:
        _ENCODERS[name] = _compile_event(EVENT_TYPES[name])
    return _ENCODERS[name]


def _compile_event(cls: type[Event]) -> FastEncoder | None:
    """One function per event type: a straight line of field tests on the event itself, then
    its payload (what `encode` makes) and that payload's JSON text; None for "ask the core".

    Generated rather than a loop over per-field closures because it runs for every event
    recorded, and inlining the tests halves its cost (the way `dataclasses` writes `__init__`).
    """
    hints = typing.get_type_hints(cls)
    payload_fields = [f.name for f in dataclasses.fields(cls) if f.name not in _COMMON]
    constants: dict[str, Any] = {"_isfinite": math.isfinite, "_INT": {int}, "_STR": {str},
                                 "_NUM": {int, float}, "_ints_json": _ints_json,
                                 "_strs_json": _strs_json, "_dumps": _dumps,
                                 "_jstr": _json_str}  # fmt: skip
    lines = ["def encode(event):"]
    scalars, lists = [], []
    for index, (name, hint) in enumerate(hints.items()):
        var = f"v{index}"
        lines.append(f"    {var} = event.{name}")
        if hint in _TUPLE_JSON:  # checked and turned into JSON once per tuple
            lines.append(f"    t{index} = {_TUPLE_JSON[hint]}({var})")
            lines.append(f"    if t{index} is None:")
            lines.append("        return None")
            lists.append((name, var, f"t{index}"))
            continue
        expr = _expr(hint, var, constants)
        if expr is None or typing.get_origin(hint) is tuple:
            return None
        lines.append(f"    if not {expr}:")
        lines.append("        return None")
        if name in payload_fields:
            scalars.append((name, var))
    if {n for n, _ in scalars} | {n for n, _, _ in lists} != set(payload_fields):
        return None
    by_name = {n: f"list({v})" for n, v, _ in lists} | {n: v for n, v in scalars}
    lines.append("    payload = {" + ", ".join(f"{n!r}: {by_name[n]}" for n in payload_fields)
                 + "}")
    # the JSON text as one expression: each value's JSON by its (already checked) type
    texts = {n: t for n, _, t in lists}
    texts |= {n: _json_expr(hints[n], v) for n, v in scalars}
    body = ",".join(f'"{n}":{{{texts[n]}}}' for n in payload_fields)
    lines.append(f"    return payload, f'''{{{{{body}}}}}'''")
    source = "\n".join(lines) + "\n"
    namespace: dict[str, Any] = dict(constants)
    exec(compile(source, f"<kvplane.store encode {cls.__name__}>", "exec"), namespace)  # noqa: S102
    fast = namespace["encode"]
    fast.__name__ = cls.__name__  # the row's type, read back by `encode_event`
    return typing.cast(FastEncoder, fast)


_json_str = json.encoder.encode_basestring_ascii  # what `_dumps` writes for a str


def _json_expr(hint: Any, var: str) -> str:
    """A Python expression giving `var`'s JSON text, `var` having passed `_expr(hint)`: the
    text `_dumps` would write (`repr` of a finite float is what `json` writes too)."""
    if hint is int:
        return var  # an f-string field: str() of an exact int
    if hint is float:
        return f"repr({var})"
    if hint is str:
        return f"_jstr({var})"
    if hint is bool:
        return f"('true' if {var} else 'false')"
    if hint is type(None):
        return "'null'"
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal and all(type(a) is str for a in args):
        return f"_jstr({var})"
    if typing.get_origin(hint) in (Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return f"('null' if {var} is None else {_json_expr(inner[0], var)})"
    return f"_dumps({var})"


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
