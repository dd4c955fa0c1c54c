"""Events: every type round-trips through encode/decode; anything off-schema is a SchemaError."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, Literal, Union

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.core import events as ev
from kvplane.core.errors import SchemaError

COMMON = ("at", "instance", "request")
ALL_TYPES = sorted(ev.EVENT_TYPES.items())


def strategy_for(hint: Any) -> st.SearchStrategy[Any]:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return st.sampled_from(typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return st.one_of(*(strategy_for(a) for a in typing.get_args(hint)))
    if origin is tuple:
        return st.lists(strategy_for(typing.get_args(hint)[0]), max_size=4).map(tuple)
    if hint is type(None):
        return st.none()
    if hint is float:
        return st.floats(allow_nan=False, allow_infinity=False, width=64)
    if hint is int:
        return st.integers(-(2**40), 2**40)
    if hint is str:
        return st.text(max_size=8)
    if hint is bool:
        return st.booleans()
    raise AssertionError(f"no strategy for {hint!r}")


def events_of(cls: type[ev.Event]) -> st.SearchStrategy[ev.Event]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: strategy_for(hints[f.name]) for f in dataclasses.fields(cls)}
    return st.fixed_dictionaries(fields).map(lambda kw: cls(**kw))


def sample(hint: Any) -> Any:
    """One valid plain (JSON) value for a hint."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return typing.get_args(hint)[0]
    if origin in (Union, types.UnionType):
        return sample(typing.get_args(hint)[0])
    if origin is tuple:
        return [sample(typing.get_args(hint)[0])] * 2
    return {float: 1.5, int: 3, str: "x", bool: True, type(None): None}[hint]


def wrong(hint: Any) -> list[Any]:
    """Plain values that must not fit the hint."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return ["not-a-choice", 7, None]
    if origin in (Union, types.UnionType):
        return [[1.5, {}]] if type(None) in typing.get_args(hint) else [None, {}]
    if origin is tuple:
        return ["not-a-list", 5, [{"x": 1}]]
    return {
        float: ["1.5", None, True],
        int: [1.5, "3", True, None],
        str: [3, None, ["x"]],
        bool: [1, "true", None],
    }[hint]


def payload_of(cls: type[ev.Event]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: sample(hints[f.name]) for f in dataclasses.fields(cls) if f.name not in COMMON}


def test_event_types_are_frozen_slotted_and_named_in_the_past() -> None:
    for name, cls in ALL_TYPES:
        assert cls.__name__ == name
        assert hasattr(cls, "__slots__")
        e = ev.decode(name, payload_of(cls), at=0.0, instance="i", request=None)
        with pytest.raises(dataclasses.FrozenInstanceError):
            e.at = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(("name", "cls"), ALL_TYPES)
@settings(max_examples=6, deadline=None, derandomize=True)
@given(data=st.data())
def test_round_trip_every_type(name: str, cls: type[ev.Event], data: st.DataObject) -> None:
    event = data.draw(events_of(cls))
    type_name, payload = ev.encode(event)
    assert type_name == name
    wire = json.loads(json.dumps(payload))  # the payload really is plain JSON
    back = ev.decode(type_name, wire, at=event.at, instance=event.instance, request=event.request)
    assert back == event
    assert type(back) is cls
    ev.validate(event)


@pytest.mark.parametrize(("name", "cls"), ALL_TYPES)
def test_missing_extra_and_ill_typed_fields(name: str, cls: type[ev.Event]) -> None:
    good = payload_of(cls)
    ev.decode(name, good, at=1.0, instance="i", request="r")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in COMMON:
            continue
        if f.default is dataclasses.MISSING:
            missing = {k: v for k, v in good.items() if k != f.name}
            with pytest.raises(SchemaError, match="missing field"):
                ev.decode(name, missing, at=1.0, instance="i", request="r")
        for bad in wrong(hints[f.name]):
            with pytest.raises(SchemaError):
                ev.decode(name, {**good, f.name: bad}, at=1.0, instance="i", request="r")
    with pytest.raises(SchemaError, match="unknown field"):
        ev.decode(name, {**good, "surprise": 1}, at=1.0, instance="i", request="r")
    # the common fields travel beside the payload, never inside it
    with pytest.raises(SchemaError, match="unknown field"):
        ev.decode(name, {**good, "at": 1.0}, at=1.0, instance="i", request="r")
    for at, instance, request in (("1", "i", None), (True, "i", None), (1.0, 3, None),
                                  (1.0, "i", 5), (1.0, None, None)):
        with pytest.raises(SchemaError):
            ev.decode(name, good, at=at, instance=instance, request=request)  # type: ignore[arg-type]


def test_unknown_type_and_bad_payload() -> None:
    with pytest.raises(SchemaError, match="unknown event type"):
        ev.decode("BlocksStolen", {}, at=0.0, instance="i", request=None)
    with pytest.raises(SchemaError, match="must be an object"):
        ev.decode("LeaseExpired", ["lease"], at=0.0, instance="i", request=None)  # type: ignore[arg-type]

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class BlocksStolen(ev.Event):
        blocks: tuple[int, ...]

    with pytest.raises(SchemaError, match="unknown event type"):
        ev.encode(BlocksStolen(at=0.0, instance="i", blocks=(1,)))
    with pytest.raises(SchemaError):
        ev.validate(BlocksStolen(at=0.0, instance="i", blocks=(1,)))


def test_validate_catches_an_ill_typed_event_built_in_code() -> None:
    bad = ev.BlocksFreed(at=0.0, instance="i", request="r", blocks=(1, "2"), reason="x")  # type: ignore[arg-type]
    with pytest.raises(SchemaError):
        ev.validate(bad)
    with pytest.raises(SchemaError):
        ev.validate(ev.TransferCompleted(at=0.0, instance="i", attempt=0, direction="X"))  # type: ignore[arg-type]


def test_defaults_fill_in_and_ints_widen_to_float() -> None:
    e = ev.decode("BlocksReserved", {"blocks": [3, 4], "purpose": "decode"},
                  at=2, instance="D", request="r")
    assert e == ev.BlocksReserved(at=2.0, instance="D", request="r", blocks=(3, 4),
                                  purpose="decode", attempt=0)
    assert isinstance(e.at, float)
    assert ev.SCHEMA_VERSION >= 1
