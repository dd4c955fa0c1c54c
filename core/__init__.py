"""kvplane.core: the sans-IO protocol. Stdlib only; never reads a clock, never does I/O.

Machines (each `decide(command, now) -> events`, `apply(event) -> state`):
- `prefill.PrefillCore`: push registration and rendezvous, pull holds, reuse reads (D->P).
- `decode.DecodeCore`: registration, completion counting, pull reads, retention leases.
- `lease.LeaseTable`: fixed-TTL or renewable leases, pinned while read.
- `sessions.SessionTable`: the router's (tenant, conversation) -> retained-KV handle table.
Pure functions: `plan.plan_transfer`, `reuse.decide_reuse`, `routing.choose`,
`hashing.block_hashes`. `replay.replay(events)` folds a log and checks every invariant.
"""

from .errors import PeerError, ProtocolError, SchemaError
from .events import EVENT_TYPES, SCHEMA_VERSION, Event

__all__ = ["EVENT_TYPES", "SCHEMA_VERSION", "Event", "PeerError", "ProtocolError", "SchemaError"]
