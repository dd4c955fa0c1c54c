"""The SimPy driver: prefill and decode engine loops, the router and the links, all deciding
through `kvplane.core`.

Rules kept here:
- Every protocol decision is made by a core machine (`PrefillCore`, `DecodeCore`,
  `SessionTable`, `decide_reuse`, `routing.choose_ranked`), called with `now = env.now`; the simulator
  only moves time, hands out block ids and carries messages. The per-request rules the live
  connector and router follow are the simulator's too (`core.connector_rules`: what decode
  loads, which blocks a reuse read fills, retain and its TTL, the attempt a recompute is;
  `core.router_rules`: whether the router asks to retain, what it does with a taken handle when
  a turn ends). Every event the core returns, and
  every observation (arrival, first token, finish, engine stall), goes to the recorder.
- Costs come from a `Costs` object built from profiles; nothing here knows a GPU or a model.
- Pull mode prepares descriptors inside decode's engine loop (unless `pull_reader_thread`): the
  preparation is a stall added to decode's next step, delaying every running request. Push
  mode prepares them on prefill's background transfer thread, which never delays model steps.
- Decode runs in macro-steps: while its batch does not change it advances many steps in one
  SimPy timeout; a request joining or a stall arriving wakes it, and the batch changes at the
  next step boundary. The cost is per request, not per token, so runs are far faster than
  real time. A macro-step ends before a step whose output blocks the pool cannot give; that
  step starts with vLLM's preemption (`DecodeInstance.make_room`). A prompt decode computes
  itself (a failed load, a preempted request) runs one step at a time, in chunks mixed with
  the decodes under `max_num_batched_tokens`.
- Timers (lease expiry, KV waits, heartbeats) are plain SimPy timeout callbacks, not
  processes, and each one re-checks the core's state when it fires.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import simpy

from kvplane.core import connector_rules as rules
from kvplane.core import decode as D
from kvplane.core import prefill as P
from kvplane.core import router_rules
from kvplane.core import sessions as S
from kvplane.core.blocks import RunBlocks, join
from kvplane.core.events import (
    BlocksFreed,
    EngineStalled,
    Event,
    FirstTokenEmitted,
    KVLoadFailed,
    KVReceived,
    LeaseExpired,
    LeaseGranted,
    LeasePinned,
    LeaseReleased,
    LeaseRenewed,
    MetadataRelayed,
    PrefillStarted,
    RegistrationDropped,
    RegistrationSent,
    RequestArrived,
    RequestFinished,
    RequestPreempted,
    RequestRouted,
    ReuseDecided,
    SessionDropped,
    SessionTaken,
    TransferPlanned,
)
from kvplane.core.lease import BeginRead, EndRead, Heartbeat, Release
from kvplane.core.lease import Tick as LeaseTick
from kvplane.core.plan import KVLayout, fan_out
from kvplane.core.reuse import RetainedHandle
from kvplane.core.routing import Load, Policy, choose_ranked, choose_scanning

from .host_state import HostTimeline, state_bin

Record = Callable[[Event], None]


def ignore(event: Event) -> None:
    """The recorder of a run that records nothing: the simulator skips making the events
    only a recorder reads (the core's events are made either way: they carry its decisions)."""



class PoolTooSmall(ValueError):
    """A request longer than a decode instance's whole KV pool: vLLM would refuse it (its
    length is over what the cache holds); a scenario whose workload makes one is wrong."""

class Costs(Protocol):
    """What the engine needs to know about time. Built from model and hardware profiles."""

    def prefill_time(self, new_tokens: int, cached_tokens: int) -> float: ...
    def prefill_batch_time(self, chunks: list[tuple[int, int]]) -> float: ...
    def decode_step_time(self, batch: int, context_tokens: int) -> float: ...
    def decode_step_times(self, batch: int, context_tokens: int, steps: int) -> list[float]: ...
    def mixed_step_time(self, chunks: list[tuple[int, int]], contexts: list[int]) -> float: ...
    def descriptor_prep_time(self, descriptors: int, inline: bool) -> float: ...
    def transfer_time(self, nbytes: int, descriptors: int, streams: int) -> float: ...
    def handshake_time(self) -> float: ...
    def message_latency(self) -> float: ...
    def request_overhead(self) -> float: ...
    def reuse_read_setup(self) -> float: ...
    def request_leg(self) -> float: ...
    def response_leg(self) -> float: ...
    def transfer_setup(self) -> float: ...
    def host_slowdown_quantiles(self) -> dict[str, tuple[float, ...]]: ...
    def host_hop_correlation(self) -> float: ...
    def host_state_bins(self) -> tuple[float, tuple[float, ...],
                                        dict[str, tuple[tuple[float, ...], ...]]] | None: ...
    def empty_step_time(self) -> float: ...


@dataclass(frozen=True)
class EngineConfig:
    mode: Literal["push", "pull"] = "push"
    bidirectional: bool = False
    num_prefill: int = 1
    num_decode: int = 1
    prefill_layout: KVLayout = KVLayout(16, 8, 64, 8, 256)  # noqa: RUF009 (frozen, immutable)
    decode_layout: KVLayout = KVLayout(16, 8, 64, 8, 256)  # noqa: RUF009
    prefill_blocks: int = 100_000
    decode_blocks: int = 100_000
    pool_run_blocks: float | None = None
    block_reuse: str = "lifo"
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 8192
    decode_policy: Policy = Policy("least_loaded")  # noqa: RUF009
    prefill_policy: Policy = Policy("least_loaded")  # noqa: RUF009
    prefill_prefix_caching: bool = False
    decode_prefix_caching: bool = False
    ttl: float = 480.0
    renewable: bool = False
    heartbeat_interval: float = 5.0
    heartbeat_extension: float = 20.0
    idle_after: float = 60.0
    recompute_threshold: int = 64
    read_margin: float = rules.READ_MARGIN  # the live connector's margin
    hold_ttl: float = 30.0
    hold_heartbeat: float = 5.0
    hold_extension: float = 20.0
    kv_timeout: float = 480.0
    handshake_at_start: bool = True
    pull_reader_thread: bool = False
    reuse_read_run_blocks: float | None = None
    seed: int = 0


@dataclass(slots=True)
class SimRequest:
    id: str
    arrival: float
    prompt: int
    output: int
    conversation: str | None = None
    tenant: str = "default"
    turn: int = 0
    hashes: np.ndarray | None = None  # one uint64 per full prompt block (prefix identity)
    retained_hashes: np.ndarray | None = None  # prompt + output: what decode keeps for reuse
    on_done: Callable[[SimRequest], None] | None = None
    prefill: str = ""
    decode: str = ""
    dispatched: float = -1.0
    prefill_received: float = -1.0
    prefill_start: float = -1.0
    prefill_end: float = -1.0
    prefill_answered: float = -1.0  # the router has prefill's answer (pull: before the relay)
    compute_s: float = 0.0
    reuse_read_s: float = 0.0
    reuse_outcome: str = ""
    runs: int = 0
    read_runs: int = 0  # runs of the D->P reuse read, when there is one
    read_blocks: int = 0
    transfer_start: float = -1.0
    transfer_end: float = -1.0
    kv_ready: float = -1.0
    first_token: float = -1.0
    finish: float = -1.0
    done_tokens: int = 0
    stall_s: float = 0.0
    cached: int = 0
    ok: bool = True
    taken: RetainedHandle | None = None  # the conversation's handle this turn took
    attempt: int = 0  # decode's attempt: a failed load's local compute is the next one
    preemptions: int = 0  # times an instance preempted it (vLLM's num_preemptions)
    last_token: float = -1.0  # when decode's last step for it ended
    itl: list[tuple[float, int]] = field(default_factory=list)
    rank: int = -1  # its place in its workload's arrival order (a streaming summary's warm-up)
    host_z: float = math.nan  # its hops' shared factor of the host's slowdown, once drawn


@dataclass(slots=True)
class LocalPrefill:
    """A prompt decode computes itself, in chunks: a failed load's, or a preempted request's
    prompt and output so far."""

    r: SimRequest
    left: int  # tokens still to compute
    done: int  # tokens in the cache so far
    why: str


@functools.lru_cache(maxsize=64)
def _fan_out(src: KVLayout, dst: KVLayout) -> tuple[Any, ...]:
    """The core's rank fan-out, a function of the two layouts only: computed once per pair."""
    return tuple(fan_out(src, dst))


@functools.lru_cache(maxsize=64)
def _streams(src: KVLayout, dst: KVLayout) -> tuple[tuple[int, int], ...]:
    """The (src_rank, dst_rank) pairs of the fan-out's streams, in its order."""
    return tuple((s.src_rank, s.dst_rank) for s in _fan_out(src, dst))


def hex_chain(hashes: np.ndarray | None) -> tuple[str, ...]:
    """The core's block-hash chain (strings) from the workload's per-block uint64 hashes."""
    if hashes is None:
        return ()
    return tuple(format(h, "016x") for h in hashes.tolist())


class HashIndex:
    """A prefix cache's map, block hash -> block, as an open-addressing table on numpy arrays.

    Linear probing from a Fibonacci hash of the key; a removed entry leaves a tombstone (so
    that the probes of other keys still pass it), and the table is rebuilt from its live
    entries when live and removed entries fill half of it. It has at least four slots per
    block of the pool (a block has at most one hash), so probe runs stay short: a batch of
    lookups takes as many rounds as its longest run. A request's lookups, insertions and
    removals are a few array operations each, not one dict operation per block; 12 bytes a
    slot, less than the dict of int objects it replaces.
    """

    _MIX = np.uint64(0x9E3779B97F4A7C15)
    _EMPTY, _GONE = -1, -2  # `vals` of a free slot and of a removed entry
    _WINDOW = 8  # slots a lookup that missed its home slot reads per round

    def __init__(self, n: int, by_value: bool = False) -> None:
        self.bits = max(int(4 * max(n, 1) - 1).bit_length(), 4)
        size = 1 << self.bits
        self.keys = np.zeros(size, dtype=np.uint64)
        self.vals = np.full(size, self._EMPTY, dtype=np.int32)
        self.live = 0
        self.removed = 0
        self.shift = np.uint64(64 - self.bits)
        # `by_value` (values in [0, n), each held by one key at most: a pool's blocks): the
        # slot of each value's entry, so that `remove_values` needs no probing
        self.slot_of = np.full(max(n, 1), -1, dtype=np.int32) if by_value else None

    def __len__(self) -> int:
        return self.live

    def _slots(self, hs: np.ndarray) -> np.ndarray:
        return ((hs * self._MIX) >> self.shift).astype(np.int64)

    def _find(self, hs: np.ndarray) -> np.ndarray:
        """The slot of each key, -1 where it is absent."""
        idx = self._slots(hs)
        keys, vals = self.keys, self.vals
        v = vals[idx]
        hit = (keys[idx] == hs) & (v >= 0)
        settled = hit | (v == self._EMPTY)
        # the usual case: every key settled at its home slot (found there, or the slot empty)
        if settled.all():
            return np.where(hit, idx, -1)
        # the rest scan the next `_WINDOW` slots of their probe run at once, round after
        # round: a key stops at its own live slot (found) or at an empty one (absent)
        out = np.where(hit, idx, -1)
        todo = np.flatnonzero(~settled)
        mask = len(keys) - 1
        if len(todo) <= 4:  # a few: walked one slot at a time, cheaper than array rounds
            for t in todo.tolist():
                pos, want1 = (int(idx[t]) + 1) & mask, hs[t]
                while (v1 := vals[pos]) != self._EMPTY:
                    if v1 >= 0 and keys[pos] == want1:
                        out[t] = pos
                        break
                    pos = (pos + 1) & mask
            return out
        pos, want = (idx[todo] + 1) & mask, hs[todo]
        ahead = np.arange(self._WINDOW)
        while len(todo):
            win = (pos[:, None] + ahead) & mask
            v = vals[win]
            hit = (keys[win] == want[:, None]) & (v >= 0)
            stop = hit | (v == self._EMPTY)
            rows, first = np.arange(len(todo)), stop.argmax(axis=1)
            found = hit[rows, first]
            out[todo[found]] = win[rows, first][found]
            go = ~stop[rows, first]
            todo, pos, want = todo[go], (pos[go] + self._WINDOW) & mask, want[go]
        return out

    def get_one(self, h: int) -> int:
        """The block of one key, -1 where it is absent: its probe run walked slot by slot in
        Python (a batch's array operations cost more than the one or two slots a key reads
        at this load)."""
        keys, vals, mask = self.keys, self.vals, len(self.keys) - 1
        pos = ((h * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) >> (64 - self.bits)
        while True:
            v = int(vals[pos])
            if v == self._EMPTY:
                return -1
            if v >= 0 and int(keys[pos]) == h:
                return v
            pos = (pos + 1) & mask

    def get(self, hs: np.ndarray) -> np.ndarray:
        """The block of each key, -1 where it is absent."""
        slots = self._find(hs)
        return np.where(slots >= 0, self.vals[slots], -1)

    def add(self, hs: np.ndarray, blocks: np.ndarray) -> None:
        """Insert keys that are absent, each once."""
        size = len(self.keys)
        if 4 * (self.live + len(hs)) > size:
            raise ValueError(f"{self.live + len(hs)} keys: more than the table is made for")
        if 2 * (self.live + self.removed + len(hs)) > size:
            self._rebuild()
        todo = np.arange(len(hs))
        pos = self._slots(hs)
        keys, vals, mask = self.keys, self.vals, size - 1
        v = vals[pos]
        if len(hs) and (v < 0).all():
            # the usual case, the first round below with every key at its home slot (free,
            # and its own: each key's number reads back), on the slots alone
            vals[pos] = todo
            if (vals[pos] == todo).all():
                self.removed -= int(np.count_nonzero(v == self._GONE))
                keys[pos] = hs
                vals[pos] = blocks
                if self.slot_of is not None:
                    self.slot_of[blocks] = pos
                self.live += len(hs)
                return
            vals[pos] = v  # as it was: the rounds decide
        ahead = np.arange(self._WINDOW)
        while len(todo):
            # each key looks at the next `_WINDOW` slots of its probe run and aims at the first
            # free one (empty or removed: every slot before it is live, so lookups pass them);
            # it writes its number there, and the one whose number reads back takes the slot.
            # The rest go on: past the slot another key won, or past a window with no free slot.
            win = (pos[:, None] + ahead) & mask
            v = vals[win]
            free = v < 0
            rows, first = np.arange(len(todo)), free.argmax(axis=1)
            has = free[rows, first]
            aim = win[rows, first]
            vals[aim[has]] = todo[has]
            won = has & (vals[aim] == todo)
            slot, who = aim[won], todo[won]
            self.removed -= int(np.count_nonzero(v[rows, first][won] == self._GONE))
            keys[slot] = hs[who]
            vals[slot] = blocks[who]
            if self.slot_of is not None:
                self.slot_of[blocks[who]] = slot
            if won.all():
                break
            go = ~won
            todo = todo[go]
            pos = np.where(has, aim + 1, pos + self._WINDOW)[go] & mask
        self.live += len(hs)

    def add_absent(self, hs: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Insert those of `hs` that are absent (a key named twice: its first), each with its
        block (`blocks` distinct), probing once: each key's probe run is walked as `_find`
        walks it, noting the first free slot on the way (where `add` would put it). Returns
        which keys were inserted (the map is then what `get` and `add` one key at a time, in
        order, would have made)."""
        size = len(self.keys)
        if 4 * (self.live + len(hs)) > size:
            raise ValueError(f"{self.live + len(hs)} keys: more than the table is made for")
        if 2 * (self.live + self.removed + len(hs)) > size:
            self._rebuild()  # before the probe: the slots found stay valid for the writes
        idx = self._slots(hs)
        keys, vals = self.keys, self.vals
        v = vals[idx]
        hit = (keys[idx] == hs) & (v >= 0)
        free = v < 0
        settled = hit | (v == self._EMPTY)
        absent = ~hit
        aim = idx  # the first free slot of each absent key's probe run (home when free)
        if not settled.all():
            # the rest scan on, `_WINDOW` slots a round: to their own live slot (present) or
            # an empty one (absent); a key whose home held a live entry aims at the first
            # free slot (removed or empty) the scan passes
            aim = idx.copy()
            todo = np.flatnonzero(~settled)
            want_free = ~free[todo]  # no free slot seen yet
            mask = size - 1
            pos, want = (idx[todo] + 1) & mask, hs[todo]
            ahead = np.arange(self._WINDOW)
            while len(todo):
                win = (pos[:, None] + ahead) & mask
                w = vals[win]
                h = (keys[win] == want[:, None]) & (w >= 0)
                stop = h | (w == self._EMPTY)
                rows = np.arange(len(todo))
                first = stop.argmax(axis=1)
                found = h[rows, first]
                absent[todo[found]] = False
                fr = w < 0
                ff = fr.argmax(axis=1)
                take = want_free & fr[rows, ff]  # a first free slot in this window
                aim[todo[take]] = win[rows, ff][take]
                want_free &= ~take
                go = ~stop[rows, first]
                todo, pos, want = todo[go], (pos[go] + self._WINDOW) & mask, want[go]
                want_free = want_free[go]
        new = np.flatnonzero(absent)
        if not len(new):
            return absent
        slot = aim[new]
        # of absent keys aiming at one slot, the first takes it: each key's number is written
        # to its slot, the first's last, and the numbers that read back won
        before = vals[slot]
        marks = new.astype(np.int32)
        vals[slot[::-1]] = marks[::-1]
        won = vals[slot] == marks
        if not won.all():
            lost, new, slot, before = new[~won], new[won], slot[won], before[won]
        self.removed -= int(np.count_nonzero(before == self._GONE))
        keys[slot] = hs[new]
        vals[slot] = blocks[new]
        if self.slot_of is not None:
            self.slot_of[blocks[new]] = slot
        self.live += len(new)
        if not won.all():
            # the others (a key twice, or keys whose runs met at one free slot): one by
            # one, in order, each inserted unless its key is in by now
            for i in lost.tolist():
                one = hs[i:i + 1]
                if self.get_one(int(one[0])) >= 0:
                    absent[i] = False
                else:
                    self.add(one, blocks[i:i + 1])
        return absent

    def distinct(self, hs: np.ndarray) -> bool:
        """Whether no key appears twice in `hs`: distinct home slots prove it (each key's
        number written to its slot reads back), else an exact check."""
        idx = self._slots(hs)
        v = self.vals[idx]
        mark = np.arange(len(hs), dtype=np.int32)
        self.vals[idx] = mark
        ok = bool((self.vals[idx] == mark).all())
        self.vals[idx] = v
        return ok or len(np.unique(hs)) == len(hs)

    def remove(self, hs: np.ndarray) -> None:
        """Remove keys that are present."""
        slots = self._find(hs)
        self.vals[slots] = self._GONE
        self.live -= len(hs)
        self.removed += len(hs)

    def remove_values(self, values: np.ndarray) -> None:
        """Remove the entries whose values these are (each held by a present entry; made
        with `by_value`): their slots are known, so no key is probed for."""
        assert self.slot_of is not None
        self.vals[self.slot_of[values]] = self._GONE
        self.live -= len(values)
        self.removed += len(values)

    def _rebuild(self) -> None:
        live = np.flatnonzero(self.vals >= 0)
        hs, blocks = self.keys[live], self.vals[live]
        self.vals[:] = self._EMPTY
        self.live = self.removed = 0
        if len(live):
            self.add(hs, blocks)


class LruRing:
    """The hashed free blocks in LRU order (least recently freed first), on numpy arrays.

    `order` lists blocks by the position they were appended at; `pos[b]` is block b's position
    while it waits here, -1 otherwise. Taking a block out of the middle (a cache hit) only
    clears its `pos`, leaving a stale entry that a pop from the front skips; when the array is
    full the live entries are moved to its start (each append is paid for once). A take, an
    append or a membership test of a request's blocks is a few array operations, and nothing
    grows with the holes (an `OrderedDict` did the same, one Python-level node a block).
    """

    def __init__(self, n: int) -> None:
        self.pos = np.full(n, -1, dtype=np.int64)
        self.order = np.empty(2 * n + 64, dtype=np.int64)
        self.head = 0  # the first position that may be live
        self.tail = 0  # the next position to append at
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def mask(self, blocks: np.ndarray) -> np.ndarray:
        """Which of `blocks` wait here."""
        return self.pos[blocks] >= 0

    def append(self, blocks: np.ndarray) -> None:
        """At the back, in order (blocks that are not here yet, each once)."""
        m = len(blocks)
        if not m:
            return
        if self.tail + m > len(self.order):
            self._compact(m)
        self.order[self.tail:self.tail + m] = blocks
        self.pos[blocks] = np.arange(self.tail, self.tail + m)
        self.tail += m
        self.count += m

    def remove(self, blocks: np.ndarray) -> None:
        """Out of the middle (blocks that are here)."""
        self.pos[blocks] = -1
        self.count -= len(blocks)

    def popleft(self, n: int) -> np.ndarray:
        """The `n` least recently freed blocks (n <= count), out of the queue."""
        parts: list[np.ndarray] = []
        need = n
        while need > 0:
            w = min(self.tail - self.head, max(2 * need, 64))
            window = self.order[self.head:self.head + w]
            live = np.flatnonzero(self.pos[window] == np.arange(self.head, self.head + w))
            if len(live) >= need:
                parts.append(window[live[:need]])
                self.head += int(live[need - 1]) + 1
                break
            parts.append(window[live])
            need -= len(live)
            self.head += w
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self.pos[out] = -1
        self.count -= n
        return out

    def _compact(self, m: int) -> None:
        window = self.order[self.head:self.tail]
        live = window[self.pos[window] == np.arange(self.head, self.tail)]
        if len(live) + m > len(self.order):
            self.order = np.empty(2 * (len(live) + m), dtype=np.int64)
        self.order[:len(live)] = live
        self.pos[live] = np.arange(len(live))
        self.head, self.tail = 0, len(live)


class IdDeque:
    """Block ids in a ring buffer, taken from the front, added at either end: a run of ids costs
    one array copy, however fragmented (a deque of runs cost a Python step per run, and a
    decode pool's freed lists are runs of one or two blocks)."""

    def __init__(self, n: int) -> None:
        self.buf = np.arange(n, dtype=np.int32)  # every id free, in order
        self.head = 0
        self.count = n

    def _read(self, start: int, m: int) -> np.ndarray:
        cap = len(self.buf)
        if m == 0:
            return np.zeros(0, dtype=np.int64)
        start %= cap
        end = start + m
        if end <= cap:
            return self.buf[start:end].astype(np.int64)
        return np.concatenate((self.buf[start:], self.buf[: end - cap])).astype(np.int64)

    def _write(self, start: int, ids: np.ndarray) -> None:
        cap, m = len(self.buf), len(ids)
        start %= cap
        end = start + m
        if end <= cap:
            self.buf[start:end] = ids
        else:
            self.buf[start:] = ids[: cap - start]
            self.buf[: end - cap] = ids[cap - start:]

    def ids(self) -> np.ndarray:
        """Every id, front first."""
        return self._read(self.head, self.count)

    def popleft(self, m: int) -> np.ndarray:
        out = self._read(self.head, m)
        self.head = (self.head + m) % max(len(self.buf), 1)
        self.count -= m
        return out

    def prepend(self, ids: np.ndarray) -> None:
        """`ids` at the front, in their order (ids[0] first)."""
        if len(ids):
            self.head = (self.head - len(ids)) % len(self.buf)
            self._write(self.head, ids)
            self.count += len(ids)

    def append(self, ids: np.ndarray) -> None:
        if len(ids):
            self._write(self.head + self.count, ids)
            self.count += len(ids)


def with_runs(arr: np.ndarray, ids: list[int]) -> tuple[int, ...]:
    """`ids` (the list of `arr`, distinct block ids) as a tuple that carries its runs
    (`core.blocks.RunBlocks`), cut from the array: where two neighbours are not one apart.
    Short lists, and lists of many short runs, stay plain tuples (the encoder packs their ids
    as cheaply)."""
    n = len(ids)
    if n < 16:
        return tuple(ids)
    d = arr[1:] - arr[:-1]
    cuts: list[int] = np.flatnonzero(d * d != 1).tolist()  # a run ends at each
    if 8 * len(cuts) > n:
        return tuple(ids)
    cuts.append(n - 1)
    runs: list[int] = []
    first = 0
    for last in cuts:  # per run: its first id, its length, negative when it descends
        length = last - first + 1
        runs += (ids[first], -length if length > 1 and ids[first + 1] < ids[first] else length)
        first = last + 1
    return RunBlocks(ids, tuple(runs))


_SQRT2 = math.sqrt(2.0)
# lists this long are handed out with their runs whether or not a recorder listens: per run,
# the core's checks and plans and `ids_array` cost less than per id from about here on
RUNS_FROM = 256


def ids_array(blocks: tuple[int, ...]) -> np.ndarray:
    """`blocks` as an int64 array: spelled from its runs when it is long and carries a few
    (a handful of array operations), else read id by id."""
    if (type(blocks) is not RunBlocks or len(blocks) < RUNS_FROM
            or 8 * len(blocks.runs) > len(blocks)):
        return np.array(blocks, dtype=np.int64)
    runs = np.array(blocks.runs, dtype=np.int64)
    starts, lengths = runs[0::2], runs[1::2]
    sizes = np.abs(lengths)
    steps = np.where(lengths < 0, -1, 1)
    # the k-th id of a run is its start + k * step; k counted from the list's start here
    firsts = starts - steps * (np.cumsum(sizes) - sizes)
    return np.repeat(firsts, sizes) + np.repeat(steps, sizes) * np.arange(len(blocks))


class FreeBlockQueue:
    """vLLM v1's queue of free blocks.

    vLLM puts a freed block without a prefix-cache hash at the front and one with a hash at the
    back, and only hashed blocks are ever taken out of the middle (a cache hit). So the queue is
    the unhashed blocks in order (`IdDeque`) followed by the hashed blocks in LRU order
    (`LruRing`); allocation takes the unhashed blocks first, then the least recently freed
    hashed blocks.
    """

    def __init__(self, n: int, hashed: int | None = None) -> None:
        self.unhashed = IdDeque(n)
        self.lru = LruRing(n if hashed is None else hashed)  # room for `hashed` blocks

    @property
    def in_runs(self) -> int:
        return self.unhashed.count

    @property
    def runs(self) -> list[tuple[int, int, int]]:
        """The unhashed blocks as runs `(start, length, step)`, front first (for inspection)."""
        return self._as_runs(self.unhashed.ids())

    def __len__(self) -> int:
        return self.unhashed.count + len(self.lru)

    def __contains__(self, block: int) -> bool:
        """Whether a hashed block is free (only hashed blocks are asked about)."""
        return bool(self.lru.pos[block] >= 0)

    def popleft(self, n: int) -> np.ndarray:
        """The first `n` blocks (n <= len), out of the queue."""
        k = min(n, self.unhashed.count)
        if k == n:
            return self.unhashed.popleft(n)
        if k == 0:
            return self.lru.popleft(n)
        return np.concatenate((self.unhashed.popleft(k), self.lru.popleft(n - k)))

    def popleft_n(self, n: int) -> list[int]:
        return self.popleft(n).tolist()  # type: ignore[no-any-return]

    @staticmethod
    def _as_runs(blocks: list[int] | np.ndarray) -> list[tuple[int, int, int]]:
        """`blocks` cut into runs `(start, length, step)`, each a maximal stretch of ids one
        apart in one direction (step +1 or -1; 1 for a lone block), taken greedily from the
        front. In a list of distinct ids a stretch can only end where two neighbours are not
        one apart (turning round would repeat an id), so the runs are cut there in one array
        pass; a list that turns round (a repeated id) is walked block by block."""
        n = len(blocks)
        if n == 0:
            return []
        arr = np.asarray(blocks, dtype=np.int64)
        d = np.diff(arr)
        one = (d == 1) | (d == -1)
        if n > 2 and (one[:-1] & one[1:] & (d[:-1] != d[1:])).any():
            return FreeBlockQueue._as_runs_walk(arr.tolist())
        first = np.flatnonzero(~one) + 1
        starts = np.concatenate(([0], first))
        lengths = np.diff(np.append(starts, n))
        steps = np.ones(len(starts), dtype=np.int64)
        long = lengths > 1
        steps[long] = d[starts[long]]
        return list(zip(arr[starts].tolist(), lengths.tolist(), steps.tolist()))

    @staticmethod
    def _as_runs_walk(blocks: list[int]) -> list[tuple[int, int, int]]:
        runs: list[tuple[int, int, int]] = []
        i = 0
        while i < len(blocks):
            start, j = blocks[i], i + 1
            step = blocks[j] - start if j < len(blocks) and abs(blocks[j] - start) == 1 else 1
            while j < len(blocks) and blocks[j] == blocks[j - 1] + step:
                j += 1
            runs.append((start, j - i, step))
            i = j
        return runs

    def prepend_n(self, blocks: list[int] | np.ndarray) -> None:
        self.unhashed.prepend(np.asarray(blocks, dtype=np.int64))

    def append_n(self, blocks: list[int] | np.ndarray) -> None:
        """Hashed blocks go to the LRU tail; others (the synthetic history's skips) end the runs."""
        self.lru.append(np.asarray(blocks, dtype=np.int64))

    def append_unhashed(self, blocks: list[int] | np.ndarray) -> None:
        self.unhashed.append(np.asarray(blocks, dtype=np.int64))

    def remove(self, block: int) -> None:
        self.lru.remove(np.array([block], dtype=np.int64))


class SyntheticQueue:
    """The free queue of a pool with a synthetic history (`run_blocks`): a ring of block ids.

    A take of `n` blocks cuts them into runs of the drawn geometric lengths, leaving one free
    block between consecutive runs (moved to the back of the queue, as if a request that is not
    in the run held it and freed it since); freed blocks go to the back in order. Equal, id for
    id, to the per-run walk over `FreeBlockQueue` it replaces (`take_slow`, kept for the rare
    take that would reach its own skipped blocks), at the cost of a few numpy operations.
    """

    def __init__(self, n: int) -> None:
        self.ids = np.arange(n, dtype=np.int64)
        self.head = 0
        self.count = n

    def _positions(self, start: int, m: int) -> np.ndarray:
        return (self.head + start + np.arange(m)) % len(self.ids)

    def append(self, blocks: tuple[int, ...] | list[int] | np.ndarray) -> None:
        k = len(blocks)
        if not k:
            return
        cap = len(self.ids)
        at = (self.head + self.count) % cap
        end = at + k
        if end <= cap:
            self.ids[at:end] = blocks
        else:
            arr = np.asarray(blocks, dtype=np.int64)
            self.ids[at:] = arr[: cap - at]
            self.ids[: end - cap] = arr[cap - at:]
        self.count += k

    def _pop(self, m: int) -> np.ndarray:
        cap = len(self.ids)
        end = self.head + m
        out = self.ids[self.head:end].copy() if end <= cap else np.concatenate(
            (self.ids[self.head:], self.ids[: end - cap]))
        self.head = end % cap
        self.count -= m
        return out

    def take(self, n: int, lengths: np.ndarray) -> tuple[int, ...]:
        """`n` blocks (n <= count) in runs of `lengths` (n geometric draws, each >= 1)."""
        if n == 0:
            return ()
        if self.count == n:  # nothing to skip: the whole queue, in order
            return tuple(self._pop(n).tolist())
        ends = np.cumsum(lengths)
        k = int(np.searchsorted(ends, n)) + 1  # runs needed: the k-th reaches n
        span = n + k - 1  # blocks walked from the head: the runs and a skip after each but last
        if span > self.count:  # the walk would come round to its own skipped blocks
            return self.take_slow(n, lengths)
        walked = self._pop(span)
        skips = ends[: k - 1] + np.arange(k - 1)  # offsets of the skipped blocks in the walk
        keep = np.ones(span, dtype=bool)
        keep[skips] = False
        self.append(walked[skips])
        return tuple(walked[keep].tolist())

    def take_slow(self, n: int, lengths: np.ndarray) -> tuple[int, ...]:
        out: list[int] = []
        for length in lengths.tolist():
            out += self._pop(min(length, n - len(out))).tolist()
            if len(out) >= n:
                break
            if self.count > n - len(out):
                self.append(self._pop(1))
        return tuple(out)


class BlockPool:
    """Block ids of one instance, handed out and taken back the way vLLM 0.32's BlockPool does.

    - Allocation takes blocks from the head of the free queue (initially every id in order).
    - A request's blocks are freed tail first. A block without a prefix-cache hash goes back to
      the *front* (vLLM 0.32 reuses them LIFO, `reuse="lifo"`), so the next request gets the last
      one's blocks in reverse order; earlier V1 releases put it at the back (`reuse="fifo"`). A
      block with a hash goes to the back (FIFO: the cache's LRU order).
    - A prefix-cache hit takes its cached blocks out of the queue wherever they are (a block
      shared by several requests is counted per holder); taking a cached block from the head
      evicts its hash.
    So how contiguous a transfer's blocks are (its descriptor count) is set by what the
    instance served before, not by a knob. `run_blocks` keeps a synthetic stand-in for a history
    the run does not contain: every allocation cut into runs of geometric length, that mean.
    """

    def __init__(self, n: int, run_blocks: float | None, seed: int,
                 prefix_caching: bool = False, reuse: str = "lifo") -> None:
        if reuse not in ("lifo", "fifo"):
            raise ValueError(f"block reuse must be 'lifo' or 'fifo', not {reuse!r}")
        self.reuse = reuse
        synthetic = run_blocks is not None and not prefix_caching
        # without prefix caching no block is ever hashed or shared: the LRU of hashed blocks,
        # the hash table and the per-block arrays below stay empty (a cluster's decode pools
        # would otherwise fill hundreds of MiB they never read)
        m = n if prefix_caching else 0
        self.queue = FreeBlockQueue(0 if synthetic else n, hashed=m)
        self.capacity = n
        self.run_blocks = run_blocks
        self.rng = np.random.default_rng(seed)
        self.prefix_caching = prefix_caching
        self.ref = np.zeros(m, dtype=np.int32)  # block -> requests holding it
        self.block_of = HashIndex(m, by_value=True)  # prefix hash -> cached block
        self.hashed = np.zeros(m, dtype=bool)  # block -> whether it has a prefix hash
        self.hash_of = np.zeros(m, dtype=np.uint64)  # cached block -> its hash
        self.reserved = 0  # blocks promised to running requests' future tokens
        self.version = 0  # changes whenever `block_of` does
        self._hits_memo: tuple[Any, int, int, list[int], np.ndarray] | None = None
        self._arrays: tuple[list[int], np.ndarray] | None = None  # a list and its array
        self._hit_arrays: tuple[list[int], np.ndarray] | None = None  # the last `hits`'
        self._last_hits: tuple[np.ndarray, np.ndarray] | None = None  # hashes, their blocks
        # large takes' arrays by the id of the tuple handed out (the tuple is kept with it,
        # so the id stays its own), for `give`; bounded, cleared when full
        self._taken: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
        self._mark: np.ndarray | None = None  # scratch for `_distinct`, made when first used
        # the synthetic history's queue: only runs, appended at the back (no hashes, no
        # sharing), kept in a numpy ring so that a take or a give is a few array operations
        self.ring = SyntheticQueue(n) if synthetic else None
        # hand lists out with their runs (`RunBlocks`): the core then checks and plans them
        # per run, and a recorder's encoder packs them per run, instead of per id. Lists of
        # `RUNS_FROM` blocks or more always; shorter ones (from 16) while a recorder listens
        self.with_runs = False

    @property
    def free(self) -> int:
        if self.ring is not None:
            return self.ring.count
        return self.queue.unhashed.count + self.queue.lru.count

    def take(self, n: int) -> tuple[int, ...] | None:
        if n > self.free:
            return None
        if self.ring is not None:
            return self.ring.take(n, self.rng.geometric(1.0 / self.run_blocks, size=n))
        arr = self.queue.popleft(n)
        out = arr.tolist()
        if not self.prefix_caching:
            # no hashes and no sharing: a block's holder count is never asked (`give` frees
            # every block of a request whatever it says)
            return with_runs(arr, out) if self.with_runs or n >= RUNS_FROM else tuple(out)
        self.ref[arr] = 1
        cached = arr[self.hashed[arr]]
        if len(cached):  # taking a cached block from the head evicts its hash
            self.version += 1
            self.hashed[cached] = False
            self.block_of.remove_values(cached)  # their hashes' entries
        got = with_runs(arr, out) if self.with_runs or n >= RUNS_FROM else tuple(out)
        if n >= 64:  # a prompt's blocks, most often given back as they are: keep the array
            self._keep(got, arr)
        return got

    def _keep(self, blocks: tuple[int, ...], arr: np.ndarray) -> None:
        if len(self._taken) >= 256:
            self._taken.clear()
        self._taken[id(blocks)] = (blocks, arr)

    def _kept(self, blocks: tuple[int, ...]) -> np.ndarray:
        """The array of a list this pool handed out (kept), else spelled anew."""
        kept = self._taken.get(id(blocks))
        return kept[1] if kept is not None and kept[0] is blocks else ids_array(blocks)

    def joined(self, hit: list[int], new: tuple[int, ...]) -> tuple[int, ...]:
        """A request's blocks: its prefix-cache hits, then the blocks newly taken (`new`
        itself when nothing hit), with their runs when lists carry them."""
        if not hit:
            return new
        if not self.with_runs and len(hit) + len(new) < RUNS_FROM:
            return (*hit, *new)
        arr = self._array(hit)
        kept = self._taken.pop(id(new), None)
        new_arr = kept[1] if kept is not None and kept[0] is new else None
        if type(new) is not RunBlocks and len(new) >= 16:  # the whole list carries runs
            new = with_runs(np.asarray(new, dtype=np.int64) if new_arr is None else new_arr,
                            list(new))
        out = join((with_runs(arr, hit), new))
        if new_arr is not None:  # the whole list's array, kept in the new blocks' stead
            self._keep(out, np.concatenate((arr, new_arr)))
        return out

    def give(self, blocks: tuple[int, ...]) -> None:
        """Free a request's blocks, tail first."""
        if self.ring is not None:  # synthetic history: back of the queue, in order
            self.ring.append(blocks)
            return
        ref, hashed = self.ref, self.hashed
        kept = self._taken.pop(id(blocks), None)
        if kept is not None and kept[0] is blocks:
            rev = kept[1][::-1]
        else:
            rev = ids_array(blocks)[::-1]
        if not self.prefix_caching:  # no hashes, no sharing (see `take`): all to the front
            front, back = rev, rev[:0]
        elif (ref[rev] <= 1).all():
            # the usual case: every block's last holder frees it
            ref[rev] = 0
            mask = hashed[rev]
            front, back = rev[~mask], rev[mask]
        else:
            fl, bl = [], []
            for b in rev.tolist():
                left = int(ref[b]) - 1
                if left > 0:
                    ref[b] = left
                    continue
                ref[b] = 0
                (bl if hashed[b] else fl).append(b)
            front, back = np.array(fl, dtype=np.int64), np.array(bl, dtype=np.int64)
        if self.reuse == "lifo":
            self.queue.prepend_n(front)
        else:  # earlier vLLM V1 releases: every freed block to the back
            self.queue.append_unhashed(front)
        self.queue.append_n(back)

    def hits(self, hashes: Sequence[int] | np.ndarray, limit: int) -> list[int]:
        """Cached blocks of the longest cached prefix of `hashes` (at most `limit` blocks).
        A function of the prefix cache's map alone: asked again about the same list while
        the map has not changed (a request waiting at the head of the queue for blocks), the
        last answer is given again."""
        memo = self._hits_memo
        if memo is None or memo[0] is not hashes or memo[1] != limit or memo[2] != self.version:
            memo = self._hits_memo = self._hits(hashes, limit)
        out = list(memo[3])
        # `free_of`, `touch` and `joined` of this list need no conversion
        self._arrays = self._hit_arrays = (out, memo[4])
        return out

    def _array(self, blocks: list[int]) -> np.ndarray:
        """`blocks` as an array: the one made with this very list (`_arrays`, `_hit_arrays`),
        or anew."""
        for got in (self._arrays, self._hit_arrays):
            if got is not None and got[0] is blocks:
                return got[1]
        return np.array(blocks, dtype=np.int64)

    def _hits(self, hashes: Sequence[int] | np.ndarray, limit: int
              ) -> tuple[Any, int, int, list[int], np.ndarray]:
        end = min(limit, len(hashes))
        hs = np.asarray(hashes[:end], dtype=np.uint64)
        parts: list[np.ndarray] = []
        # Requests sharing a prefix ask about the same leading hashes: the blocks the last
        # answer found for them still hold them while each is hashed with that very hash
        # (`hashed`, `hash_of`: a block has one hash, a hash one block), checked here on the
        # pool's arrays instead of probing the map; probing resumes at the first that does not
        k = 0
        last = self._last_hits
        if last is not None and len(last[1]) and end:
            n = min(len(last[1]), end)
            same = hs[:n] == last[0][:n]
            n = n if same.all() else int(np.argmin(same))
            if n:
                b = last[1][:n]
                ok = self.hashed[b] & (self.hash_of[b] == hs[:n])
                k = n if ok.all() else int(np.argmin(ok))
                parts.append(b[:k])
        # the first unconfirmed hash alone (most prompts miss there: nothing more to ask),
        # then the next few, then the rest
        first_miss = k < end and self.block_of.get_one(int(hs[k])) < 0
        for lo, hi in ((k, min(k + 16, end)), (k + 16, end)):
            if lo >= hi or first_miss:
                break
            part = self.block_of.get(hs[lo:hi]).astype(np.int64, copy=False)
            miss = np.flatnonzero(part < 0)
            parts.append(part[: miss[0] if len(miss) else hi - lo])
            if len(miss):
                break
        arr = (np.concatenate(parts) if len(parts) > 1 else parts[0] if parts
               else np.zeros(0, dtype=np.int64))
        self._last_hits = (hs[: len(arr)], arr)
        return hashes, limit, self.version, arr.tolist(), arr

    def free_of(self, blocks: list[int]) -> list[int]:
        """Those of `blocks` (cache hits) that no request holds: they wait in the free queue."""
        if not blocks:
            return []
        arr = self._array(blocks)
        free = arr[self.queue.lru.mask(arr)]
        out: list[int] = free.tolist()
        self._arrays = (out, free)
        return out

    def free_after_touch(self, blocks: list[int]) -> int:
        """Free blocks left once `blocks` (cache hits) are taken out of the queue."""
        return self.free - len(self.free_of(blocks))

    def touch(self, blocks: list[int]) -> None:
        if not blocks:
            return
        lru, ref = self.queue.lru, self.ref
        arr = self._array(blocks)
        free = lru.mask(arr)
        if free.all() and self._distinct(arr):
            # the usual case, distinct free blocks (no holder): out of the queue, one holder
            lru.remove(arr)
            ref[arr] = 1
            return
        for b in blocks:
            if lru.pos[b] >= 0:
                lru.remove(np.array([b], dtype=np.int64))
            ref[b] += 1

    def _distinct(self, blocks: np.ndarray) -> bool:
        """Whether no block appears twice: each block's number written at its place in a
        scratch array reads back (a block named twice reads one number for both)."""
        if self._mark is None:
            self._mark = np.zeros(self.capacity, dtype=np.int32)
        mark = np.arange(len(blocks), dtype=np.int32)
        self._mark[blocks] = mark
        return bool((self._mark[blocks] == mark).all())

    def cache(self, hashes: Sequence[int] | np.ndarray, blocks: tuple[int, ...]) -> None:
        """Register the full blocks of a computed prompt in the prefix cache."""
        if not self.prefix_caching:
            return
        block_of, hashed = self.block_of, self.hashed
        m = min(len(hashes), len(blocks))
        if not m:
            return
        arr = self._kept(blocks)[:m]
        hs_all = np.asarray(hashes[:m], dtype=np.uint64)
        # pairs whose block has no hash (a prompt's hits have theirs) and whose hash is not
        # cached yet: the prefix cache is asked about the first kind only
        at = np.flatnonzero(~hashed[arr])
        # leading hashes the last prefix-cache answer holds (re-checked as in `_hits`) are
        # cached: only the others are probed
        last = self._last_hits
        k = min(len(last[1]), m) if last is not None else 0
        if last is not None and k and len(at):
            b = last[1][:k]
            held = (hs_all[:k] == last[0][:k]) & hashed[b] & (self.hash_of[b] == hs_all[:k])
            at = at[(at >= k) | ~held[np.minimum(at, k - 1)]]
        self.version += 1
        bs = arr[at]
        if self._distinct(bs):  # the usual case: the absent ones in, probing once
            hs = hs_all[at]
            added = block_of.add_absent(hs, bs)
            bs = bs[added]
            hashed[bs] = True
            self.hash_of[bs] = hs[added]
            return
        at = at[block_of.get(hs_all[at]) < 0]
        hs, bs = hs_all[at], arr[at]
        for h, b in zip(hs.tolist(), bs.tolist()):
            one = np.array([h], dtype=np.uint64)
            if block_of.get(one)[0] < 0 and not hashed[b]:
                block_of.add(one, np.array([b], dtype=np.int64))
                hashed[b] = True
                self.hash_of[b] = h


class Instance:
    def __init__(self, sim: Simulation, name: str, layout: KVLayout, blocks: int,
                 run_blocks: float | None = None, prefix_caching: bool = False) -> None:
        self.sim, self.name, self.layout = sim, name, layout
        self.pool = BlockPool(blocks, run_blocks, sim.seed_for(name), prefix_caching,
                              sim.cfg.block_reuse)
        self.pool.with_runs = sim.recording  # short lists too carry runs for the recorder
        self.wake = sim.env.event()
        self.expiry_timers: dict[str, float] = {}  # lease -> when its one pending timer fires
        self.nic = simpy.Resource(sim.env, capacity=1)
        self.peers: set[str] = set()
        self.core: Any = None

    def poke(self) -> None:
        if not self.wake.triggered:
            self.wake.succeed()

    def _rearm(self) -> None:
        if self.wake.triggered:
            self.wake = self.sim.env.event()

    def connect(self, peer: str) -> float:
        """Handshake on first contact with a peer, nothing afterwards."""
        if peer in self.peers or self.sim.cfg.handshake_at_start:
            return 0.0
        self.peers.add(peer)
        return self.sim.costs.handshake_time()

    def do(self, cmd: Any) -> list[Event]:
        events = self.sim.do(self.core, cmd)
        freed = False
        for e in events:
            if isinstance(e, BlocksFreed) and e.instance == self.name:
                self.pool.give(e.blocks)
                freed = True
        if freed:
            self.on_freed()
        return events

    def on_freed(self) -> None:
        self.poke()

    def expire_at(self, lease: str, at: float) -> None:
        """Run a lease tick when `lease` may be due; the core decides whether it is.

        One timer per lease at a time: a renewal that moves the deadline later arms nothing,
        and the timer, firing at the earlier deadline, re-arms for the lease's deadline then
        (a renewed lease is not ticked at deadlines it has outlived). A lease with a read
        pinned is ticked when it fires, as the pins' bounds are checked there."""
        armed = self.expiry_timers.get(lease)
        if armed is not None and armed <= at:
            return
        self._arm_expiry(lease, at)

    def _arm_expiry(self, lease: str, at: float) -> None:
        env = self.sim.env
        self.expiry_timers[lease] = at

        def fire(_: Any) -> None:
            if self.expiry_timers.get(lease) != at:
                return  # an earlier deadline armed another timer since
            del self.expiry_timers[lease]
            leases = self.core.leases.leases
            ls = leases.get(lease)
            if ls is not None and (ls.pins or ls.expires_at <= env.now):
                self.do(LeaseTick(lease))  # due, or a pin's bound to check
                ls = leases.get(lease)
            if ls is not None and ls.expires_at > env.now:
                self._arm_expiry(lease, ls.expires_at)  # renewed past this timer

        env.timeout(max(at - env.now, 0.0)).callbacks.append(fire)


class PrefillInstance(Instance):
    """A prefill engine scheduled the way vLLM's V1 scheduler does it (`schedule`).

    Every step first continues the running requests' chunked prefills, oldest first, each
    taking the blocks its chunk needs; one that finds none preempts the newest running
    request, as vLLM does on any instance. Then, unless something was preempted, it admits
    waiting requests while the step's token budget (`max_num_batched_tokens`), the sequence
    limit (`max_num_seqs`) and free blocks allow; one step computes all the chunks it took,
    priced together. A request waiting for a D->P reuse read holds its slot and blocks but not
    the engine (vLLM's WAITING_FOR_REMOTE_KVS): other requests keep stepping.
    """

    def __init__(self, sim: Simulation, name: str) -> None:
        cfg = sim.cfg
        super().__init__(sim, name, cfg.prefill_layout, cfg.prefill_blocks,
                         prefix_caching=cfg.prefill_prefix_caching)
        self.core = P.PrefillCore(name, cfg.prefill_layout, cfg.kv_timeout)
        self.queue: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []  # admitted, computing, oldest first
        self.loading = 0  # admitted, waiting for a reuse read
        self.progress: dict[str, int] = {}  # request id -> prompt tokens in the cache so far
        self.blocks: dict[str, tuple[int, ...]] = {}  # request id -> its prompt's blocks
        self.resuming: set[str] = set()  # waiting requests that were preempted
        self.preemptions = 0  # vllm:num_preemptions_total of this instance
        self.transfer_thread = simpy.Resource(sim.env, capacity=1)
        sim.env.process(self.loop())

    @property
    def busy(self) -> int:
        return len(self.running) + self.loading

    def submit(self, r: SimRequest) -> None:
        """The prefill leg leaves the router; its trip into the scheduler (`request_leg`) and
        the per-request overhead (calibrated, holds no engine) pass before it can be
        scheduled. A prompt that the whole pool cannot hold is refused (it would wait
        forever: prefill takes a prompt's blocks at admission)."""
        need = -(-r.prompt // self.layout.block_size)
        if need > self.pool.capacity:
            raise PoolTooSmall(
                f"request {r.id}: its {r.prompt}-token prompt needs {need} KV blocks; "
                f"{self.name}'s whole pool holds {self.pool.capacity} blocks (shorten the "
                "workload's input_len, or give prefill more KV memory: prefill TP, "
                "engine.activation_reserve_bytes, the hardware profile)")
        r.prefill_received = self.sim.env.now

        def enqueue(_: Any) -> None:
            self.queue.append(r)
            self.poke()

        costs = self.sim.costs
        delay = costs.request_overhead() + self.sim.hop(costs.request_leg(), "request_leg", r)
        self.sim.env.timeout(delay).callbacks.append(enqueue)

    def local_hits(self, r: SimRequest) -> list[int]:
        """Cached blocks of the prompt's longest cached prefix (whole blocks, never the last
        token: vLLM always computes at least one)."""
        if not self.sim.cfg.prefill_prefix_caching or r.hashes is None:
            return []
        limit = max(r.prompt - 1, 0) // self.layout.block_size
        return self.pool.hits(r.hashes, limit)

    def remember(self, r: SimRequest) -> None:
        if not self.sim.cfg.prefill_prefix_caching or r.hashes is None:
            return
        self.pool.cache(r.hashes, self.blocks.get(r.id, ()))

    def schedule(self) -> tuple[list[tuple[SimRequest, int, int]], bool]:
        """One step of vLLM's V1 scheduler (vllm/v1/core/sched/scheduler.py, `schedule`):
        the step's chunks `(request, new tokens, tokens in the cache)` and whether it
        preempted. Running requests come first, oldest first, each taking the blocks of its
        next chunk; one that finds none preempts the last running request, repeatedly, until
        its blocks are there or it was itself the one preempted (then the step ends there).
        A step that preempted admits no waiting request."""
        budget = self.sim.cfg.max_num_batched_tokens
        step: list[tuple[SimRequest, int, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            done = self.progress[r.id]
            n = min(r.prompt - done, budget)
            while not self._grow(r, done + n):
                victim = self.running[-1]  # FCFS: the newest is preempted first
                self.preempt(victim)
                preempted = True
                if victim is r:
                    break
            if preempted and r not in self.running:
                break
            step.append((r, n, done))
            budget -= n
            i += 1
        if not preempted:
            self.admit(budget, step)
        return step, preempted

    def _grow(self, r: SimRequest, tokens: int) -> bool:
        """Take the blocks `r`'s first `tokens` tokens need beyond those it holds; False
        when the pool cannot give them."""
        have = self.blocks[r.id]
        k = -(-tokens // self.layout.block_size) - len(have)
        if k <= 0:
            return True
        new = self.pool.take(k)
        if new is None:
            return False
        self.blocks[r.id] = (*have, *new)
        self.do(P.Allocate(r.id, 0, new))
        return True

    def _still_needed(self) -> int:
        """Blocks the admitted, unfinished prompts do not hold yet."""
        bs, reqs = self.layout.block_size, self.sim.requests
        return sum(max(-(-reqs[i].prompt // bs) - len(b), 0) for i, b in self.blocks.items()
                   if i in reqs and self.progress.get(i, 0) < reqs[i].prompt)

    def preempt(self, r: SimRequest) -> None:
        """vLLM's preemption (`_preempt_request`): the request leaves the running batch, its
        computed tokens are forgotten, its blocks freed tail first (the full ones it computed
        stay in the prefix cache, evictable, when prefill caches prefixes) and it goes back
        to the front of the waiting queue; admitted again, it recomputes what the cache lost.
        The core's `Preempt` records `RequestPreempted` and frees the blocks."""
        bs = self.layout.block_size
        self.running.remove(r)
        done = self.progress.pop(r.id)
        blocks = self.blocks.pop(r.id, ())
        if self.sim.cfg.prefill_prefix_caching and r.hashes is not None:
            n = min(done // bs, len(blocks))
            self.pool.cache(self._hash_list(r)[:n], blocks[:n])
        self.preemptions += 1
        r.preemptions += 1
        self.resuming.add(r.id)
        self.do(P.Preempt(r.id, 0))
        self.queue.appendleft(r)

    def admit(self, budget: int, step: list[tuple[SimRequest, int, int]]) -> None:
        """Waiting requests, in order, while the step has tokens left, a sequence slot is
        free and the pool holds the whole prompt (vLLM 0.32's `scheduler_reserve_full_isl`);
        only the blocks of its first chunk (appended to `step`) are taken now, the rest as
        later chunks need them. A request that may read decode's KV takes, besides its local
        hits, the blocks of the tokens decode retained for its conversation (at most: vLLM
        takes those of the tokens the connector will load, decided in the same breath) and
        computes no chunk until the read is done; its suffix's blocks come with its chunks,
        so a request admitted meanwhile can take them and one of the two is preempted. A
        preempted request is admitted again as a plain one: it recomputes, reading nothing."""
        cfg, env = self.sim.cfg, self.sim.env
        bs = self.layout.block_size
        while self.queue and self.busy < cfg.max_num_seqs and budget > 0:
            r = self.queue[0]
            hit = self.local_hits(r)
            # A hit block another running request holds is shared in vLLM; the event log's
            # ledger (kvplane.core.replay) knows one owner per block, so such a block is
            # stood in for by a fresh one: the compute is still saved, only its id differs.
            free_hit = self.pool.free_of(hit)
            need = -(-r.prompt // bs) - len(free_hit)
            cached = len(hit) * bs
            reading = (cfg.bidirectional and r.conversation is not None
                       and r.id not in self.resuming)
            handle = (self.sim.router.table.handle_of(r.tenant, r.conversation or "")
                      if reading else None)
            remote = min(handle.num_tokens, r.prompt) if handle is not None else 0
            # an async load (decode holds more of the prompt than the local hits) also leaves
            # what admitted prompts still need (vLLM's `_inflight_prefill_reserved_blocks`);
            # a plain admission does not
            reserved = self._still_needed() if remote > cached else 0
            if self.pool.free - len(free_hit) - reserved < need:  # free once they are taken
                return  # freed blocks (a finished transfer) wake the loop again
            n = min(r.prompt - cached, budget)
            # a reader takes the blocks decode's KV could fill (vLLM: its external tokens')
            upto = max(cached, remote) if reading and remote > cached else cached + n
            self.pool.touch(free_hit)
            new = self.pool.take(-(-upto // bs) - len(free_hit))
            assert new is not None
            if len(free_hit) == len(hit):  # no stand-ins
                blocks = self.pool.joined(hit, new)
            elif not free_hit:  # every hit stood in for: all fresh
                blocks = new
            else:
                fresh = iter(new)
                owned = set(free_hit)
                blocks = (*[b if b in owned else next(fresh) for b in hit], *fresh)
            self.blocks[r.id] = blocks
            self.queue.popleft()
            self.resuming.discard(r.id)
            if r.prefill_start < 0:
                r.prefill_start = env.now
            if blocks:
                self.do(P.Allocate(r.id, 0, blocks))
            if reading and remote <= cached:  # nothing to read: decided now, a plain request
                cached = self._decide_now(r, cached)
                reading = False
            if reading:
                self.loading += 1
                env.process(self._read_then_run(r, cached))
            else:
                self._run(r, cached)
                step.append((r, n, cached))
                budget -= n

    def _decide_now(self, r: SimRequest, cached: int) -> int:
        """The router's reuse decision for a request decode holds nothing more of (vLLM's
        connector answers "no external tokens" within the scheduling step)."""
        decide = self.sim.router.reuse(self, r, cached)
        try:
            next(decide)
        except StopIteration as done:
            return int(done.value)
        raise AssertionError(f"{r.id}: a reuse read of nothing")

    def _read_then_run(self, r: SimRequest, cached: int) -> Iterator[Any]:
        before = self.sim.env.now
        cached = yield from self.sim.router.reuse(self, r, cached)
        if self.sim.env.now > before:  # a read: vLLM learns of it from a step's output
            yield self.sim.env.timeout(self.sim.costs.empty_step_time())
        self.loading -= 1
        self._run(r, cached)
        self.poke()

    def _run(self, r: SimRequest, cached: int) -> None:
        r.cached = cached
        self.progress[r.id] = cached
        if self.sim.recording:
            self.sim.rec(PrefillStarted(at=self.sim.env.now, instance=self.name, request=r.id,
                                        computed_tokens=r.prompt - cached,
                                        cached_tokens=cached))
        self.running.append(r)

    def loop(self) -> Iterator[Any]:
        env, costs = self.sim.env, self.sim.costs
        while True:
            step, preempted = self.schedule()
            if not step:
                if not preempted:  # a step that preempted everything: admit in the next
                    self._rearm()
                    yield self.wake
                continue
            t = costs.prefill_batch_time([(n, c) for _, n, c in step])
            self._rearm()
            yield env.timeout(t)
            for r, n, c in step:
                r.compute_s += t
                self.progress[r.id] = c + n
                if c + n >= r.prompt:
                    self.running.remove(r)
                    del self.progress[r.id]
                    self.finish_after(r, self.sim.hop(t, "prefill_step", r) - t)

    def finish_after(self, r: SimRequest, delay: float) -> None:
        """Finish now, or `delay` later: on a shared host a request's last step can end late
        for it (its process waited for a core) while the engine's other requests go on, as
        the recorded hops show (they are independent of each other)."""
        if delay <= 0:
            self.finish(r)
        else:
            self.sim.env.timeout(delay).callbacks.append(lambda _: self.finish(r))

    def finish(self, r: SimRequest) -> None:
        cfg = self.sim.cfg
        self.remember(r)
        self.blocks.pop(r.id, None)
        r.prefill_end = self.sim.env.now
        events = self.do(P.FinishPrefill(r.id, 0, r.prompt, mode=cfg.mode, hold_ttl=cfg.hold_ttl))
        if cfg.mode == "push":
            self.start_push(events)
        else:
            for e in events:
                if isinstance(e, LeaseGranted):
                    self.expire_at(e.lease, e.expires_at)
            self.sim.router.relay_metadata(self, r)

    def start_push(self, events: list[Event]) -> None:
        for e in events:
            if isinstance(e, TransferPlanned) and e.direction == "P->D":
                r = self.sim.requests[e.request or ""]
                r.runs = e.runs
                self.push_transfer(e, r)

    def on_registration(self, r: SimRequest, e: RegistrationSent, layout: KVLayout) -> None:
        events = self.do(P.Register(r.id, 0, e.instance, e.dst_blocks, layout,
                                    deadline=e.deadline))
        for ev in events:
            if isinstance(ev, RegistrationDropped) and ev.final:
                self.sim.decodes[r.decode].do(D.KVFailed(r.id, 0, ev.reason))
        self.start_push(events)

    def push_transfer(self, plan: TransferPlanned, r: SimRequest) -> None:
        """The push's WRITE on prefill's background thread (one transfer at a time), then
        the link (one at a time), then the notifications' trip to decode. Callbacks on the
        SimPy events, not a process: the same events at the same times, without a process's
        start, resumptions and end (three of a request's SimPy steps)."""
        env, costs = self.sim.env, self.sim.costs
        slot = self.transfer_thread.request()

        def prepare(_: Any) -> None:
            r.transfer_start = env.now
            prep = costs.descriptor_prep_time(plan.descriptors, inline=False)
            env.timeout(prep + self.connect(plan.dst)
                        + self.sim.hop(costs.transfer_setup(), "transfer", r)
                        ).callbacks.append(post)

        def post(_: Any) -> None:
            link = self.nic.request()

            def send(_: Any) -> None:
                env.timeout(costs.transfer_time(plan.bytes, plan.descriptors,
                                                plan.expected_notifications)
                            ).callbacks.append(sent)

            def sent(_: Any) -> None:
                self.nic.release(link)  # the link, then the thread (as nested `with`s)
                self.transfer_thread.release(slot)
                r.transfer_end = env.now
                self.do(P.TransferDone(r.id, 0))
                env.timeout(costs.message_latency()).callbacks.append(
                    lambda _: self.sim.decodes[r.decode].on_notifications(r))

            link.callbacks.append(send)

        slot.callbacks.append(prepare)


class DecodeInstance(Instance):
    def __init__(self, sim: Simulation, name: str) -> None:
        cfg = sim.cfg
        # decode's pool is the long-lived, fragmented one: retained and decoding requests'
        # blocks interleave; prefill's blocks live only until their transfer ends
        super().__init__(sim, name, cfg.decode_layout, cfg.decode_blocks, cfg.pool_run_blocks,
                         prefix_caching=cfg.decode_prefix_caching)
        self.core = D.DecodeCore(name, cfg.decode_layout)
        self.waiting: deque[SimRequest] = deque()
        self.loading: set[str] = set()
        self.joining: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.pulls: deque[tuple[SimRequest, TransferPlanned]] = deque()
        # (request, tokens to compute, tokens cached, why): computed locally in the loop, in
        # chunks mixed with the decodes (`prefilling`)
        self.recomputes: deque[tuple[SimRequest, int, int, str]] = deque()
        self.prefilling: list[LocalPrefill] = []
        self.retained: OrderedDict[str, None] = OrderedDict()  # leases, oldest first
        self.held: dict[str, int] = {}  # request id -> blocks it holds
        self.resuming: set[str] = set()  # waiting requests that were preempted
        self.preemptions = 0  # vllm:num_preemptions_total of this instance
        self.preempted_in_step = False
        self.admit_after = 0.0  # vLLM admits nothing in a step that preempted
        # the macro-step under way: when its first step starts, when each step ends (from
        # then), the steps at which its requests take a block (sorted); see `_in_flight`
        self.plan: tuple[float, list[float], list[int]] | None = None
        # `_fit`'s crossings per running request, for `grow` at the macro-step's end
        self._per: tuple[list[SimRequest], int, list[tuple[int, list[int]]]] | None = None
        self.reader = simpy.Resource(sim.env, capacity=1)
        self.admit_wake = sim.env.event()
        sim.env.process(self.admit_loop())
        sim.env.process(self.loop())

    @property
    def load(self) -> Load:
        return Load(self.name, len(self.running) + len(self.loading) + len(self.joining),
                    len(self.waiting), self.pool.free)

    def on_freed(self) -> None:
        if not self.admit_wake.triggered:
            self.admit_wake.succeed()

    def submit(self, r: SimRequest) -> None:
        """The decode leg leaves the router; it waits for blocks after its trip into the
        scheduler (`request_leg`). A request that the whole pool cannot hold is refused, as
        vLLM refuses one longer than the KV cache holds."""
        bs = self.layout.block_size
        if -(-(r.prompt + r.output) // bs) > self.pool.capacity:
            raise PoolTooSmall(
                f"request {r.id}: {r.prompt} + {r.output} tokens need "
                f"{-(-(r.prompt + r.output) // bs)} KV blocks; {self.name}'s whole pool holds "
                f"{self.pool.capacity} blocks (shorten the workload's input_len/output_len, or "
                "give decode more KV memory: engine.activation_reserve_bytes, decode TP, the "
                "hardware profile)")

        def arrive(_: Any = None) -> None:
            self.waiting.append(r)
            self.on_freed()

        leg = self.sim.hop(self.sim.costs.request_leg(), "request_leg", r)
        if leg > 0:
            self.sim.env.timeout(leg).callbacks.append(arrive)
        else:
            arrive()

    def admit_loop(self) -> Iterator[Any]:
        """The waiting queue's head, in order, once a sequence slot exists and the pool holds
        the blocks of what it has computed so far: a new request's prompt (its KV comes from
        prefill), a preempted one's prompt and output so far, less the blocks of it the prefix
        cache still has (vLLM 0.32 checks the whole sequence, `scheduler_reserve_full_isl`).
        Output blocks are taken one by one as tokens need them, and a running request that
        finds none preempts another (`make_room`). Blocks the running batch's steps so far
        took (`_in_flight`) are not handed out: vLLM serves running requests before waiting
        ones in every step; an admission ends the macro-step at the step under way, so the
        running batch's next blocks come out of what is left. Retained KV is evicted, oldest
        lease first, when the pool runs short."""
        env, cfg = self.sim.env, self.sim.cfg
        while True:
            if self.waiting and env.now < self.admit_after:
                yield env.timeout(self.admit_after - env.now)
                continue
            busy = len(self.running) + len(self.loading) + len(self.joining)
            got = None
            if self.waiting and busy < cfg.max_num_seqs:
                got = self._take_for(self.waiting[0])
            if got is None:
                if self.admit_wake.triggered:
                    self.admit_wake = env.event()
                yield self.admit_wake
                continue
            r = self.waiting.popleft()
            if r.id in self.resuming:
                self.resume(r, *got)
            else:
                self.admit(r, got[0])
            self.poke()  # the running batch re-plans its blocks from the next step on

    def _take_for(self, r: SimRequest) -> tuple[tuple[int, ...], int] | None:
        """Blocks for what `r` has computed so far and how many of its tokens they already
        hold (prefix-cache hits of a preempted request's own blocks); None: not yet."""
        bs, pool = self.layout.block_size, self.pool
        if r.id in self.resuming:
            tokens = r.prompt + r.done_tokens
            hit = self._own_hits(r, tokens)
        else:
            tokens, hit = r.prompt, []
        need = -(-tokens // bs) - len(hit) + self._in_flight()
        while pool.free_after_touch(hit) < need and self.retained:
            lease, _ = self.retained.popitem(last=False)
            self.do(Release(lease, "evicted under memory pressure"))
        if pool.free_after_touch(hit) < need:
            return None
        need -= self._in_flight()
        pool.touch(hit)
        new = pool.take(need)
        assert new is not None
        self.held[r.id] = len(hit) + need
        return pool.joined(hit, new), len(hit) * bs

    def _chain(self, r: SimRequest, n: int) -> list[int]:
        """The prefix-cache hashes of `r`'s first `n` blocks: the workload's (prompt, and the
        output of a conversation's turn), then hashes of its own for output blocks that have
        none (generated tokens are the request's own: no other request shares them)."""
        known = r.retained_hashes if r.retained_hashes is not None else r.hashes
        chain = known[:n].tolist() if known is not None else []
        chain += [int.from_bytes(hashlib.blake2b(f"{r.id}/{i}".encode(), digest_size=8)
                                 .digest(), "little") for i in range(len(chain), n)]
        return chain

    def _own_hits(self, r: SimRequest, tokens: int) -> list[int]:
        """Free cached blocks of the longest cached prefix of `r`'s `tokens` (never the last
        token: vLLM computes at least one)."""
        if not self.pool.prefix_caching:
            return []
        hits = []
        for b in self.pool.hits(self._chain(r, (tokens - 1) // self.layout.block_size),
                                (tokens - 1) // self.layout.block_size):
            if b not in self.pool.queue:  # held elsewhere (or a synthetic history's run)
                break
            hits.append(b)
        return hits

    def preempt(self, r: SimRequest) -> None:
        """vLLM's preemption: the request leaves the running batch, its blocks are freed
        (the full ones stay in the prefix cache, evictable, when decode caches prefixes) and
        it goes back to the front of the waiting queue. It never loads its KV again: as in
        the live connector, the rest of its life is the exchange's next attempt, computed
        here from its prompt and the tokens it generated so far."""
        env, bs = self.sim.env, self.layout.block_size
        local = next((p for p in self.prefilling if p.r is r), None)
        if local is not None:  # preempted during its local prefill: what it computed so far
            self.prefilling.remove(local)
            self.loading.discard(r.id)
            computed = local.done
        else:
            self.running.remove(r)
            computed = r.prompt + r.done_tokens
        self.preemptions += 1
        r.preemptions += 1
        self.preempted_in_step = True
        self.sim.rec(RequestPreempted(at=env.now, instance=self.name, request=r.id,
                                      attempt=r.attempt))
        entry = self.core.entries.get((r.id, r.attempt))
        if entry is not None and self.pool.prefix_caching:
            n = min(computed // bs, len(entry.blocks))
            self.pool.cache(self._chain(r, n), entry.blocks[:n])
        self.do(D.Finish(r.id, r.attempt))
        self.held.pop(r.id, None)
        r.attempt = rules.next_attempt(r.attempt)
        self.resuming.add(r.id)
        self.waiting.appendleft(r)

    def resume(self, r: SimRequest, blocks: tuple[int, ...], cached: int) -> None:
        """A preempted request is scheduled again: it computes what the prefix cache lost."""
        self.resuming.discard(r.id)
        self.loading.add(r.id)
        self.do(D.Allocate(r.id, r.attempt, blocks))
        self.recomputes.append((r, r.prompt + r.done_tokens - cached, cached,
                                "preempted: recompute"))
        self.poke()

    def admit(self, r: SimRequest, blocks: tuple[int, ...]) -> None:
        cfg, env = self.sim.cfg, self.sim.env
        self.loading.add(r.id)
        pf = self.sim.prefills[r.prefill]
        # decode has no local prefix hit here (its prefix cache is not modelled): the core rule
        # then loads the whole prompt into all of the request's blocks
        window = rules.decode_load(r.prompt, r.prompt, 0, self.layout.block_size)
        assert window is not None
        kv_blocks = window.dst(blocks)
        if cfg.mode == "push":
            events = self.do(D.ExpectKV(r.id, 0, r.prefill, kv_blocks, window.num_tokens,
                                        pf.layout, "push", timeout=cfg.kv_timeout))
            self.kv_deadline(r, env.now + cfg.kv_timeout)
            env.timeout(self.sim.costs.message_latency()).callbacks.append(
                lambda _: self._send_registration(r, events, pf))
        else:
            hold = pf.core.leases.leases.get(P.hold_lease_id(r.id, 0))
            events = self.do(D.ExpectKV(
                r.id, 0, r.prefill, kv_blocks, window.num_tokens, pf.layout, "pull",
                src_blocks=window.src(hold.blocks) if hold else (),
                src_expires_at=hold.expires_at if hold else env.now,
                read_margin=cfg.read_margin))
            for e in events:
                if isinstance(e, TransferPlanned):
                    r.runs = e.runs
                    self.pulls.append((r, e))
                    self.poke()
                elif isinstance(e, KVLoadFailed):
                    self.fallback(r)

    def kv_deadline(self, r: SimRequest, at: float) -> None:
        # the timer holds the request's id, not the request: nearly every request has
        # finished long before its deadline (480 s by default), and a finished request's
        # record (its hashes, its token gaps) should go then, not with the timer
        rid = r.id

        def fire(_: Any) -> None:
            if self.core.phase(rid, 0) in ("awaiting_kv", "aborting"):
                for e in self.do(D.Tick()):
                    if isinstance(e, KVLoadFailed) and e.request == rid:
                        self.fallback(self.sim.requests[rid])

        self.sim.env.timeout(max(at - self.sim.env.now, 0.0)).callbacks.append(fire)

    def _send_registration(self, r: SimRequest, events: list[Event],
                           pf: PrefillInstance) -> None:
        """The registration reaches prefill (a message's latency after `admit`)."""
        for e in events:
            if isinstance(e, RegistrationSent):
                pf.on_registration(r, e, self.layout)

    def on_notifications(self, r: SimRequest) -> None:
        pf = self.sim.prefills[r.prefill]
        # every stream's notification, in the fan-out's order, as one core call
        for e in self.do(D.NotifyMany(r.id, 0, _streams(pf.layout, self.layout))):
            if isinstance(e, KVReceived):
                self.kv_ready(r)

    def kv_ready(self, r: SimRequest) -> None:
        """The KV is in decode's blocks. vLLM learns it from the worker's finished receives
        in the next step's output and schedules the request in the step after: one step
        passes (an empty one when nothing runs) before the request joins the batch."""
        r.kv_ready = self.sim.env.now
        self.loading.discard(r.id)

        def join(_: Any = None) -> None:
            self.joining.append(r)
            self.poke()

        costs = self.sim.costs
        if self.running:  # the step that reports it: one of the running batch
            ctx = sum(q.prompt + q.done_tokens for q in self.running)
            wait = costs.decode_step_time(len(self.running), ctx)
        else:  # an empty step: no forward pass, only the step's fixed part
            wait = costs.empty_step_time()
        # KV received -> first token at the client is one hop on a shared host: this wait,
        # the request's first step and the response leg, slowed together
        step, leg = costs.decode_step_time(1, r.prompt), costs.response_leg()
        notice = self.sim.hop(wait + step + leg, "first_token", r) - step - leg
        self.sim.env.timeout(max(notice, 0.0)).callbacks.append(join)

    def fallback(self, r: SimRequest) -> None:
        """The KV will not come: decode computes the prompt itself (in chunks mixed into its
        steps, `_chunks`); the request is still served, and the core's KVLoadFailed records
        why. As in the live connector, the local compute is the exchange's next attempt
        (`next_attempt`): the failed attempt's books end and its blocks are taken again for
        the compute."""
        if self.core.phase(r.id, r.attempt) == "decoding":
            self.do(D.Finish(r.id, r.attempt))
        r.attempt = rules.next_attempt(r.attempt)
        blocks = self.pool.take(self.held.get(r.id, 0))
        assert blocks is not None, "the blocks just freed are free"
        self.do(D.Allocate(r.id, r.attempt, blocks))
        self.recomputes.append((r, r.prompt, 0, "KV load failed: local prefill"))
        self.poke()

    def pull_read(self, r: SimRequest, plan: TransferPlanned) -> None:
        """Decode's READ of prefill's blocks: the connector's set-up, prefill's link (one
        transfer at a time), then the read's end told to decode's core and, a message later,
        to prefill's. Callbacks on the SimPy events, not a process (the same events at the
        same times, without a process's start, resumptions and end)."""
        env, costs = self.sim.env, self.sim.costs
        pf = self.sim.prefills[r.prefill]
        r.transfer_start = env.now
        wire = costs.transfer_time(plan.bytes, plan.descriptors, plan.expected_notifications)
        setup = costs.transfer_setup()
        if setup <= 0:
            self._pull_wire(r, pf, wire)
            return
        # the connector's own work (pin, prepare, post, poll): not the link's
        whole = self.sim.hop(setup + wire, "transfer", r)
        env.timeout(max(whole - wire, 0.0)).callbacks.append(
            lambda _: self._pull_wire(r, pf, min(wire, whole)))

    def _pull_wire(self, r: SimRequest, pf: PrefillInstance, wire: float) -> None:
        env = self.sim.env
        link = pf.nic.request()

        def read(_: Any) -> None:
            env.timeout(wire).callbacks.append(done)

        def done(_: Any) -> None:
            pf.nic.release(link)
            r.transfer_end = env.now
            hold_alive = P.hold_lease_id(r.id, 0) in pf.core.leases.leases
            for e in self.do(D.PullDone(r.id, 0, ok=hold_alive,
                                        reason="" if hold_alive else "prefill's hold expired")):
                if isinstance(e, KVReceived):
                    self.kv_ready(r)
                elif isinstance(e, KVLoadFailed):
                    self.fallback(r)
            env.timeout(self.sim.costs.message_latency()).callbacks.append(
                lambda _: pf.do(P.PullReadDone(r.id, 0)))

        link.callbacks.append(read)

    def read_on_thread(self, r: SimRequest, plan: TransferPlanned, prep: float) -> None:
        """The READ prepared on decode's reader thread (one at a time), then issued."""
        env = self.sim.env
        slot = self.reader.request()

        def prepared(_: Any) -> None:
            self.reader.release(slot)
            self.pull_read(r, plan)

        slot.callbacks.append(lambda _: env.timeout(prep).callbacks.append(prepared))

    def loop(self) -> Iterator[Any]:
        env, cfg, costs = self.sim.env, self.sim.cfg, self.sim.costs
        while True:
            self.running.extend(self.joining)  # admission already bounded them
            self.joining.clear()
            stall = 0.0
            while self.pulls:
                r, plan = self.pulls.popleft()
                prep = costs.descriptor_prep_time(plan.descriptors, inline=True)
                prep += self.connect(r.prefill)
                if cfg.pull_reader_thread:
                    self.read_on_thread(r, plan, prep)
                    continue
                stall += prep  # inline: this step waits for it, and so does every request
                self.sim.rec(EngineStalled(at=env.now, instance=self.name, request=r.id,
                                           seconds=prep, cause="pull descriptor preparation"))
                env.timeout(prep).callbacks.append(
                    lambda _, r=r, plan=plan: self.pull_read(r, plan))
            while self.recomputes:
                r, new, cached, why = self.recomputes.popleft()
                self.prefilling.append(LocalPrefill(r, new, cached, why))
            survey = self.make_room()
            if not self.running and not self.prefilling:
                if stall:
                    yield env.timeout(stall)
                    continue
                self._rearm()
                yield self.wake
                continue
            batch = len(self.running)
            _, ctx, least, growing = survey
            chunks = self._chunks()
            if chunks:  # one step mixing the decodes with local prefill chunks
                k, crossings = self._fit(1, growing)
                durations = [costs.mixed_step_time([(n, p.done) for p, n in chunks],
                                                   [r.prompt + r.done_tokens
                                                    for r in self.running])]
                extra = durations[0] - (costs.decode_step_time(batch, ctx) if batch else 0.0)
                total = sum(n for _, n in chunks)
                for p, n in chunks:  # what the chunk adds to the step the batch waits for
                    self.sim.rec(EngineStalled(at=env.now, instance=self.name,
                                               request=p.r.id, seconds=extra * n / total,
                                               cause=p.why))
            else:
                k, crossings = self._fit(least, growing)
                durations = costs.decode_step_times(batch, ctx, k)
            if self.sim.slowed_steps:  # a shared host: each step slowed by its own draw,
                # but a joining request's first step, which its first_token hop covers
                fresh = any(r.done_tokens == 0 for r in self.running)
                durations = [d if i == 0 and fresh else self.sim.hop(d, "decode_step")
                             for i, d in enumerate(durations)]
            start = env.now
            # each step's end from the first's start: `ends[-1]` is `sum(durations)`, bit
            # for bit (the same additions in the same order)
            ends = list(itertools.accumulate(durations))
            self.plan = (start + stall, ends, crossings)
            if self.preempted_in_step:
                self.admit_after = start + stall + durations[0]
                self.preempted_in_step = False
            self._rearm()
            timer = env.timeout(stall + ends[-1])
            yield timer | self.wake
            steps = k
            if not timer.processed:
                # woken early: finish the step in progress (the first to end now or later),
                # then let the batch change
                now, base = env.now, start + stall
                steps = min(bisect.bisect_left(ends, now, key=lambda e: base + e) + 1, k)
                acc = ends[steps - 1]
                if base + acc > now:
                    yield env.timeout(base + acc - now)
            self._advance(steps, durations, stall, start)
            self._advance_chunks(chunks)

    def _chunks(self) -> list[tuple[LocalPrefill, int]]:
        """This step's local prefill chunks: the decodes take one token each of the step's
        budget (`max_num_batched_tokens`), the prefills what is left, oldest first."""
        budget = self.sim.cfg.max_num_batched_tokens - len(self.running)
        out = []
        for p in self.prefilling:
            if budget <= 0:
                break
            n = min(p.left, budget)
            out.append((p, n))
            budget -= n
        return out

    def _advance_chunks(self, chunks: list[tuple[LocalPrefill, int]]) -> None:
        """The step computed these chunks; a prefill it completed samples a token (the first,
        or a preempted request's next) and the request joins the running batch."""
        env, leg = self.sim.env, self.sim.costs.response_leg()
        for p, n in chunks:
            p.left -= n
            p.done += n
            if p.left > 0:
                continue
            self.prefilling.remove(p)
            r = p.r
            self.loading.discard(r.id)
            if r.done_tokens == 0:
                r.first_token = env.now + leg
                self.sim.rec(FirstTokenEmitted(at=r.first_token, instance=self.name,
                                               request=r.id, ttft=r.first_token - r.arrival))
            else:  # the gap since its last token, preempted time included
                r.itl.append((env.now - r.last_token, 1))
            r.done_tokens += 1
            r.last_token = env.now
            if r.done_tokens >= r.output:
                r.finish = env.now + leg
                self.finish(r)
            else:
                self.running.append(r)

    def _crossings(self, r: SimRequest, steps: int) -> list[int]:
        """The steps (1-based, up to `steps`) at which `r` needs a new block."""
        bs = self.layout.block_size
        held = self.held.get(r.id, 0)
        final = -(-(r.prompt + r.output) // bs)
        if held >= final:
            return []
        # step i writes token position prompt + done + i - 1: a block boundary every bs steps
        first = max(held * bs - (r.prompt + r.done_tokens) + 1, 1)
        return list(range(first, steps + 1, bs)[:final - held])

    def _next_takes(self, r: SimRequest) -> int:
        """1 when `r`'s next step needs a new block (`_crossings(r, 1)` not empty), else 0."""
        bs = self.layout.block_size
        held = self.held.get(r.id, 0)
        return int(held * bs <= r.prompt + r.done_tokens
                   and held < -(-(r.prompt + r.output) // bs))

    def _survey(self) -> tuple[int, int, int, list[tuple[int, int, int]]]:
        """One pass over the running batch: how many of its requests need a block at their
        next step (`_next_takes`), its context tokens, the fewest tokens any request has
        left to generate, and for each request that will still take blocks its place in the
        batch, the step (1-based) of its next block and how many blocks it has yet to take
        (`_crossings`)."""
        bs, held_of = self.layout.block_size, self.held.get
        wanted = ctx = 0
        least = -1
        growing = []
        for i, r in enumerate(self.running):
            done = r.prompt + r.done_tokens
            ctx += done
            left = r.output - r.done_tokens
            if least < 0 or left < least:
                least = left
            held = held_of(r.id, 0)
            final = -(-(r.prompt + r.output) // bs)
            if held < final:
                # step i writes token position done + i - 1: a block boundary every bs steps
                first = held * bs - done + 1
                if first <= 1:
                    first = 1
                    wanted += 1
                growing.append((i, first, final - held))
        return wanted, ctx, least, growing

    def make_room(self) -> tuple[int, int, int, list[tuple[int, int, int]]]:
        """vLLM's step, running requests first, in order: each gets the block its next token
        needs; when the pool has none (after evicting retained KV, oldest first), the last
        running request is preempted, until the block is there or the request itself was
        the one preempted (vLLM's FCFS policy; prefix-cached free blocks count as free).
        Requests computing a local prefill joined the running list last: they go first.
        Returns `_survey` of the running batch as it leaves it."""
        survey = self._survey()
        pool, need, i = self.pool, 0, 0
        free = pool.free  # read again whenever a release or a preemption gives blocks back
        if survey[0] <= free:  # the usual case: every next block is free (the walk below
            return survey      # has no effect before it meets a shortfall)
        while i < len(self.running):
            r = self.running[i]
            n = self._next_takes(r)
            while need + n > free:
                if self.retained:
                    lease, _ = self.retained.popitem(last=False)
                    self.do(Release(lease, "evicted under memory pressure"))
                    free = pool.free
                    continue
                victim = self.prefilling[-1].r if self.prefilling else self.running[-1]
                self.preempt(victim)
                free = pool.free
                if victim is r:
                    break
            else:
                need += n
                i += 1
        return self._survey()

    def _fit(self, k: int, growing: list[tuple[int, int, int]]) -> tuple[int, list[int]]:
        """At most `k` steps, no more than the pool's free blocks can serve (the step that
        would need one more ends the macro-step, and `make_room` preempts at its start), and
        the steps at which they take a block (`growing`: `_survey`'s)."""
        # (index in the running batch, its crossings), kept for `grow`
        bs = self.layout.block_size
        per = [(i, list(range(first, k + 1, bs)[:left])) for i, first, left in growing
               if first <= k]
        self._per = (self.running, len(self.running), per)
        steps = sorted(itertools.chain.from_iterable(c for _, c in per))
        if len(steps) > self.pool.free:
            k = steps[self.pool.free] - 1  # make_room left every step-1 block free: k >= 1
            return k, steps[:bisect.bisect_right(steps, k)]
        return k, steps

    def _in_flight(self) -> int:
        """Blocks the macro-step under way has taken by now in vLLM's terms (every step begun
        has its blocks), which the driver takes when the macro-step ends (`grow`)."""
        if self.plan is None:
            return 0
        t0, ends, steps = self.plan
        begun = bisect.bisect_right(ends, self.sim.env.now - t0) + 1
        return bisect.bisect_right(steps, begun)

    def grow(self, steps: int) -> None:
        """The running requests' output blocks, taken as their tokens cross block boundaries
        over `steps` steps, in the order the steps cross them (so requests interleave)."""
        pool, running = self.pool, self.running
        planned, self._per = self._per, None
        if planned is not None and planned[0] is running and planned[1] == len(running):
            per = planned[2]  # `_fit`'s crossings (up to at least `steps`): the batch is as it was
        else:
            per = [(k, self._crossings(r, steps)) for k, r in enumerate(running)]
        crossings = [(i, k) for k, c in per for i in c[:bisect.bisect_right(c, steps)]]
        self.plan = None
        if not crossings:
            return
        crossings.sort()  # by step, then by place in the batch
        got: dict[int, list[int]] = {}
        taken = pool.take(len(crossings))
        assert taken is not None, "decode growth found fewer free blocks than it planned"
        for (_, k), b in zip(crossings, taken, strict=True):
            got.setdefault(k, []).append(b)
        allocations = []
        held = self.held
        for k in sorted(got):  # the growing requests, in batch order
            r, new = running[k], got[k]
            held[r.id] = held.get(r.id, 0) + len(new)
            allocations.append(D.Allocate(r.id, r.attempt, tuple(new)))
        self.do(D.AllocateMany(tuple(allocations)))  # one core call, an event per request

    def _advance(self, steps: int, durations: list[float], stall: float, start: float) -> None:
        now = self.sim.env.now
        self.grow(steps)
        first_end = start + stall + durations[0]
        rest = sum(durations[1:steps])
        still: list[SimRequest] = []
        leg = self.sim.costs.response_leg()  # tokens reach the client through the router
        # every request in the batch saw the same gaps: one (gap, tokens) pair each, shared
        gap = (stall + durations[0], 1)
        tail = (rest / (steps - 1), steps - 1) if steps > 1 else None
        for r in self.running:
            itl = r.itl
            if r.done_tokens == 0:
                r.first_token = first_end + leg
                if self.sim.recording:
                    self.sim.rec(FirstTokenEmitted(at=r.first_token, instance=self.name,
                                                   request=r.id,
                                                   ttft=r.first_token - r.arrival))
            else:
                itl.append(gap)
            if tail is not None:
                itl.append(tail)
            if stall:  # (adding 0.0 changes no sum of non-negative stalls)
                r.stall_s += stall
            done = r.done_tokens = r.done_tokens + steps
            r.last_token = now
            if done >= r.output:
                r.finish = now + leg
                self.finish(r)
            else:
                still.append(r)
        self.running = still

    def finish(self, r: SimRequest) -> None:
        cfg = self.sim.cfg
        self.held.pop(r.id, None)
        retain = None
        # the router's wish for this request, decode's default (kvplane's: off), the core rules
        mode = "bidirectional" if cfg.bidirectional else cfg.mode
        wish = router_rules.asks_retain(mode, r.conversation is not None) or None
        if rules.retain_decision(wish, False, has_blocks=True):
            retain = D.Retain(f"{r.id}/kv", rules.retain_ttl(cfg.ttl, None), cfg.renewable,
                              r.prompt + r.output, hex_chain(r.retained_hashes))
        stored = False
        for e in self.do(D.Finish(r.id, r.attempt, retain)):
            if isinstance(e, LeaseGranted):
                self.retained[e.lease] = None
                self.expire_at(e.lease, e.expires_at)
                self.sim.router.store(r, e)
                stored = True
        self.sim.router.turn_ended(r, stored)
        leg = self.sim.costs.response_leg()  # the client sees the end that much later
        if leg > 0:
            self.sim.env.timeout(leg).callbacks.append(lambda _: self.sim.finished(r))
        else:
            self.sim.finished(r)
        self.on_freed()

    def do(self, cmd: Any) -> list[Event]:
        """`Instance.do`, and a lease that ended leaves `retained` (one pass over the events;
        event types are final, so the type names the event)."""
        events = self.sim.do(self.core, cmd)
        freed = False
        for e in events:
            kind = type(e)
            if kind is BlocksFreed:
                if e.instance == self.name:
                    self.pool.give(e.blocks)
                    freed = True
            elif kind is LeaseExpired or kind is LeaseReleased:
                self.retained.pop(e.lease, None)
        if freed:
            self.on_freed()
        return events


class Router:
    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.table = S.SessionTable("router", sim.cfg.decode_layout.block_size)
        self.rr_p = itertools.count()
        self.rr_d = itertools.count()
        by_name = sorted(sim.prefills.values(), key=lambda p: p.name)
        self._prefill_names = [p.name for p in by_name]

        def rank(i: int) -> tuple[int, int, str]:
            p = by_name[i]
            return len(p.running) + p.loading + len(p.queue), 0, p.name

        self._prefill_rank = rank
        self.affinity: dict[tuple[str, str], str] = {}
        self._decode_parts: list[tuple[Any, ...]] | None = None  # see `pick_decode`
        self.last_finish: dict[tuple[str, str], float] = {}

    def arrive(self, r: SimRequest) -> None:
        sim = self.sim
        if sim.recording:
            sim.rec(RequestArrived(at=sim.env.now, instance="router", request=r.id,
                                   prompt_tokens=r.prompt, output_tokens=r.output,
                                   conversation=r.conversation, tenant=r.tenant, turn=r.turn))
        self.dispatch(r)

    def dispatch(self, r: SimRequest) -> None:
        sim, cfg = self.sim, self.sim.cfg
        r.dispatched = sim.env.now
        if cfg.prefill_policy.kind == "least_loaded":
            # prefill ranks by requests alone: the first idle instance in turn order is the
            # choice, so the core asks instances one by one and stops there
            r.prefill = choose_scanning(cfg.prefill_policy, self._prefill_names,
                                        self._prefill_rank, next(self.rr_p), (0, 0))
        else:
            loads = [(len(p.running) + p.loading + len(p.queue), 0, p.name)
                     for p in sim.prefills.values()]
            r.prefill = choose_ranked(cfg.prefill_policy, loads, next(self.rr_p))
        if cfg.mode == "push":  # decode chosen up front; both legs leave at once
            r.decode = self.pick_decode(r)
            if sim.recording:
                sim.rec(RequestRouted(at=sim.env.now, instance="router", request=r.id,
                                      mode="push", prefill=r.prefill, decode=r.decode,
                                      bidirectional=cfg.bidirectional))
            sim.prefills[r.prefill].submit(r)
            sim.decodes[r.decode].submit(r)
        else:
            sim.prefills[r.prefill].submit(r)

    def pick_decode(self, r: SimRequest) -> str:
        aff = self.affinity.get((r.tenant, r.conversation or ""))
        parts = self._decode_parts
        if parts is None:
            decodes = list(self.sim.decodes.values())
            if all(d.pool.ring is None for d in decodes):
                # the containers a decode's load counts (all but `running`, which a
                # macro-step replaces) and its free queue's two parts: made once, read per
                # request without a property call per instance (32 a request in a cluster)
                parts = self._decode_parts = [
                    (d, d.loading, d.joining, d.waiting, d.pool.queue.unhashed,
                     d.pool.queue.lru, d.name) for d in decodes]
            else:
                parts = self._decode_parts = []
        if parts:
            loads = [(len(d.running) + len(lo) + len(jo) + len(wa), -(un.count + lru.count),
                      name) for d, lo, jo, wa, un, lru, name in parts]
        else:
            loads = [(len(d.running) + len(d.loading) + len(d.joining) + len(d.waiting),
                      -d.pool.free, d.name) for d in self.sim.decodes.values()]
        return choose_ranked(self.sim.cfg.decode_policy, loads, next(self.rr_d), aff)

    def relay_metadata(self, pf: PrefillInstance, r: SimRequest) -> None:
        self.sim.env.process(self._relay(pf, r))

    def _relay(self, pf: PrefillInstance, r: SimRequest) -> Iterator[Any]:
        sim = self.sim
        # prefill's answer comes back through the router (`response_leg`)
        yield sim.env.timeout(sim.costs.message_latency()
                              + sim.hop(sim.costs.response_leg(), "response_leg", r))
        r.prefill_answered = sim.env.now
        r.decode = self.pick_decode(r)  # pull: decode chosen after prefill, freshest load
        hold_id = P.hold_lease_id(r.id, 0)
        hold = pf.core.leases.leases.get(hold_id)
        sim.rec(RequestRouted(at=sim.env.now, instance="router", request=r.id, mode="pull",
                              prefill=r.prefill, decode=r.decode,
                              bidirectional=sim.cfg.bidirectional))
        sim.rec(MetadataRelayed(at=sim.env.now, instance="router", request=r.id, attempt=0,
                                prefill=r.prefill, decode=r.decode,
                                src_blocks=hold.blocks if hold else (), num_tokens=r.prompt))
        self.hold_heartbeats(pf, r, hold_id)
        yield sim.env.timeout(sim.costs.message_latency())
        sim.decodes[r.decode].submit(r)

    def hold_heartbeats(self, pf: PrefillInstance, r: SimRequest, hold_id: str) -> None:
        """Decode keeps prefill's hold alive while the request waits for its read."""
        cfg, env = self.sim.cfg, self.sim.env

        def beat(_: Any) -> None:
            if hold_id not in pf.core.leases.leases or r.transfer_start >= 0:
                return
            for e in pf.do(Heartbeat(hold_id, cfg.hold_extension)):
                if isinstance(e, LeaseRenewed):
                    pf.expire_at(hold_id, e.expires_at)
            env.timeout(cfg.hold_heartbeat).callbacks.append(beat)

        env.timeout(cfg.hold_heartbeat).callbacks.append(beat)

    def store(self, r: SimRequest, g: LeaseGranted) -> None:
        assert r.conversation is not None
        key = (r.tenant, r.conversation)
        h = RetainedHandle(g.instance, g.lease, g.num_tokens, self.table.block_size,
                           g.block_hashes, g.expires_at)
        for e in self.sim.do(self.table, S.Store(r.tenant, r.conversation, h, r.id)):
            if isinstance(e, SessionDropped):
                for d in self.sim.decodes.values():
                    if e.lease in d.core.leases.leases:
                        d.do(Release(e.lease, "replaced by a newer turn"))
        self.affinity[key] = g.instance
        self.last_finish[key] = self.sim.env.now
        if self.sim.cfg.renewable:
            self.heartbeats(r.tenant, r.conversation, g.lease, g.instance)

    def heartbeats(self, tenant: str, conv: str, lease: str, decode: str) -> None:
        """While a conversation is active, the router keeps its retained KV alive; it stops
        once the conversation has been idle `idle_after` seconds, so decode reclaims early."""
        sim, cfg = self.sim, self.sim.cfg
        d = sim.decodes[decode]

        def beat(_: Any) -> None:
            h = self.table.handle_of(tenant, conv)
            if h is None or h.lease != lease:
                return
            if sim.env.now - self.last_finish.get((tenant, conv), 0.0) > cfg.idle_after:
                return
            for e in d.do(Heartbeat(lease, cfg.heartbeat_extension)):
                if isinstance(e, LeaseRenewed):
                    sim.do(self.table, S.Renew(tenant, conv, e.expires_at, lease))
                    d.expire_at(lease, e.expires_at)
            sim.env.timeout(cfg.heartbeat_interval).callbacks.append(beat)

        sim.env.timeout(cfg.heartbeat_interval).callbacks.append(beat)

    def reuse(self, pf: PrefillInstance, r: SimRequest, local_hit: int) -> Iterator[Any]:
        """Bidirectional: take the conversation's handle, let prefill decide, read D->P."""
        sim, cfg, env = self.sim, self.sim.cfg, self.sim.env
        assert r.conversation is not None
        handle = self.table.handle_of(r.tenant, r.conversation)
        taken = sim.do(self.table, S.Take(r.tenant, r.conversation, r.id))
        if not any(isinstance(e, SessionTaken) for e in taken):
            handle = None
        d = sim.decodes[handle.decode] if handle is not None else None
        estimate = self.read_estimate(pf, d, handle.num_tokens) if handle and d else 0.0
        decision = pf.do(P.DecideReuse(r.id, 0, handle, hex_chain(r.hashes), r.prompt,
                                       local_hit, cfg.recompute_threshold, estimate,
                                       cfg.read_margin))[0]
        assert isinstance(decision, ReuseDecided)
        r.reuse_outcome = decision.outcome
        r.taken = handle  # given back or released when the turn ends (Router.turn_ended)
        if decision.outcome != "read" or handle is None or d is None:
            return local_hit
        pin = d.do(BeginRead(handle.lease, r.id, estimate, cfg.read_margin))
        if not any(isinstance(e, LeasePinned) for e in pin):
            r.reuse_outcome = "refused"
            return local_hit
        lease = d.core.leases.leases[handle.lease]
        src, dst = rules.reuse_read(lease.blocks, pf.blocks[r.id], local_hit,
                                    decision.remote_tokens, d.layout.block_size)
        start = env.now
        events = pf.do(P.StartReuseRead(r.id, 0, handle, src, d.layout,
                                        decision.remote_tokens, dst_blocks=dst))
        plan = next(e for e in events if isinstance(e, TransferPlanned))
        r.read_runs, r.read_blocks = plan.runs, len(src)
        descriptors = plan.descriptors
        if cfg.reuse_read_run_blocks is not None:  # retained blocks scattered by churn
            runs = max(1, round(len(src) / cfg.reuse_read_run_blocks))
            descriptors = runs * d.layout.num_layers * 2 * plan.expected_notifications
        prep = sim.costs.descriptor_prep_time(descriptors, inline=False)
        yield env.timeout(pf.connect(d.name) + prep
                          + sim.hop(sim.costs.reuse_read_setup() + sim.costs.transfer_setup(),
                                    "transfer", r))
        with d.nic.request() as link:
            yield link
            yield env.timeout(sim.costs.transfer_time(plan.bytes, descriptors,
                                                      plan.expected_notifications))
        pf.do(P.ReuseReadDone(r.id, 0))
        d.do(EndRead(handle.lease, r.id))
        r.reuse_read_s = env.now - start
        return max(local_hit, decision.matched_tokens)

    def turn_ended(self, r: SimRequest, stored: bool) -> None:
        """The handle the turn took: released, put back or let run out, as the live router
        does (`router_rules.after_turn`)."""
        taken, r.taken = r.taken, None
        if taken is None or r.conversation is None:
            return
        current = self.table.handle_of(r.tenant, r.conversation)
        action = router_rules.after_turn(
            stored_new=stored, taken_lease=taken.lease,
            current_lease=current.lease if current else None,
            taken_expires_at=taken.expires_at, now=self.sim.env.now)
        d = self.sim.decodes.get(taken.decode)
        if action == "release" and d is not None and taken.lease in d.core.leases.leases:
            d.do(Release(taken.lease, "superseded"))
        elif action == "put_back":
            self.sim.do(self.table, S.Store(r.tenant, r.conversation, taken, r.id))

    def read_estimate(self, pf: PrefillInstance, d: DecodeInstance, tokens: int) -> float:
        """An upper bound of the read's time, so the lease check errs on the safe side."""
        lay = d.layout
        nbytes = tokens * lay.num_layers * 2 * lay.num_kv_heads * lay.head_bytes
        desc = -(-tokens // lay.block_size) * lay.num_layers * 2 * max(pf.layout.tp, lay.tp)
        c = self.sim.costs
        return (c.reuse_read_setup() + c.transfer_setup()
                + c.descriptor_prep_time(desc, inline=False)
                + c.transfer_time(nbytes, desc, max(pf.layout.tp, lay.tp)))


class Simulation:
    def __init__(self, cfg: EngineConfig, costs: Costs, record: Record | None = None) -> None:
        self.cfg, self.costs = cfg, costs
        self.env = simpy.Environment()
        self.rec: Record = record or ignore
        self._host_quantiles = costs.host_slowdown_quantiles()
        self._host_bins = costs.host_state_bins()
        self._host_timeline: HostTimeline | None = None
        self.slowed_steps = "decode_step" in self._host_quantiles
        self._host_rng = np.random.default_rng(self.seed_for("host"))
        # one request's hops share a factor of their slowdown (a Gaussian copula): weights
        # of the shared and of each hop's own standard normal draw
        rho = costs.host_hop_correlation()
        self._host_shared, self._host_own = math.sqrt(rho), math.sqrt(1.0 - rho)
        self.requests: dict[str, SimRequest] = {}
        self.done: list[SimRequest] = []
        self.finished_count = 0
        # where finished requests go instead of `done` (a streaming summary keeps aggregates,
        # so memory stays flat over a long run)
        self.sink: Callable[[SimRequest], None] | None = None
        self.prefills = {f"prefill-{i}": PrefillInstance(self, f"prefill-{i}")
                         for i in range(cfg.num_prefill)}
        self.decodes = {f"decode-{i}": DecodeInstance(self, f"decode-{i}")
                        for i in range(cfg.num_decode)}
        self.router = Router(self)

    def follow_host(self, timeline: HostTimeline) -> None:
        """Draw each hop's slowdown given the host's state at its simulated time: `timeline`
        holds the run queue sampled during the recorded run being simulated, its times in
        simulated seconds. Without it, or with a calibration that has no `host_state`, a
        hop draws from all the factors of its kind."""
        self._host_timeline = timeline

    def hop(self, cost: float, kind: str, r: SimRequest | None = None) -> float:
        """How long a hop of priced `cost` takes on the host: the cost itself on a dedicated
        host; on a shared one, slowed by one draw of the calibration's slowdown of hops of
        that kind (request_leg, response_leg, prefill_step, transfer, first_token,
        decode_step): of those recorded while the host's run queue was in the bin it is in
        now (`follow_host`), or of all of them. The hops of one request `r` draw alike as the
        calibration's `host_hop_correlation` says: the probability a hop draws at is the
        normal CDF of the request's shared factor and the hop's own, weighted by it."""
        q = self._host_quantiles.get(kind, ())
        if not q or cost <= 0:
            return cost
        if self._host_bins is not None and self._host_timeline is not None:
            _, edges, tables = self._host_bins
            if kind in tables:
                q = tables[kind][state_bin(edges, self._host_timeline.at(self.env.now))]
        # inverse CDF of the recorded factors, the i-th at probability (i + 1/2) / n and
        # linear between them: each factor weighs 1/n, the extremes too, so the draws' mean
        # is the recorded one (at probabilities i / (n - 1) the two extremes weighed half, and
        # one 15 s stall among 192 recorded answers lost half its weight in the twin)
        if r is not None and self._host_shared > 0.0:
            z = r.host_z
            if math.isnan(z):  # the request's first hop draws its shared factor
                z = r.host_z = float(self._host_rng.standard_normal())
            mixed = self._host_shared * z + self._host_own * self._host_rng.standard_normal()
            u = 0.5 * (1.0 + math.erf(mixed / _SQRT2))
        else:
            u = self._host_rng.random()
        x = u * len(q) - 0.5
        if x <= 0.0:
            return cost * q[0]
        i = int(x)
        if i >= len(q) - 1:
            return cost * q[-1]
        return cost * (q[i] + (q[i + 1] - q[i]) * (x - i))

    def seed_for(self, name: str) -> int:
        return (self.cfg.seed * 1_000_003 + sum(map(ord, name))) % (2**32)

    @property
    def recording(self) -> bool:
        return self.rec is not ignore

    def do(self, machine: Any, cmd: Any) -> list[Event]:
        events: list[Event] = machine.handle(cmd, self.env.now)
        if self.rec is not ignore:
            for e in events:
                self.rec(e)
        return events

    def submit(self, r: SimRequest) -> None:
        self.requests[r.id] = r
        self.router.arrive(r)

    def finished(self, r: SimRequest) -> None:
        self.requests.pop(r.id, None)
        self.finished_count += 1
        if self.sink is None:
            self.done.append(r)
        else:
            self.sink(r)
        if self.rec is not ignore:
            self.rec(RequestFinished(
                at=r.finish, instance=r.decode, request=r.id, output_tokens=r.output,
                ttft=r.first_token - r.arrival,
                tpot=(r.finish - r.first_token) / max(r.output - 1, 1),
                e2e=r.finish - r.arrival, ok=r.ok))
        if r.on_done is not None:
            r.on_done(r)

    def drain(self) -> None:
        """Run on until every lease and hold has ended: the run is then quiescent."""
        horizon = self.env.now + max(self.cfg.ttl, self.cfg.hold_ttl) + 1.0
        self.env.run(until=horizon)
        for inst in [*self.prefills.values(), *self.decodes.values()]:
            inst.do(LeaseTick())
