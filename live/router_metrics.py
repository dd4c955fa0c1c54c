"""The router's Prometheus metrics, on a registry of its own.

Rules kept here:
- Every router has its own `CollectorRegistry`, so two routers in one process (tests, a
  blue/green restart) never share or clash on a counter. `/metrics` renders only that registry.
- Names start with `kvplane_router_`; label values come from small closed sets (mode, role,
  outcome, error type) or from the configured instance ids, never from request data, so the
  number of series stays bounded.
- Times are seconds on the router's monotonic clock.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as _CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = _CONTENT_TYPE

# TTFT spans a one-token prefill of a short prompt (tens of ms) to a long one under load (s).
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
    10.0, 20.0, 60.0,
)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvplane_router_requests", "Client requests, by endpoint, mode and HTTP status.",
            ["endpoint", "mode", "status"], registry=r,
        )
        self.ttft = Histogram(
            "kvplane_router_ttft_seconds",
            "Time to first token seen by the client: arrival to the first content chunk "
            "(streaming) or to the whole answer (non-streaming).",
            ["mode", "stream"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "kvplane_router_request_seconds", "Arrival to the last byte sent to the client.",
            ["mode"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.upstream_latency = Histogram(
            "kvplane_router_upstream_seconds",
            "One leg's time: sending it to the instance's answer (prefill: whole answer; "
            "decode: response headers; control: settings, heartbeat, release).",
            ["role", "instance", "leg"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.transfers = Counter(
            "kvplane_router_transfers",
            "KV transfers the router set up: P->D (pull metadata relayed, or a push pair "
            "dispatched) and D->P (a retained handle handed to prefill).",
            ["mode", "direction"], registry=r,
        )
        self.reuse_hits = Counter(
            "kvplane_router_reuse_hits", "Turns whose conversation had a live retained handle.",
            registry=r,
        )
        self.reuse_misses = Counter(
            "kvplane_router_reuse_misses", "Turns with no usable retained handle, by reason.",
            ["reason"], registry=r,
        )
        self.reuse_fallbacks = Counter(
            "kvplane_router_reuse_fallbacks",
            "Turns whose reuse failed at prefill and were recomputed, by reason.",
            ["reason"], registry=r,
        )
        self.sessions = Gauge(
            "kvplane_router_sessions",
            "Conversations holding a retained handle: active ones get lease heartbeats.",
            ["state"], registry=r,
        )
        self.heartbeats = Counter(
            "kvplane_router_lease_heartbeats", "Lease heartbeats sent, by outcome.",
            ["outcome"], registry=r,
        )
        self.leases_dropped = Counter(
            "kvplane_router_leases_dropped", "Handles dropped from the table, by reason.",
            ["reason"], registry=r,
        )
        self.errors = Counter(
            "kvplane_router_errors", "Errors answered to clients, by type and code.",
            ["type", "code"], registry=r,
        )
        self.inflight = Gauge(
            "kvplane_router_inflight", "Legs in flight per instance (the load the router routes "
            "by).", ["role", "instance"], registry=r,
        )
        self.stale_retries = Counter(
            "kvplane_router_stale_connection_retries",
            "Legs sent again after an instance closed the pooled idle connection they went out "
            "on before answering.", ["role", "instance"], registry=r,
        )
        self.recorder_failures = Counter(
            "kvplane_router_recorder_failures",
            "Events the recorder refused or could not queue.", registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
