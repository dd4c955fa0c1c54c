"""The store's fast schema check never accepts what the core refuses, and agrees with it on
every well-formed event; plus the two rules the store adds (finite numbers, no NUL)."""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import typing
from enum import StrEnum
from itertools import accumulate
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
from kvplane.store import EventRefused, block_count, encode_batch, encode_event, payload_of
from kvplane.store.encoding import (
    _encoder,
    _pack_general,
    _pack_ints,
    encode_trusted,
    pack_lists,
    unpack_lists,
)

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
        assert payload_of(row) == encode(event)[1]
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
    assert row.type == name and row.time == event.at and row.blocks == block_count(event)
    assert payload_of(row) == encode(event)[1]  # the text and lists written are the payload
    done = fast(event)  # the fast path, not the slow fallback
    if any(_outside_int32(v) for v in _int_lists(event)):
        assert done is None and row.lists is None  # such a list goes into the JSON
    else:
        assert done == row
    assert encode_trusted([event]) == [row]  # the recorder's way for the core's events


def _int_lists(event: Event) -> list[tuple[int, ...]]:
    hints = typing.get_type_hints(type(event))
    return [getattr(event, n) for n, h in hints.items() if h == tuple[int, ...]]


def _outside_int32(ids: tuple[int, ...]) -> bool:
    return any(not -(2**31) <= i < 2**31 for i in ids)


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
    assert payload_of(row)["mode"] == "push" and row.time == 1


def test_trusted_rows_skip_only_the_per_id_check() -> None:
    """`encode_trusted` writes the rows `encode_batch` writes; it does not look at each block
    id, but an id that is no integer still sends its event to the core, which refuses it,
    and every other field is checked as before."""
    good = BlocksReserved(at=1.0, instance="p", blocks=tuple(range(40)), purpose="prefill")
    assert encode_trusted([good, good]) == encode_batch([good, good])
    for bad in (dataclasses.replace(good, blocks=(*range(39), 2.5)),
                dataclasses.replace(good, blocks=(*range(39), "7")),
                dataclasses.replace(good, purpose="nope"),  # type: ignore[arg-type]
                dataclasses.replace(good, at=math.nan)):
        with pytest.raises(EventRefused, match=r"event #12 \(BlocksReserved\)"):
            encode_trusted([good, bad], first=11)


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
        assert payload_of(encode_event(event)) == encode(event)[1]
        assert typing.get_type_hints(type(event))  # annotations resolvable


def test_a_block_list_shared_by_events_is_written_alike_and_checked_each_time() -> None:
    blocks = tuple(range(1000, 1300))
    reserved = BlocksReserved(at=1.0, instance="p", request="r", blocks=blocks,
                              purpose="prefill")
    freed = BlocksFreed(at=2.0, instance="p", request="r", blocks=blocks, reason="sent")
    rows = encode_batch([reserved, freed, reserved])
    for row in rows:
        assert payload_of(row)["blocks"] == list(blocks)
        assert "blocks" not in json.loads(row.payload)  # packed apart, not in the JSON
    assert rows[0] == rows[2]
    assert len(rows[0].lists or b"") < 40  # consecutive ids: a few bytes, not 300 ids
    # a list with a bad id among equal ones is still refused, though its neighbours were seen
    with pytest.raises(EventRefused):
        encode_event(dataclasses.replace(reserved, blocks=(*blocks[:-1], 1.5)))
    with pytest.raises(EventRefused):
        encode_event(dataclasses.replace(reserved, blocks=(*blocks[:-1], True)))


_ids = st.integers(-(2**31), 2**31 - 1)
_near = st.builds(  # ascending near neighbours, as pools hand them out
    lambda first, steps: tuple(accumulate(steps, initial=first)),
    st.integers(-(2**31), 2**31 - 300_000), st.lists(st.integers(0, 300), max_size=300))
_runs = st.builds(  # runs of consecutive ids, in any order
    lambda start, parts: tuple(i for a, n in parts for i in range(start + a, start + a + n)),
    st.integers(-(2**31), 2**31 - 3000),
    st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 30)), max_size=8))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_ids, max_size=40).map(tuple) | _near | _runs, min_size=1, max_size=3))
def test_packed_lists_give_back_every_list_exactly(lists: list[tuple[int, ...]]) -> None:
    named = [(f"f{i}", ids) for i, ids in enumerate(lists)]
    packed = pack_lists(named)
    assert unpack_lists(packed) == {n: list(ids) for n, ids in named}
    # never longer than the ids themselves as int32s (plus a head per list and the names)
    assert len(packed) <= len(_prefix_of(named)) + sum(5 + 4 * len(ids) for ids in lists)


def _prefix_of(named: list[tuple[str, tuple[int, ...]]]) -> bytes:
    return b"\x01" + ",".join(n for n, _ in named).encode() + b":"


_pool_ids = st.builds(  # long lists of ids in [0, 2**31): steps of 1, -1, short and far
    lambda first, steps: tuple(accumulate(steps, initial=first)),
    st.integers(0, 2**20),
    st.lists(st.sampled_from([1, 1, 1, -1, -1, 0, 2, 255, 256, -255, 32767, -32768, 32768,
                              -40000, 100_000]), min_size=15, max_size=600),
).filter(lambda ids: min(ids) >= 0)


@settings(max_examples=400, deadline=None)
@given(st.one_of(_pool_ids, st.lists(st.integers(0, 2**31 - 1), min_size=16, max_size=80)
                 .map(tuple), st.builds(lambda a, n: tuple(range(a, a + n)),
                                        st.integers(0, 2**31 - 700), st.integers(16, 700))))
def test_long_lists_of_pool_ids_pack_as_the_general_way_does(ids: tuple[int, ...]) -> None:
    """The whole-list packing (big-integer lanes) makes exactly the bytes the id-by-id way
    makes, and they give the list back."""
    for each in (ids, (*ids[:-1], 2**31)):  # the second ends past int32: the general way
        piece = _pack_ints(each)
        assert piece == _pack_general(each)
        if piece is not None:
            assert unpack_lists(b"\x01blocks:" + piece) == {"blocks": list(each)}


def test_lists_as_pools_hand_them_out_are_small_and_keep_their_order() -> None:
    prefix = len(b"\x01blocks:")
    consecutive = tuple(range(7, 7 + 1024))
    assert len(pack_lists([("blocks", consecutive)])) - prefix < 40  # not 4 KB
    holes = tuple(i for i in range(3000) if i % 3)  # ascending, every third id taken
    assert len(pack_lists([("blocks", holes)])) - prefix < 100
    cached_then_new = (*range(90_000, 90_100), *range(10, 600))  # not ascending: two runs
    assert len(pack_lists([("blocks", cached_then_new)])) - prefix == 5 + 16
    for ids in (consecutive, holes, cached_then_new, (5, 4, 3, 9, 10, 11, 2), (), (3, 3)):
        assert unpack_lists(pack_lists([("blocks", ids)])) == {"blocks": list(ids)}
    with pytest.raises(OverflowError):
        pack_lists([("blocks", (1, 2**31))])


def _piece(kind: int, body: bytes) -> bytes:
    return struct.pack("<BI", kind, len(body)) + body


@pytest.mark.parametrize("damaged, why", [
    (b"", "unknown format"),
    (b"\x02blocks:" + _piece(0, b""), "unknown format"),
    (b"\x01blocks:\x01\x00", "end before 'blocks'"),
    (b"\x01blocks:" + _piece(1, bytes(8))[:-4], "'blocks' is cut short"),
    (b"\x01blocks:" + _piece(2, struct.pack("<ii", 5, 0)), "a run of length 0"),
    (b"\x01blocks:" + _piece(1, bytes(3)), "kind 1 with a body of 3 bytes"),
    (b"\x01blocks:" + _piece(9, bytes(4)), "kind 9"),
    (b"\x01blocks:" + _piece(0x81, b"not zlib"), "'blocks' is damaged"),
    (b"\x01blocks:" + _piece(0, b"") + b"\x00", "left over"),
    (b"\x01blocks,dst_blocks:" + _piece(0, b""), "end before 'dst_blocks'"),
])  # fmt: skip
def test_damaged_lists_are_named_not_misread(damaged: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        unpack_lists(damaged)


def test_an_id_outside_int32_takes_the_slow_way_into_the_json() -> None:
    event = BlocksReserved(at=1.0, instance="p", request="r", blocks=(1, 2**40),
                           purpose="prefill")
    row = encode_event(event)
    assert row.lists is None and json.loads(row.payload)["blocks"] == [1, 2**40]
    assert row.blocks == 2
