"""What KvplaneConnector puts on the wire: the `kv_transfer_params` contract, NIXL notification
messages, and the messages between its scheduler half and its worker half.

No vLLM or NIXL import here: these are plain dataclasses and dicts, so the router, the tests and
both halves share them, and they pickle across vLLM's process boundaries.

The request/response contract is written out in docs/notes/live-protocol.md; the parsing here is
its reference. Everything of ours sits under one key, `kvplane`, next to the two NIXL-compatible
flags (`do_remote_decode` on the prefill leg, `do_remote_prefill` on the decode leg) that vLLM
itself looks at for its P/D metrics.

Rules:
- A malformed `kvplane` dict is the peer (router) misbehaving: `PeerError`, which the connector
  turns into "no transfer" for that request (it is computed locally), never into a crash.
- Runs cross the halves as the core planned them, `(src_slot, dst_slot, tokens)` in token
  slots (block id * block size + offset), so the two sides may have different block sizes;
  the worker half turns them into byte runs per layer (and per head when a stream moves a
  slice of a rank's heads).
- Tensor parallelism: an order names the rank that carries it out (`rank`) and the peer's
  rank it talks to (`peer_rank`); every worker sees every order and keeps its own. A peer's
  handshake is fetched per rank from its side channel.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from kvplane.core.errors import PeerError
from kvplane.core.plan import KVLayout, TransferPlan
from kvplane.core.reuse import RetainedHandle

PARAMS_KEY = "kvplane"
WIRE_VERSION = 1
Mode = Literal["pull", "push"]


# --- identities and layouts ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where an instance's side channel answers, and the name its events carry."""

    instance: str
    host: str
    port: int
    engine_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Endpoint:
        try:
            return cls(str(d["instance"]), str(d["host"]), int(d["port"]),
                       str(d.get("engine_id", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise PeerError(f"bad endpoint {d!r}: {exc}") from exc


def layout_to_dict(layout: KVLayout) -> dict[str, int]:
    return {"block_size": layout.block_size, "tp": layout.tp, "num_layers": layout.num_layers,
            "num_kv_heads": layout.num_kv_heads, "head_bytes": layout.head_bytes,
            "planes": layout.planes}


def layout_from_dict(d: Any) -> KVLayout:
    try:
        return KVLayout(int(d["block_size"]), int(d["tp"]), int(d["num_layers"]),
                        int(d["num_kv_heads"]), int(d["head_bytes"]), int(d.get("planes", 2)))
    except (KeyError, TypeError, ValueError) as exc:
        raise PeerError(f"bad KV layout {d!r}: {exc}") from exc


def _blocks(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not all(isinstance(b, int) and b >= 0 for b in v):
        raise PeerError(f"{what} must be a list of block ids, got {v!r}")
    return tuple(v)


# --- kv_transfer_params: what prefill returns for a pull, what decode returns to retain -------


@dataclass(frozen=True, slots=True)
class SourceHandle:
    """Prefill's finished blocks, held under a lease for a pulling decode (prefill's response)."""

    source: Endpoint
    xfer: str
    attempt: int
    blocks: tuple[int, ...]
    num_tokens: int
    lease: str
    expires_at: float
    layout: KVLayout

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source.to_dict(), "xfer": self.xfer, "attempt": self.attempt,
                "blocks": list(self.blocks), "num_tokens": self.num_tokens,
                "lease": self.lease, "expires_at": self.expires_at,
                "layout": layout_to_dict(self.layout)}

    @classmethod
    def from_dict(cls, d: Any) -> SourceHandle:
        try:
            return cls(Endpoint.from_dict(d["source"]), str(d["xfer"]), int(d["attempt"]),
                       _blocks(d["blocks"], "blocks"), int(d["num_tokens"]), str(d["lease"]),
                       float(d["expires_at"]), layout_from_dict(d["layout"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise PeerError(f"bad pull source handle: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Retained:
    """Decode's retained blocks (decode's response; the router hands it to the next prefill)."""

    source: Endpoint
    xfer: str
    attempt: int
    lease: str
    blocks: tuple[int, ...]
    num_tokens: int
    block_size: int
    block_hashes: tuple[str, ...]
    expires_at: float
    renewable: bool
    layout: KVLayout
    hash_salt: str = ""

    def core_handle(self) -> RetainedHandle:
        return RetainedHandle(decode=self.source.instance, lease=self.lease,
                              num_tokens=self.num_tokens, block_size=self.block_size,
                              block_hashes=self.block_hashes, expires_at=self.expires_at)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source.to_dict(), "xfer": self.xfer, "attempt": self.attempt,
                "lease": self.lease, "blocks": list(self.blocks), "num_tokens": self.num_tokens,
                "block_size": self.block_size, "block_hashes": list(self.block_hashes),
                "expires_at": self.expires_at, "renewable": self.renewable,
                "layout": layout_to_dict(self.layout), "hash_salt": self.hash_salt}

    @classmethod
    def from_dict(cls, d: Any) -> Retained:
        try:
            hashes = d["block_hashes"]
            if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
                raise PeerError("block_hashes must be a list of strings")
            return cls(Endpoint.from_dict(d["source"]), str(d["xfer"]), int(d["attempt"]),
                       str(d["lease"]), _blocks(d["blocks"], "blocks"), int(d["num_tokens"]),
                       int(d["block_size"]), tuple(hashes), float(d["expires_at"]),
                       bool(d.get("renewable", False)), layout_from_dict(d["layout"]),
                       str(d.get("hash_salt", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise PeerError(f"bad retained-KV handle: {exc}") from exc


# --- kv_transfer_params: what a request asks for ----------------------------------------------


@dataclass(frozen=True, slots=True)
class Leg:
    """One request's part in a P/D exchange, read from its `kv_transfer_params`.

    role "prefill": compute the prompt and hand its KV to a decode instance (pull: hold it and
    return a `SourceHandle`; push: WRITE it once decode's registration arrives). `reuse` is a
    retained-KV handle from an earlier turn that prefill may READ instead of computing.
    role "decode": get the prompt's KV from `source` (pull: READ the blocks the handle names;
    push: register destination blocks with `source` and wait for its WRITE; neither: compute
    the prompt locally). `retain` keeps the blocks after generation under a lease and returns
    a `Retained` handle.
    """

    role: Literal["prefill", "decode"]
    mode: Mode
    xfer: str
    attempt: int = 0
    source: Endpoint | None = None  # decode: the prefill instance
    source_layout: KVLayout | None = None  # decode, push: prefill's KV layout, when given
    pull: SourceHandle | None = None  # decode, pull: prefill's held blocks
    reuse: Retained | None = None  # prefill: retained KV from an earlier turn
    retain: bool | None = None  # decode: None = the instance's default
    retain_ttl: float | None = None
    conversation: str | None = None
    tenant: str = "default"


def parse_leg(params: dict[str, Any] | None, fallback_xfer: str) -> Leg | None:
    """The request's leg, or None when the request carries no kvplane params."""
    if not params or not isinstance(params.get(PARAMS_KEY), dict):
        return None
    kp = params[PARAMS_KEY]
    try:
        version = int(kp.get("v", WIRE_VERSION))
        if version != WIRE_VERSION:
            raise PeerError(f"kvplane params version {version}, this connector speaks "
                            f"{WIRE_VERSION}")
        mode = kp.get("mode", "pull")
        if mode not in ("pull", "push"):
            raise PeerError(f"mode must be 'pull' or 'push', not {mode!r}")
        xfer = str(kp.get("xfer") or fallback_xfer)
        attempt = int(kp.get("attempt", 0))
        common: dict[str, Any] = {
            "mode": mode, "xfer": xfer, "attempt": attempt,
            "conversation": (None if kp.get("conversation") is None
                             else str(kp["conversation"])),
            "tenant": str(kp.get("tenant", "default")),
        }
        if params.get("do_remote_decode"):
            reuse = Retained.from_dict(kp["reuse"]) if kp.get("reuse") else None
            return Leg(role="prefill", reuse=reuse, **common)
        if params.get("do_remote_prefill") or kp.get("role") == "decode":
            pull = SourceHandle.from_dict(kp["pull"]) if kp.get("pull") else None
            source = None
            if pull is not None:
                source = pull.source
            elif kp.get("source"):
                source = Endpoint.from_dict(kp["source"])
                if isinstance(kp["source"], dict) and kp["source"].get("layout"):
                    common["source_layout"] = layout_from_dict(kp["source"]["layout"])
            elif params.get("do_remote_prefill"):
                raise PeerError("a decode leg with do_remote_prefill needs 'pull' (prefill's "
                                "handle) or 'source' (prefill's side channel, push)")
            if pull is not None:
                common["xfer"], common["attempt"] = pull.xfer, pull.attempt
            retain = kp.get("retain")
            ttl = kp.get("retain_ttl")
            return Leg(role="decode", source=source, pull=pull,
                       retain=None if retain is None else bool(retain),
                       retain_ttl=None if ttl is None else float(ttl), **common)
        # Only a handle given back after a finished decode (no flag set): nothing to do here.
        return None
    except (KeyError, TypeError, ValueError) as exc:
        raise PeerError(f"bad kvplane params: {exc}") from exc


def prefill_response(handle: SourceHandle, mode: Mode) -> dict[str, Any]:
    """Prefill's `kv_transfer_params` for a pull: pass it to decode as is."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            PARAMS_KEY: {"v": WIRE_VERSION, "role": "decode", "mode": mode, "xfer": handle.xfer,
                         "attempt": handle.attempt, "pull": handle.to_dict()}}


def decode_response(retained: Retained) -> dict[str, Any]:
    """Decode's `kv_transfer_params` when it retains the blocks: the router keeps `retained`."""
    return {"do_remote_prefill": False, "do_remote_decode": False,
            PARAMS_KEY: {"v": WIRE_VERSION, "retained": retained.to_dict()}}


# --- NIXL notifications ----------------------------------------------------------------------

NOTIF_PREFIX = b"KVP1 "
NotifKind = Literal["REG", "DONE", "FAIL", "READ"]


def encode_notif(kind: NotifKind, body: dict[str, Any]) -> bytes:
    return NOTIF_PREFIX + kind.encode() + b" " + json.dumps(body, separators=(",", ":")).encode()


def decode_notif(message: bytes) -> tuple[str, dict[str, Any]] | None:
    """(kind, body) of one of our notifications; None for anything else."""
    if not message.startswith(NOTIF_PREFIX):
        return None
    kind, _, rest = message[len(NOTIF_PREFIX):].partition(b" ")
    try:
        body = json.loads(rest)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    return kind.decode("ascii", "replace"), body


# --- block runs -------------------------------------------------------------------------------


def slot_runs(plan: TransferPlan) -> tuple[tuple[int, int, int], ...]:
    """The core's runs as `(src_slot, dst_slot, tokens)` triples (they cross to the worker)."""
    return tuple((r.src_slot, r.dst_slot, r.tokens) for r in plan.runs)


# --- scheduler half -> worker half ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Order:
    """Work for the worker's transfer thread.

    kind "read": READ `runs` (src = peer's blocks, dst = ours) from `peer`; when `notify` is
    set, send it to the peer after the READ completes (pull: prefill frees its hold).
    kind "write": WRITE `runs` (src = ours, dst = peer's) to `peer` with `notify` attached: NIXL
    delivers it once the data has landed (push completion).
    kind "notify": send `notify` to `peer` (push registration, failure reports).
    """

    kind: Literal["read", "write", "notify"]
    xfer: str
    attempt: int
    peer: Endpoint
    runs: tuple[tuple[int, int, int], ...] = ()  # (src_slot, dst_slot, tokens)
    notify: bytes = b""
    deadline: float = 0.0  # wall clock; the transfer fails if not done by then
    purpose: str = ""  # "pull", "reuse", "push", "register", "fail"
    # read: JSON {"kind", "handle", "reader"} sent as `pin/...` to the source's side channel
    # before the READ (the source's lease must be alive and is pinned) and `unpin/...` after
    pin: str = ""
    rank: int = 0  # our rank that carries the order out
    peer_rank: int = 0  # the peer's rank it reads from, writes to or notifies
    heads: tuple[int, ...] = ()  # (first head at the source, at the destination, count); ()=all


@dataclass(slots=True)
class KvplaneMeta:
    """Per step, scheduler -> workers: new orders, and the request ids the core decided are done
    (the worker reports them to vLLM in this same step)."""

    orders: list[Order] = field(default_factory=list)
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    # the blocks of failed loads, for vLLM releases that recompute only by block id (0.25.1;
    # filled by the facade, see vllm_compat)
    load_error_blocks: set[int] = field(default_factory=set)


# --- worker half -> scheduler half ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fact:
    """Something a worker saw: a transfer ended, a notification arrived.

    `at` is the wall-clock time the worker saw it; the scheduler half feeds completions to the
    core at that time, so a completion is never recorded later than what it caused elsewhere.
    """

    kind: Literal["read_done", "write_done", "notify_done", "notif"]
    xfer: str
    attempt: int
    at: float
    ok: bool = True
    reason: str = ""
    purpose: str = ""
    nbytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    notif: str = ""  # kind of notification ("REG", "DONE", "FAIL", "READ")
    body: dict[str, Any] = field(default_factory=dict)
    rank: int = 0  # the worker's rank that saw it
    peer_rank: int = 0  # the peer's rank of the order it ends


def fact_to_bytes(fact: Fact) -> bytes:
    return json.dumps(asdict(fact), separators=(",", ":")).encode()


def fact_from_bytes(data: bytes) -> Fact:
    d = json.loads(data)
    if not isinstance(d, dict):
        raise TypeError("a fact is a JSON object")
    return Fact(**d)


@dataclass(slots=True)
class KvplaneWorkerMeta:
    facts: list[Fact] = field(default_factory=list)

    def aggregate(self, other: Any) -> KvplaneWorkerMeta:
        return KvplaneWorkerMeta(self.facts + list(getattr(other, "facts", [])))


@dataclass(frozen=True, slots=True)
class KvplaneHandshake:
    """One worker's handshake bytes (`Transport.local_info()`), collected by vLLM at start-up
    and served by the scheduler process's side channel."""

    rank: int
    info: bytes
    block_bytes: int
    num_blocks: int
    num_regions: int
