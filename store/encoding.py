"""Events to rows: the core's schema check, made cheap enough for the write path.

Rules kept here:
- The core is the authority: an event is stored only if `kvplane.core.events.encode` accepts
  it and its payload passes the same checks `kvplane.core.events.validate` makes. Whatever the
  core refuses comes back as `EventRefused`, with the core's own message.
- On top of the core's rules the store refuses what the two backends cannot hold alike:
  non-finite numbers (JSON has no NaN or infinity; SQLite turns a NaN time into NULL) and the
  NUL character (PostgreSQL text cannot hold it, nor its JSON operators unescape it).
- A row (`EncodedEvent`) holds the event's common fields as columns, its block count, the
  payload as JSON text and, since revision 0003, its block-id lists apart in `lists`
  (`pack_lists`): the payload JSON then lacks those fields. `lists` is None when the lists
  are in the JSON (an event that took the slow way, a store written before 0003), so a reader
  merges the two (`payload_of`, `merge_lists`) and gets the core's payload either way.

How it stays cheap: `validate` rebuilds the whole event through generic annotation walking,
about 50 us for a TransferPlanned with two 16-block lists. Here each event type gets an
encoder generated once from the same dataclass annotations: it tests every field of the event
with exact types only (`type(v) is int`), so that it accepts strictly less than the core does,
and builds the row in one expression (the payload's JSON in one f-string). When it says no, or
meets an annotation it does not know, the event goes the slow way: the core's `encode` and
`validate`, which either raise the real `SchemaError` or accept (a subclass of int, say), and
then the store's own two rules. So the fast path can only ever say "yes" where the core says
yes too; `tests/store` checks the two agree on random and broken events.

Block-id lists are most of a recording's bytes and work (a 16k-token prompt is a list of 1,024
ids, and the same list is in about six events of its request: reserved, registration sent
and arrived, prefill finished, transfer planned, freed). The core hands the same tuple object
from event to event, so each list is checked and packed once, then reused by identity (a small
cache that holds the tuple itself, so an id is never mistaken). Packed, an ascending list of
near neighbours (the common case) is its first id and a byte per id, the difference from the
one before (two bytes where it may be negative or over 255), made in one C-level pass and
folded by zlib when long; consecutive ids are one run; any other list is its runs or its ids
(`pack_lists` has the format). A 1,024-id list of consecutive ids is 13 bytes instead of
about 5 KB of JSON. A list that fits none of these (ids far outside int32) takes the slow
way: into the JSON. A long list of ids in [0, 2**31) (the pools' case) is packed without a
Python step per id: `struct` reads the ids once, and big-integer arithmetic finds the steps
and which kind fits (`_pack_lanes`), making the same bytes as the id-by-id way.

Since revision 0006 the simulator's lists reach the recorder with their runs
(`core.blocks.RunBlocks`: a tuple that also holds `(start, signed length)` pairs, cut from the
pools' arrays and joined by the core), and the trusted encoder packs those per run
(`_runs_piece`: kind 2, or kind 5 when a run descends) without reading a single id: a
1,024-block list in a few runs costs a few pairs, where reading its ids once cost about as
much as everything else recording does to the event.

The recorders of the core's own events (`BatchingRecorder(trusted=True)`) encode through
`encode_trusted`: the same rows, less the check that each block id is an exact int (a step per
id, as costly as the packing); every other field is checked all the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import struct
import sys
import types
import typing
import zlib
from array import array
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate, islice
from operator import sub
from typing import Any, Literal, NamedTuple, TypeVar, Union

from ._core import EVENT_TYPES, Event, RunBlocks, SchemaError, encode, validate
from .errors import EventRefused

_COMMON = ("at", "instance", "request")


class EncodedEvent(NamedTuple):
    """One event as a row of the `events` table, less `run` and `seq` (given on append);
    the fields in the order of the table's columns."""

    time: float
    type: str
    request: str | None
    instance: str
    blocks: int | None  # `block_count(event)`, stored beside the event
    payload: str  # JSON text of the core's payload, less the lists held in `lists`
    lists: bytes | None  # the event's block-id lists (`pack_lists`); None: all in `payload`


class FlatRows(list[Any]):
    """Rows one after another, their fields in one flat list (`WIDTH` values a row): how a
    trusted recorder batches them. A batch of rows as tuples keeps one more object alive per
    event, and with the queued events they doubled the garbage collector's passes over the
    simulator's heap while a recording ran; a flat list of plain values is one object."""

    @property
    def rows(self) -> int:
        return len(self) // WIDTH

    def as_rows(self) -> list[EncodedEvent]:
        return list(map(EncodedEvent._make, zip(*[iter(self)] * WIDTH, strict=True)))


WIDTH = len(EncodedEvent._fields)


_dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
_new_row = tuple.__new__


def encode_event(event: Event, index: int | None = None) -> EncodedEvent:
    """Check `event` and turn it into a row; `EventRefused` (naming `index`) if it is unfit."""
    fast = _BY_CLASS.get(type(event))
    if fast is None:
        fast = _by_class(type(event))
    try:
        row = fast(event)
    except Exception:  # noqa: BLE001 - an odd value (unhashable, say): the core judges it
        row = None
    return row if row is not None else _encode_slowly(event, index)


def _encode_slowly(event: Event, index: int | None) -> EncodedEvent:
    name = type(event).__name__
    try:
        name, payload = encode(event)
        validate(event)
    except SchemaError as exc:
        raise EventRefused(index, name, str(exc)) from None
    problem = _unstorable(event, payload)
    if problem is not None:
        raise EventRefused(index, name, problem)
    return EncodedEvent(event.at, name, event.request, event.instance, block_count(event),
                        _dumps(payload), None)


def encode_batch(events: Sequence[Event]) -> list[EncodedEvent]:
    """Every event of a batch as rows, or `EventRefused` for the first unfit one."""
    return [encode_event(event, index) for index, event in enumerate(events)]


def encode_trusted_one(event: Event) -> EncodedEvent:
    """`encode_trusted` of one event (its index is not named)."""
    fast = _TRUSTED_BY_CLASS.get(type(event)) or _by_class(type(event), trusted=True)
    try:
        row = fast(event)
    except Exception:  # noqa: BLE001 - an odd value (unhashable, say): the core judges it
        row = None
    return row if row is not None else _encode_slowly(event, None)


def encode_trusted(events: Sequence[Event], first: int = 0) -> list[EncodedEvent]:
    """`encode_batch` for events the core made (the simulator's and the live connectors'):
    the same rows, less the one check that costs a step per block id (that each id of a
    block list is an exact int: the core's lists are, and an id that is no integer at all
    still sends its event the slow, checked way). Every other field is checked as
    `encode_event` checks it; an unfit event is `EventRefused` naming its index (counted
    from `first`)."""
    table = _TRUSTED_BY_CLASS
    with contextlib.suppress(Exception):  # a class not seen yet, an odd value: one by one
        # the common case in one comprehension: every class known, every row made
        rows: list[EncodedEvent | None] = [table[type(event)](event) for event in events]
        if None not in rows:
            return typing.cast(list[EncodedEvent], rows)
    out = []
    for index, event in enumerate(events):
        fast = table.get(type(event)) or _by_class(type(event), trusted=True)
        try:
            row = fast(event)
        except Exception:  # noqa: BLE001 - an odd value (unhashable, say): the core judges it
            row = None
        out.append(row if row is not None else _encode_slowly(event, first + index))
    return out


def block_count(event: Event) -> int | None:
    """How many KV blocks `event` names, None for an event about no blocks: its `blocks`,
    else `dst_blocks` (a transfer's or registration's destination), else `src_blocks`.

    Stored beside the event (`events.blocks`), so readers count blocks in SQL without parsing
    payloads. The one place that knows how an event holds its blocks."""
    field = _block_field(type(event))
    return None if field is None else len(getattr(event, field))


def _block_field(cls: type) -> str | None:
    field = _BLOCK_FIELD.get(cls, _UNKNOWN)
    if field is _UNKNOWN:
        names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else ()
        field = next((n for n in _BLOCK_FIELDS if n in names), None)
        _BLOCK_FIELD[cls] = field
    return field


_BLOCK_FIELDS = ("blocks", "dst_blocks", "src_blocks")
_UNKNOWN = "?"
_BLOCK_FIELD: dict[type, str | None] = {}


# --- the payload as readers see it ---------------------------------------------------------


def payload_of(row: EncodedEvent) -> dict[str, Any]:
    """The core's payload of a row (`encode(event)[1]`): its JSON with its lists put back."""
    payload: dict[str, Any] = json.loads(row.payload)
    return payload if row.lists is None else merge_lists(payload, row.lists)


def merge_lists(payload: dict[str, Any], lists: bytes) -> dict[str, Any]:
    """`payload` (a stored payload's parsed JSON) with the block-id lists of `lists` added;
    `ValueError` if `lists` is damaged or names a field the JSON holds too."""
    for name, ids in unpack_lists(lists).items():
        if name in payload:
            raise ValueError(f"field {name!r} is stored twice (in the payload and its lists)")
        payload[name] = ids
    return payload


# --- block-id lists, packed ----------------------------------------------------------------
#
# A packed `lists` value: the byte 0x01 (the format), the field names joined by ",", ":",
# then one piece per field in that order. A piece is a kind byte, the length of its body
# (uint32) and the body; kind 0x80 set: the body is zlib-compressed (level 1), the kind is
# then that of the body inflated. Bodies, all little-endian:
#   kind 0: the empty list (no body);
#   kind 1: the ids as int32;
#   kind 2: runs of consecutive ids, (start, length) int32 pairs, in the list's order;
#   kind 3: the first id as int32, then the difference of each id from the one before as a
#           byte (0-255): an ascending list of near neighbours, the common case;
#   kind 4: the same with the differences as int16: near neighbours in any order;
#   kind 5 (since kvplane's store revision 0006): runs of ids one apart, ascending or
#           descending, as (start, signed length) int32 pairs: a negative length counts down
#           from its start (a decode pool's LIFO lists). Written for a list that came with its
#           runs (`core.blocks.RunBlocks`, the simulator's) when one of them descends; such a
#           list with ascending runs only is kind 2.
# The kinds are tried in the order 3, 4, 2, 1, one C-level pass making the deltas; consecutive
# ids become one run (a 1,024-id list is 13 bytes, not about 5 KB of JSON), and zlib folds the
# repeats of a long list of deltas (a fragmented decode pool's 1,024 ids: about 500 bytes).

_FORMAT = b"\x01"
_BIG_ENDIAN = sys.byteorder == "big"
_HEAD = struct.Struct("<BI")
_FIRST = struct.Struct("<i")
_ONE = struct.Struct("<BIi")  # a piece of kind 3 holding one id
_ZIP = 0x80
_ZIP_OVER = 512  # longer bodies are offered to zlib (its set-up costs more than it saves below)
assert array("i").itemsize == 4, "int32 arrays are what the packed format holds"


def pack_lists(lists: Iterable[tuple[str, Sequence[int]]]) -> bytes:
    """Named lists of ints (each within int32) as one `lists` value; `OverflowError` if an
    id does not fit. What the generated encoders write, piece by piece."""
    names, pieces = [], []
    for name, ids in lists:
        piece = _pack_ints(tuple(ids))
        if piece is None:
            raise OverflowError(f"{name}: an id outside int32")
        names.append(name)
        pieces.append(piece)
    return _prefix(names) + b"".join(pieces)


def unpack_lists(data: bytes) -> dict[str, list[int]]:
    """The named lists of a `lists` value; `ValueError` saying how it is damaged."""
    data = bytes(data)  # PostgreSQL hands back a memoryview
    colon = data.find(b":")
    if data[:1] != _FORMAT or colon < 0:
        raise ValueError("its block lists are in an unknown format")
    out: dict[str, list[int]] = {}
    pos, end = colon + 1, len(data)
    for name in data[1:colon].decode("ascii", "replace").split(","):
        if pos + _HEAD.size > end:
            raise ValueError(f"its block lists end before {name!r}")
        kind, size = _HEAD.unpack_from(data, pos)
        pos += _HEAD.size + size
        if pos > end:
            raise ValueError(f"its block list {name!r} is cut short")
        body = data[pos - size:pos]
        try:
            if kind & _ZIP:
                kind, body = kind & ~_ZIP, zlib.decompress(body)
            out[name] = _unpack_body(kind, body)
        except (ValueError, zlib.error) as exc:
            raise ValueError(f"its block list {name!r} is damaged ({exc})") from None
    if pos != end:
        raise ValueError("its block lists have bytes left over")
    return out


def without_descending_runs(data: bytes) -> bytes | None:
    """`data` (a `lists` value) written without kind 5, the form a store before revision 0006
    holds; None when it has no piece of kind 5 (nothing to rewrite). `ValueError` if damaged.
    """
    data = bytes(data)
    if not any(kind == 5 for kind in _kinds(data)):
        return None
    return pack_lists(unpack_lists(data).items())


def _kinds(data: bytes) -> list[int]:
    """The kind of each piece of a `lists` value (a zlib-folded piece by its inner kind)."""
    colon = data.find(b":")
    if data[:1] != _FORMAT or colon < 0:
        raise ValueError("its block lists are in an unknown format")
    kinds, pos = [], colon + 1
    while pos + _HEAD.size <= len(data):
        kind, size = _HEAD.unpack_from(data, pos)
        kinds.append(kind & ~_ZIP)
        pos += _HEAD.size + size
    return kinds


def _unpack_body(kind: int, body: bytes) -> list[int]:
    if kind == 0 and not body:
        return []
    if kind == 3 and len(body) >= 4:
        return list(accumulate(body[4:], initial=_FIRST.unpack_from(body)[0]))
    if kind == 4 and len(body) >= 4 and len(body) % 2 == 0:
        steps = array("h")
        steps.frombytes(body[4:])
        if _BIG_ENDIAN:
            steps.byteswap()
        return list(accumulate(steps, initial=_FIRST.unpack_from(body)[0]))
    if kind == 5 and len(body) % 8 == 0:
        values = array("i")
        values.frombytes(body)
        if _BIG_ENDIAN:
            values.byteswap()
        out: list[int] = []
        for start, length in zip(values[::2], values[1::2], strict=True):
            if length == 0:
                raise ValueError("a run of length 0")
            out.extend(range(start, start + length, 1) if length > 0
                       else range(start, start + length, -1))
        return out
    if kind in (1, 2) and len(body) % 4 == 0:
        values = array("i")
        values.frombytes(body)
        if _BIG_ENDIAN:
            values.byteswap()
        if kind == 1:
            return values.tolist()
        if len(values) % 2 == 0:
            ids: list[int] = []
            for start, length in zip(values[::2], values[1::2], strict=True):
                if length < 1:
                    raise ValueError(f"a run of length {length}")
                ids.extend(range(start, start + length))
            return ids
    raise ValueError(f"kind {kind} with a body of {len(body)} bytes")


def _prefix(names: Sequence[str]) -> bytes:
    return _FORMAT + ",".join(names).encode("ascii") + b":"


def _pack_ints(ids: Sequence[int]) -> bytes | None:
    """One list's piece; None if an id is outside int32. Long lists of ids in [0, 2**31), the
    pools' case, are packed by whole-list C operations (`_pack_lanes`), others here."""
    if len(ids) >= _LANES_FROM:
        try:
            ids32 = _uint32s(len(ids)).pack(*ids)
        except struct.error:  # a negative id or one past uint32: the general way below
            pass
        else:
            if ids32[3::4].isascii():  # every id under 2**31 (int32 and uint32 agree)
                return _pack_lanes(ids, ids32)
    return _pack_general(tuple(ids))


def _pack_general(ids: tuple[int, ...]) -> bytes | None:
    if len(ids) < 2:
        if not ids:
            return _HEAD.pack(0, 0)
        try:  # one id (a decode step's new block, say): its first id and no steps
            return _ONE.pack(3, 4, ids[0])
        except struct.error:
            return None
    try:  # near neighbours: the deltas as bytes (ascending) or int16s, made in C
        first = _FIRST.pack(ids[0])
        try:
            deltas = bytes(map(sub, islice(ids, 1, None), ids))
            if len(deltas) > 4 and deltas.count(1) == len(deltas):  # consecutive: one run
                return _HEAD.pack(2, 8) + _int32s((ids[0], len(ids)))
            body, kind = first + deltas, 3
        except ValueError:
            steps = array("h", map(sub, islice(ids, 1, None), ids))
            if _BIG_ENDIAN:
                steps.byteswap()
            body, kind = first + steps.tobytes(), 4
    except (OverflowError, struct.error):
        runs = _runs(ids)
        try:
            if len(runs) < len(ids):
                body, kind = _int32s(runs), 2
            else:
                body, kind = _int32s(ids), 1
        except OverflowError:
            return None
    return _piece(kind, body)


def _piece(kind: int, body: bytes) -> bytes:
    if len(body) > _ZIP_OVER:
        # level 1 with a 4 KB window and small hash tables: zlib's set-up (clearing tables
        # sized for 32 KB windows) otherwise costs more than compressing a 2 KB body
        squeeze = zlib.compressobj(1, zlib.DEFLATED, 12, 3)
        folded = squeeze.compress(body) + squeeze.flush()
        if len(folded) < len(body):
            body, kind = folded, kind | _ZIP
    return _HEAD.pack(kind, len(body)) + body


# Packing a long list without a Python step per id. The ids, all in [0, 2**31), are packed as
# uint32s by `struct` (one C pass: the only one that reads each id); read as two big integers,
# the list less its first id and the list less its last, their difference plus 2**31 in every
# 32-bit lane is one integer whose lanes are `2**31 + (ids[i + 1] - ids[i])`: each within
# (0, 2**32), so no lane borrows from or carries into its neighbour. Big-integer masks then
# tell in C which kind fits (every step 1; every step in 0..255; every step in int16), and
# byte slicing takes each lane's low byte or two: the same bodies `_pack_general` makes.
_LANES_FROM = 16  # shorter lists cost less the general way
_LANE_CONSTANTS = 64  # lengths whose constants are kept (a run sees a handful)


@functools.lru_cache(maxsize=_LANE_CONSTANTS)
def _lanes(count: int) -> tuple[int, int, int, int, int, int]:
    """For `count` lanes: every lane's bits, the bias (0x80000000 each), the lanes of all
    steps 1, the mask of bits above a byte, half int16's range (0x8000), the mask above 16
    bits."""
    def each(lane: int) -> int:
        return int.from_bytes(lane.to_bytes(4, "little") * count, "little")
    return (each(0xFFFF_FFFF), each(0x8000_0000), each(0x8000_0001), each(0xFFFF_FF00),
            each(0x8000), each(0xFFFF_0000))


@functools.lru_cache(maxsize=_LANE_CONSTANTS)
def _uint32s(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}I")


def _pack_lanes(ids: Sequence[int], ids32: bytes) -> bytes:
    """The piece of `ids` (at least 2, each in [0, 2**31)), given them as uint32s."""
    n = len(ids) - 1  # steps
    every, bias, ones, above_byte, half, above_int16 = _lanes(n)
    whole = int.from_bytes(ids32, "little")
    steps = (whole >> 32) - (whole & every) + bias  # lane i: 2**31 + ids[i + 1] - ids[i]
    if steps == ones:  # consecutive: one run
        return _HEAD.pack(2, 8) + ids32[:4] + _FIRST.pack(n + 1)
    if steps & above_byte == bias:  # every step in 0..255: its low byte
        return _piece(3, ids32[:4] + steps.to_bytes(4 * n, "little")[0::4])
    if (steps + half) & above_int16 == bias:  # every step in int16: its low two bytes
        lanes = steps.to_bytes(4 * n, "little")
        low = bytearray(2 * n)
        low[0::2] = lanes[0::4]
        low[1::2] = lanes[1::4]
        return _piece(4, ids32[:4] + low)
    # far jumps: runs of consecutive ids where there are few, else the ids themselves.
    # A byte per lane, 1 where the step is not 1 (a break between two runs): the lane's four
    # bytes folded into its low byte, taken, and made 0 or 1.
    other = steps ^ ones
    other |= other >> 16
    other |= other >> 8
    flags = other.to_bytes(4 * n, "little")[0::4].translate(_ONE_IF_NOT_ZERO)
    if 2 * flags.count(1) >= n - 1:  # as many runs as half the ids: the ids themselves
        return _piece(1, ids32)
    runs: list[int] = []
    start = 0
    for steps_of_one in map(len, flags.split(b"\x01")):  # one run per stretch of 1-steps
        runs += (ids[start], steps_of_one + 1)
        start += steps_of_one + 1
    return _piece(2, _int32s(runs))


_ONE_IF_NOT_ZERO = bytes([0] + [1] * 255)


def _runs(ids: tuple[int, ...]) -> list[int]:
    """The (start, length) runs of consecutive ids, flat; stops early once they would be
    longer than the ids themselves."""
    n = len(ids)
    data: list[int] = []
    add = data.append
    start = prev = ids[0]
    for v in islice(ids, 1, None):
        if v != prev + 1:
            add(start)
            add(prev - start + 1)
            if len(data) >= n:
                return data
            start = v
        prev = v
    add(start)
    add(prev - start + 1)
    return data


def _int32s(values: Sequence[int]) -> bytes:
    packed = array("i", values)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


_LIST_CACHE_SIZE = 512  # lists of the requests in flight (see `_remember`)
_INTS_PIECE: dict[int, tuple[tuple[Any, ...], bytes]] = {}  # id(tuple) -> (tuple, piece)
_TRUSTED_PIECE: dict[int, tuple[tuple[Any, ...], bytes]] = {}  # the same, never checked
_STRS_JSON: dict[int, tuple[tuple[Any, ...], str]] = {}


def _ints_piece(value: Any) -> bytes | None:
    """The packed piece of a tuple of exact ints within int32, or None if `value` is not one."""
    hit = _INTS_PIECE.get(id(value))
    if hit is not None and hit[0] is value:
        return hit[1]
    if type(value) not in _TUPLES or not set(map(type, value)) <= _INT_SET:
        return None  # (a `RunBlocks` is checked and packed by its ids: its runs are unchecked)
    piece = _pack_ints(value)
    return None if piece is None else _remember(_INTS_PIECE, value, piece)


def _trusted_piece(value: Any) -> bytes | None:
    """`_ints_piece` for the core's own events: the ids are not checked one by one (an id
    that is not an int makes the packing raise, and the event then goes the slow way). Kept
    apart from `_ints_piece`'s cache, whose tuples are known to hold exact ints only."""
    hit = _TRUSTED_PIECE.get(id(value))
    if hit is not None and hit[0] is value:
        return hit[1]
    if type(value) is not tuple:
        return _runs_piece(value) if type(value) is RunBlocks else None
    if len(value) == 1:  # a decode step's new block: packed in one call, not kept
        try:
            return _ONE.pack(3, 4, value[0])
        except struct.error:
            return None
    piece = _pack_ints(value)
    return None if piece is None else _remember(_TRUSTED_PIECE, value, piece)


def _runs_piece(value: RunBlocks) -> bytes | None:
    """The piece of a list that came with its runs (trusted: the maker vouches for them), made
    per run: kind 2 when every run ascends (the bytes `_pack_ints` makes for one run), kind 5
    when one descends. A list of many short runs (more bytes than a byte per id) is packed by
    its ids as any other."""
    runs = value.runs
    if not runs:
        return _HEAD.pack(0, 0)
    if 4 * len(runs) > len(value) + 4:
        piece = _pack_ints(value)
        return None if piece is None else _remember(_TRUSTED_PIECE, value, piece)
    try:
        body = _int32s(runs)
    except (OverflowError, TypeError):  # an id outside int32, or not an int: the core judges
        return None
    return _HEAD.pack(2 if min(runs[1::2]) > 0 else 5, len(body)) + body


def _strs_json(value: Any) -> str | None:
    """The JSON array of a tuple of exact strs without NUL, or None if `value` is not one."""
    hit = _STRS_JSON.get(id(value))
    if hit is not None and hit[0] is value:
        return hit[1]
    if (type(value) is not tuple or not set(map(type, value)) <= _STR_SET
            or "\x00" in "".join(value)):
        return None
    return _remember(_STRS_JSON, value, _dumps(list(value)))


_Packed = TypeVar("_Packed", str, bytes)


def _remember(cache: dict[int, tuple[tuple[Any, ...], _Packed]], value: tuple[Any, ...],
              packed: _Packed) -> _Packed:
    # Small on purpose: every list held here is alive when the garbage collector runs, and
    # it walks each 1,024-id tuple id by id once. At 2,048 lists that cost more than packing
    # again the lists a smaller cache forgets (push point: 0.05 s of collection against 0.02,
    # for 600 more packings at 512).
    if len(cache) >= _LIST_CACHE_SIZE:
        # the older half at once: a dict emptied one key at a time from its front is walked
        # over its emptied slots by every `next(iter(...))`
        try:  # another recording thread may evict at the same moment: either one will do
            for key in list(islice(cache, _LIST_CACHE_SIZE // 2 or 1)):
                cache.pop(key, None)
        except RuntimeError:
            pass
    cache[id(value)] = (value, packed)  # holding the tuple keeps its id from being reused
    return packed


_INT_SET = {int}
_TUPLES = (tuple, RunBlocks)
_STR_SET = {str}


# --- compiled encoders ---------------------------------------------------------------------

FastEncoder = Callable[[Event], "EncodedEvent | None"]

_ENCODERS: dict[tuple[str, bool], FastEncoder | None] = {}


_BY_CLASS: dict[type, FastEncoder] = {}
_TRUSTED_BY_CLASS: dict[type, FastEncoder] = {}


def _slow(event: Event) -> None:
    return None


def _by_class(cls: type, trusted: bool = False) -> FastEncoder:
    """The fast encoder of an event class, `_slow` for anything else."""
    name = cls.__name__
    fast = _encoder(name, trusted) if EVENT_TYPES.get(name) is cls else None
    table = _TRUSTED_BY_CLASS if trusted else _BY_CLASS
    table[cls] = fast or _slow
    return table[cls]


def _encoder(name: str, trusted: bool = False) -> FastEncoder | None:
    if (name, trusted) not in _ENCODERS:
        _ENCODERS[name, trusted] = _compile_event(EVENT_TYPES[name], trusted)
    return _ENCODERS[name, trusted]


def _compile_event(cls: type[Event], trusted: bool = False) -> FastEncoder | None:
    """One function per event type: a straight line of field tests on the event itself, then
    its row (the payload `encode` makes, as JSON text, less the int lists, which are packed);
    None for "ask the core". `trusted`: the ids of int lists are not checked one by one
    (`_trusted_piece`), every other field is.

    Generated rather than a loop over per-field closures because it runs for every event
    recorded, and inlining the tests halves its cost (the way `dataclasses` writes `__init__`).
    """
    hints = typing.get_type_hints(cls)
    payload_fields = [f.name for f in dataclasses.fields(cls) if f.name not in _COMMON]
    constants: dict[str, Any] = {"_isfinite": math.isfinite,
                                 "_ints_piece": _trusted_piece if trusted else _ints_piece,
                                 "_strs_json": _strs_json, "_dumps": _dumps,
                                 "_jstr": _json_str, "_new": _new_row, "_Row": EncodedEvent}
    lines = ["def encode(event):"]
    variables: dict[str, str] = {}
    scalars, strs, ints = [], [], []
    for index, (name, hint) in enumerate(hints.items()):
        var = variables[name] = f"v{index}"
        lines.append(f"    {var} = event.{name}")
        if hint == tuple[int, ...]:  # checked and packed once per tuple
            lines.append(f"    p{index} = _ints_piece({var})")
            lines.append(f"    if p{index} is None:")
            lines.append("        return None")
            ints.append((name, f"p{index}"))
            continue
        if hint == tuple[str, ...]:  # checked and turned into JSON once per tuple
            lines.append(f"    t{index} = _strs_json({var})")
            lines.append(f"    if t{index} is None:")
            lines.append("        return None")
            strs.append((name, f"t{index}"))
            continue
        expr = _expr(hint, var, constants)
        if expr is None or typing.get_origin(hint) is tuple:
            return None
        lines.append(f"    if not {expr}:")
        lines.append("        return None")
        if name in payload_fields:
            scalars.append((name, var))
    if {n for n, _ in scalars + strs + ints} != set(payload_fields):
        return None
    # the JSON text as one expression: each value's JSON by its (already checked) type
    texts = dict(strs) | {n: _json_expr(hints[n], v) for n, v in scalars}
    body = ",".join(f'"{n}":{{{texts[n]}}}' for n in payload_fields if n in texts)
    if ints:
        constants["_P"] = _prefix([n for n, _ in ints])
        lists = " + ".join(["_P", *(p for _, p in ints)])
    else:
        lists = "None"
    field = _block_field(cls)
    count = f"len({variables[field]})" if field is not None else "None"
    lines.append(f"    return _new(_Row, ({variables['at']}, {cls.__name__!r}, "
                 f"{variables['request']}, {variables['instance']}, {count}, "
                 f"f'''{{{{{body}}}}}''', {lists}))")
    source = "\n".join(lines) + "\n"
    namespace: dict[str, Any] = dict(constants)
    where = f"<kvplane.store encode {cls.__name__}{' trusted' if trusted else ''}>"
    exec(compile(source, where, "exec"), namespace)  # noqa: S102
    fast = namespace["encode"]
    fast.__name__ = cls.__name__
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
