"""The store's fast schema check never accepts what the core refuses, and agrees with it on
every well-formed event; plus the two rules the store adds (finite numbers, no NUL)."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from enum import StrEnum
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_samples import any_event, every_type_samples

from kvplane.core.errors import SchemaError
from kvplane.core.events import (
    EVENT_TYPES,
    BlocksFreed,
    BlocksReserved,
    Event,
    RequestRouted,
    encode,
    validate,
)
from kvplane.store import EventRefused, encode_batch, encode_event
from kvplane.store.encoding import _encoder

# Values of the wrong kind, for any field.
_wrong = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.floats(), st.text(max_size=3),
    st.lists(st.one_of(st.integers(), st.text(max_size=2), st.floats()), max_size=3),
    st.lists(st.integers(), max_size=3).map(tuple), st.just("a\x00b"), st.just({"x": 1}),
)  # fmt: skip


@st.composite
def broken_event(draw: st.DrawFn) -> Event:
    """A well-formed event with one field swapped for an arbitrary value (frozen dataclasses
    do not check types, so this is what a buggy driver could hand the store)."""
    event = draw(any_event)
    field = draw(st.sampled_from([f.name for f in dataclasses.fields(event)]))
    value = draw(_wrong)
    object.__setattr__(event, field, value)
    return event


def core_and_store_verdicts(event: Event) -> tuple[bool, bool]:
    try:
        validate(event)
        core_ok = True
    except SchemaError:
        core_ok = False
    try:
        row = encode_event(event)
        assert json.loads(row["payload_json"]) == row["payload"]
        store_ok = True
    except EventRefused:
        store_ok = False
    return core_ok, store_ok


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_event)
def test_fast_check_accepts_every_well_formed_event(event: Event) -> None:
    name = type(event).__name__
    fast = _encoder(name)
    assert fast is not None, f"{name} has an annotation the fast check does not know"
    row = encode_event(event, 0)
    assert row["type"] == name and row["time"] == event.at
    done = fast(event)  # the fast path, not the slow fallback
    assert done is not None and done[0] == row["payload"] == encode(event)[1]
    assert json.loads(row["payload_json"]) == row["payload"]  # the text written is the payload


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(broken_event())
def test_store_never_accepts_what_the_core_refuses(event: Event) -> None:
    core_ok, store_ok = core_and_store_verdicts(event)
    if not core_ok:
        assert not store_ok
    else:
        # The core accepts; the store too, unless one of its own two rules is broken.
        values = [getattr(event, f.name) for f in dataclasses.fields(event)]
        flat: list[Any] = []
        for v in values:
            flat.extend(v if isinstance(v, (list, tuple)) else [v])
        unstorable = any(
            (isinstance(v, float) and not math.isfinite(v)) or (isinstance(v, str) and "\x00" in v)
            for v in flat
        )
        assert store_ok != unstorable


def test_every_type_has_a_fast_check() -> None:
    assert all(_encoder(name) is not None for name in EVENT_TYPES)


def test_subclass_values_take_the_slow_path_and_pass() -> None:
    class Mode(StrEnum):
        push = "push"

    event = RequestRouted(at=1, instance="router", request="r", mode=Mode.push,  # type: ignore[arg-type]
                          prefill="p", decode="d")  # fmt: skip
    row = encode_event(event)
    assert row["payload"]["mode"] == "push" and row["time"] == 1


def test_batch_refusal_names_index_and_type() -> None:
    good = BlocksReserved(at=1.0, instance="p", blocks=(1,), purpose="prefill")
    bad = dataclasses.replace(good, blocks=(1, 2.5))
    with pytest.raises(EventRefused) as refused:
        encode_batch([good, good, good, bad])
    assert refused.value.index == 3 and refused.value.type_name == "BlocksReserved"
    assert "event #3 (BlocksReserved)" in str(refused.value)
    with pytest.raises(EventRefused, match=r"unknown event type 'str'"):
        encode_batch(["not an event"])  # type: ignore[list-item]


def test_payload_is_exactly_the_cores_encoding() -> None:
    for event in every_type_samples(3):
        assert encode_event(event)["payload"] == encode(event)[1]
        assert typing.get_type_hints(type(event))  # annotations resolvable


def test_a_block_list_shared_by_events_is_written_alike_and_checked_each_time() -> None:
    blocks = tuple(range(1000, 1300))
    reserved = BlocksReserved(at=1.0, instance="p", request="r", blocks=blocks,
                              purpose="prefill")
    freed = BlocksFreed(at=2.0, instance="p", request="r", blocks=blocks, reason="sent")
    rows = encode_batch([reserved, freed, reserved])
    for row in rows:
        assert json.loads(row["payload_json"]) == row["payload"]
        assert row["payload"]["blocks"] == list(blocks)
    assert rows[0]["payload_json"] == rows[2]["payload_json"]
    # a list with a bad id among equal ones is still refused, though its neighbours were seen
    with pytest.raises(EventRefused):
        encode_event(dataclasses.replace(reserved, blocks=(*blocks[:-1], 1.5)))
