"""Workloads: request arrival records, generated from a seed or read from a trace.

Rules kept here:
- Deterministic: the same workload, request count and seed give the same requests, bit for
  bit (numpy `default_rng(seed)`, draws in a fixed order). Nothing reads a clock.
- Columnar and vectorised: a workload is generated as numpy arrays (`RequestBatch`) and
  `Request` records are made only when iterated, so 100,000 multi-turn requests cost a few
  tenths of a second.
- Records are in arrival order and `rid` is the position in that order. Multi-turn turns
  after the first carry `previous` (the rid of the turn before) and `think_time`; their
  `arrival` is the open-loop lower bound (conversation start + think times). A closed-loop
  driver releases turn k at (finish of turn k-1) + think_time instead.
- Prompt content is described, not materialised: a prompt is the first `prompt_tokens` tokens
  of an append-only token stream (a conversation's history), optionally starting with a stream
  shared by many prompts (system prompt, common prefix); trace prompts carry Mooncake hash ids.
  `block_hashes` turns that into one 64-bit hash per full KV block, chained in meaning: two
  prompts share block j exactly when they share every token up to the end of block j. That is
  what prefix verification compares; a conversation id alone proves nothing.
- A bad trace line raises ScenarioError naming file:line, the field and what was expected.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .config import LengthSpec, MultiTurnWorkload, PoissonWorkload, TraceWorkload
from .profiles import ScenarioError

if TYPE_CHECKING:
    from .config import Point

__all__ = [
    "Request",
    "RequestBatch",
    "block_hashes",
    "generate",
    "hash_strings",
    "matching_prefix_blocks",
    "multi_turn",
    "poisson",
    "read_trace",
    "requests_for_point",
    "sample_lengths",
]

SHARED_STREAM = 1      # the stream every shared prefix comes from
FIRST_PRIVATE = 2      # private streams are FIRST_PRIVATE + index
_TRACE_SALT = np.uint64(1 << 62)
_U64 = np.uint64


# --- records ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """One request as it arrives at the router."""

    rid: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    conversation: int | None = None
    turn: int = 0
    think_time: float = 0.0
    previous: int | None = None
    shared_stream: int = 0
    shared_tokens: int = 0
    stream: int = 0
    hash_ids: tuple[int, ...] = ()
    hash_block: int = 0

    @property
    def request_id(self) -> str:
        """The id drivers hand to the core and the event log."""
        return f"req-{self.rid}"

    @property
    def conversation_id(self) -> str | None:
        return None if self.conversation is None else f"conv-{self.conversation}"

    def block_hashes(self, block_size: int, tokens: int | None = None) -> np.ndarray:
        """One uint64 hash per full block of the prompt (see `block_hashes`)."""
        return block_hashes(self, block_size, tokens)


@dataclass(frozen=True)
class RequestBatch:
    """A workload as columns (all arrays have one entry per request, in arrival order)."""

    arrival: np.ndarray        # float64 [s]
    prompt_tokens: np.ndarray  # int64
    output_tokens: np.ndarray  # int64
    conversation: np.ndarray   # int64, -1 = none
    turn: np.ndarray           # int64
    think_time: np.ndarray     # float64 [s]
    previous: np.ndarray       # int64, -1 = none
    shared_stream: np.ndarray  # int64, 0 = none
    shared_tokens: np.ndarray  # int64
    stream: np.ndarray         # int64
    hash_ids: tuple[tuple[int, ...], ...] | None = None
    hash_block: int = 0

    def __len__(self) -> int:
        return int(self.arrival.shape[0])

    def __getitem__(self, i: int) -> Request:
        conv = int(self.conversation[i])
        prev = int(self.previous[i])
        return Request(
            rid=i,
            arrival=float(self.arrival[i]),
            prompt_tokens=int(self.prompt_tokens[i]),
            output_tokens=int(self.output_tokens[i]),
            conversation=None if conv < 0 else conv,
            turn=int(self.turn[i]),
            think_time=float(self.think_time[i]),
            previous=None if prev < 0 else prev,
            shared_stream=int(self.shared_stream[i]),
            shared_tokens=int(self.shared_tokens[i]),
            stream=int(self.stream[i]),
            hash_ids=self.hash_ids[i] if self.hash_ids is not None else (),
            hash_block=self.hash_block,
        )

    def __iter__(self) -> Iterator[Request]:
        # tolist() once per column is far cheaper than numpy scalar access per field
        cols = (
            self.arrival.tolist(), self.prompt_tokens.tolist(), self.output_tokens.tolist(),
            self.conversation.tolist(), self.turn.tolist(), self.think_time.tolist(),
            self.previous.tolist(), self.shared_stream.tolist(), self.shared_tokens.tolist(),
            self.stream.tolist(),
        )
        hashes = self.hash_ids
        for i, (arr, pt, ot, conv, turn, think, prev, sst, stok, st) in enumerate(zip(*cols)):
            yield Request(
                i, arr, pt, ot, None if conv < 0 else conv, turn, think,
                None if prev < 0 else prev, sst, stok, st,
                hashes[i] if hashes is not None else (), self.hash_block,
            )

    def head(self, n: int) -> RequestBatch:
        """The first n requests (dependencies stay valid: a turn never precedes its previous)."""
        return RequestBatch(
            self.arrival[:n], self.prompt_tokens[:n], self.output_tokens[:n],
            self.conversation[:n], self.turn[:n], self.think_time[:n], self.previous[:n],
            self.shared_stream[:n], self.shared_tokens[:n], self.stream[:n],
            self.hash_ids[:n] if self.hash_ids is not None else None, self.hash_block,
        )


# --- block hashes -----------------------------------------------------------------------------------


_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    # uint64 arithmetic wraps; numpy never warns for arrays (only for scalars), so no errstate
    # (entering one costs more than the arithmetic on a few hundred blocks)
    z = x + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def _mix(keys: np.ndarray, index: np.ndarray) -> np.ndarray:
    return _splitmix64((keys.astype(_U64) << _U64(24)) ^ index.astype(_U64))


def block_hashes(request: Request, block_size: int, tokens: int | None = None) -> np.ndarray:
    """One uint64 per *full* block of the prompt; equal hashes mean equal prefixes. `tokens`
    (default: the prompt's) extends the same stream further: the prompt and the output after
    it, a conversation's next prefix; block j's hash does not depend on how far it extends.

    Block j of a stream prompt hashes (shared stream, j) when the block lies entirely inside the
    shared prefix, else (own stream, j): a stream is append-only, so block j's content, and the
    prefix before it, is a function of (stream, j). A trace prompt hashes (hash id covering the
    block's last token, j): Mooncake hash ids are chained, so that id names the whole prefix.
    """
    n = (request.prompt_tokens if tokens is None else tokens) // block_size
    j = np.arange(n, dtype=np.int64)
    if request.hash_ids:
        ids = np.asarray(request.hash_ids, dtype=np.int64)
        k = ((j + 1) * block_size - 1) // request.hash_block
        known = k < ids.shape[0]
        keys = np.where(known, ids[np.minimum(k, ids.shape[0] - 1)], request.stream)
        out = _mix(keys, j)
        with np.errstate(over="ignore"):
            out = np.where(known, out ^ _TRACE_SALT, out)
        return out
    shared_blocks = request.shared_tokens // block_size if request.shared_stream else 0
    if shared_blocks <= 0:  # every block on the request's own stream: `_mix` of one key
        return _splitmix64(j.astype(_U64) ^ _U64((request.stream << 24) & _MASK64))
    k = min(shared_blocks, n)
    shared = _shared_hashes(request.shared_stream, k)
    if k == n:
        return shared.copy()
    own = _mix(np.full(n - k, request.stream, dtype=np.int64), j[k:])
    return np.concatenate((shared, own))


@functools.lru_cache(maxsize=64)
def _shared_hashes(stream: int, blocks: int) -> np.ndarray:
    """The hashes of a shared prefix's `blocks` blocks (every prompt sharing it starts with
    them): computed once, not once a request. Read only."""
    out = _mix(np.full(blocks, stream, dtype=np.int64), np.arange(blocks, dtype=np.int64))
    out.flags.writeable = False
    return out


def matching_prefix_blocks(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading block hashes two prompts share."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.shape[0] else n


def hash_strings(hashes: np.ndarray) -> tuple[str, ...]:
    """Block hashes as the hex strings the core's events carry."""
    return tuple(f"{h:016x}" for h in hashes.tolist())


# --- sampling ---------------------------------------------------------------------------------------


def sample_lengths(spec: LengthSpec, n: int, rng: np.random.Generator, floor: int = 0) -> np.ndarray:
    """n token counts from `spec`, clipped to [max(spec.min, floor), spec.max], as int64."""
    mean = spec.mean
    if spec.dist == "fixed":
        values = np.full(n, round(mean), dtype=np.int64)
    elif spec.dist == "uniform":
        low = int(mean * (1.0 - spec.range_ratio))
        high = int(mean * (1.0 + spec.range_ratio))
        values = rng.integers(low, high + 1, size=n, dtype=np.int64)
    elif spec.dist == "exponential":
        values = np.rint(rng.exponential(mean, size=n)).astype(np.int64) if mean > 0 else \
            np.zeros(n, dtype=np.int64)
    else:  # lognormal with the requested mean
        if mean <= 0:
            values = np.zeros(n, dtype=np.int64)
        else:
            mu = math.log(mean) - spec.sigma**2 / 2.0
            values = np.rint(rng.lognormal(mu, spec.sigma, size=n)).astype(np.int64)
    low_clip = max(spec.min, floor)
    high_clip = spec.max if spec.max is not None else np.iinfo(np.int64).max
    return np.clip(values, low_clip, high_clip)


def _arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times like vllm bench serve: first at 0, gamma gaps (shape=burstiness)."""
    if n == 0:
        return np.zeros(0)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def _empty_int(n: int, fill: int) -> np.ndarray:
    return np.full(n, fill, dtype=np.int64)


# --- generators -------------------------------------------------------------------------------------


def poisson(workload: PoissonWorkload, requests: int, seed: int,
            max_model_len: int | None = None) -> RequestBatch:
    """Open-loop arrivals at `workload.qps` with sampled input and output lengths."""
    rng = np.random.default_rng(seed)
    arrival = _arrivals(requests, workload.qps, workload.burstiness, rng)
    prompt = sample_lengths(workload.input_len, requests, rng, floor=1)
    output = sample_lengths(workload.output_len, requests, rng, floor=1)
    if max_model_len is not None:
        prompt = np.minimum(prompt, max_model_len - 1)
        output = np.minimum(output, max_model_len - prompt)
    shared = (prompt * workload.shared_prefix_fraction).astype(np.int64)
    idx = np.arange(requests, dtype=np.int64)
    return RequestBatch(
        arrival=arrival,
        prompt_tokens=prompt,
        output_tokens=output,
        conversation=_empty_int(requests, -1),
        turn=np.zeros(requests, dtype=np.int64),
        think_time=np.zeros(requests),
        previous=_empty_int(requests, -1),
        shared_stream=_empty_int(requests, SHARED_STREAM if workload.shared_prefix_fraction else 0),
        shared_tokens=shared,
        stream=FIRST_PRIVATE + idx,
    )


def multi_turn(workload: MultiTurnWorkload, requests: int, seed: int,
               max_model_len: int | None = None) -> RequestBatch:
    """Conversations with growing context, enough of them for `requests` turns in total.

    Turn k's prompt = previous prompt + previous output + user tokens + tool output, with
    tool output = tool_output_tokens + floor(tool_output_fraction x history). A conversation
    ends early when its next prompt (plus output) would not fit the prompt cap.
    """
    rng = np.random.default_rng(seed)
    cap_total = max_model_len if max_model_len is not None else np.iinfo(np.int64).max // 4
    cap_prompt = workload.max_prompt_tokens or cap_total - 1
    mean_turns = max(workload.turns.mean, 1.0)
    n_conv = max(1, math.ceil(requests / mean_turns * 1.25) + 1)
    while True:
        turns = sample_lengths(workload.turns, n_conv, rng, floor=1)
        if int(turns.sum()) >= requests:
            break
        n_conv *= 2  # rare: redraw with more conversations (still deterministic for a seed)
    starts = _arrivals(n_conv, workload.conversation_rate, 1.0, rng)
    max_t = int(turns.max())
    # draws per (conversation, turn) slot, a fixed-shape matrix so the seed fixes every draw
    shape = (n_conv, max_t)
    first = sample_lengths(workload.first_prompt, n_conv, rng, floor=1)
    output = sample_lengths(workload.output_len, n_conv * max_t, rng, floor=1).reshape(shape)
    user = sample_lengths(workload.user_tokens, n_conv * max_t, rng).reshape(shape)
    tool = sample_lengths(workload.tool_output_tokens, n_conv * max_t, rng).reshape(shape)
    if workload.think_time_dist == "fixed":
        think = np.full(shape, workload.think_time_s)
    else:
        think = rng.exponential(workload.think_time_s, size=shape) if workload.think_time_s > 0 \
            else np.zeros(shape)
    think[:, 0] = 0.0

    prompt = np.zeros(shape, dtype=np.int64)
    alive = np.zeros(shape, dtype=bool)
    shared = min(workload.shared_prefix_tokens, cap_prompt - 1)
    p = np.minimum(first + shared, cap_prompt)
    active = turns >= 1
    for k in range(max_t):
        if k > 0:
            history = prompt[:, k - 1] + output[:, k - 1]
            grown = history * workload.tool_output_fraction
            p = history + user[:, k] + tool[:, k] + grown.astype(np.int64)
            active = active & (turns > k) & (p <= cap_prompt)
        out_k = np.minimum(output[:, k], np.maximum(cap_total - p, 1))
        active = active & (p + out_k <= cap_total) if k > 0 else active
        output[:, k] = out_k
        prompt[:, k] = p
        alive[:, k] = active
    nominal = starts[:, None] + np.cumsum(think, axis=1)

    conv_idx, turn_idx = np.nonzero(alive)
    arr = nominal[conv_idx, turn_idx]
    order = np.lexsort((turn_idx, conv_idx, arr))[:requests]
    conv_idx, turn_idx, arr = conv_idx[order], turn_idx[order], arr[order]
    n = arr.shape[0]
    rid_of = np.full(shape, -1, dtype=np.int64)
    rid_of[conv_idx, turn_idx] = np.arange(n, dtype=np.int64)
    previous = np.where(turn_idx > 0, rid_of[conv_idx, np.maximum(turn_idx - 1, 0)], -1)
    return RequestBatch(
        arrival=arr,
        prompt_tokens=prompt[conv_idx, turn_idx],
        output_tokens=output[conv_idx, turn_idx],
        conversation=conv_idx.astype(np.int64),
        turn=turn_idx.astype(np.int64),
        think_time=think[conv_idx, turn_idx],
        previous=previous.astype(np.int64),
        shared_stream=_empty_int(n, SHARED_STREAM if shared else 0),
        shared_tokens=_empty_int(n, shared),
        stream=FIRST_PRIVATE + conv_idx.astype(np.int64),
    )


_TRACE_FIELDS = ("timestamp", "input_length", "output_length")


def read_trace(path: str | Path, *, time_scale: float = 1.0, hash_block_tokens: int = 512,
               limit: int | None = None) -> RequestBatch:
    """Read a Mooncake-style JSONL trace: one object per line with `timestamp` (ms),
    `input_length`, `output_length` and `hash_ids` (one id per `hash_block_tokens` tokens).

    Blank lines are skipped and unknown keys ignored. A bad line raises ScenarioError naming
    file:line, the field and what was expected. Requests are ordered by timestamp (stable) and
    times start at the first request's timestamp.
    """
    file = str(path)
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise ScenarioError(file, [("", "a readable trace file", str(exc), None)]) from None
    stamps: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    hashes: list[tuple[int, ...]] = []
    with handle:
        for lineno, line in enumerate(handle, start=1):
            if limit is not None and len(stamps) >= limit:
                break
            text = line.strip()
            if not text:
                continue
            record = _trace_record(text, file, lineno)
            stamp, n_in, n_out, ids = _trace_fields(record, file, lineno, hash_block_tokens)
            stamps.append(stamp)
            inputs.append(n_in)
            outputs.append(n_out)
            hashes.append(ids)
    n = len(stamps)
    times = np.asarray(stamps, dtype=np.float64)
    order = np.argsort(times, kind="stable")
    times = (times[order] - (times[order][0] if n else 0.0)) / 1000.0 * time_scale
    return RequestBatch(
        arrival=times,
        prompt_tokens=np.asarray(inputs, dtype=np.int64)[order],
        output_tokens=np.asarray(outputs, dtype=np.int64)[order],
        conversation=_empty_int(n, -1),
        turn=np.zeros(n, dtype=np.int64),
        think_time=np.zeros(n),
        previous=_empty_int(n, -1),
        shared_stream=np.zeros(n, dtype=np.int64),
        shared_tokens=np.zeros(n, dtype=np.int64),
        stream=FIRST_PRIVATE + np.arange(n, dtype=np.int64),
        hash_ids=tuple(hashes[i] for i in order.tolist()),
        hash_block=hash_block_tokens,
    )


def _trace_record(text: str, file: str, lineno: int) -> dict[str, Any]:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScenarioError(file, [("", f"a JSON object ({exc.msg}, column {exc.colno})",
                                    None, lineno)]) from None
    if not isinstance(record, dict):
        raise ScenarioError(file, [("", "a JSON object per line", type(record).__name__, lineno)])
    return record


def _trace_fields(record: dict[str, Any], file: str, lineno: int,
                  hash_block: int) -> tuple[float, int, int, tuple[int, ...]]:
    def bad(field: str, expected: str) -> ScenarioError:
        got = repr(record.get(field)) if field in record else None
        what = expected if field in record else f"{expected} (field missing)"
        return ScenarioError(file, [(field, what, got, lineno)])

    for field in _TRACE_FIELDS:
        if field not in record:
            raise bad(field, "a number" if field == "timestamp" else "an integer")
    stamp = record["timestamp"]
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not math.isfinite(stamp) \
            or stamp < 0:
        raise bad("timestamp", "a non-negative number of milliseconds")
    n_in = record["input_length"]
    if isinstance(n_in, bool) or not isinstance(n_in, int) or n_in < 1:
        raise bad("input_length", "an integer >= 1")
    n_out = record["output_length"]
    if isinstance(n_out, bool) or not isinstance(n_out, int) or n_out < 1:
        raise bad("output_length", "an integer >= 1")
    ids = record.get("hash_ids", [])
    if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0
                                        for h in ids):
        raise bad("hash_ids", "a list of non-negative integers")
    most = -(-n_in // hash_block)
    if len(ids) > most:
        raise bad("hash_ids", f"at most ceil(input_length / {hash_block}) = {most} ids")
    return float(stamp), n_in, n_out, tuple(ids)


def _trace(workload: TraceWorkload, requests: int) -> RequestBatch:
    return read_trace(workload.path, time_scale=workload.time_scale,
                      hash_block_tokens=workload.hash_block_tokens, limit=requests)


def generate(workload: PoissonWorkload | MultiTurnWorkload | TraceWorkload, requests: int,
             seed: int, max_model_len: int | None = None) -> RequestBatch:
    """The requests of a workload, by its `kind`."""
    if isinstance(workload, PoissonWorkload):
        return poisson(workload, requests, seed, max_model_len)
    if isinstance(workload, MultiTurnWorkload):
        return multi_turn(workload, requests, seed, max_model_len)
    return _trace(workload, requests)


def requests_for_point(point: Point) -> RequestBatch:
    """The requests of one sweep point (warm-up requests first, then the measured ones)."""
    scenario = point.scenario
    total = scenario.requests + scenario.warmup_requests
    return generate(scenario.workload, total, point.seed, scenario.engine.max_model_len)
