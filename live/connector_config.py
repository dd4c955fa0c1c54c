"""KvplaneConnector's settings: `kv_connector_extra_config` keys, with defaults and help.

Built once per process from the dict vLLM hands us (no I/O when built). Unknown keys are kept
out (vLLM's own NIXL keys may sit in the same dict); a known key with a bad value is a
`ValueError` at start-up, not a surprise later.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    return int(raw) if raw.strip() else default


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    instance: str = field(default="", metadata={
        "help": "Name this instance's events carry (default: the engine id)."})
    side_channel_host: str = field(default="", metadata={
        "help": "Host the side channel binds and advertises (default: "
                "$VLLM_NIXL_SIDE_CHANNEL_HOST, else 127.0.0.1)."})
    side_channel_port: int = field(default=0, metadata={
        "help": "Side channel port (default: $VLLM_NIXL_SIDE_CHANNEL_PORT, else 5600)."})
    kvplane_db: str = field(default="", metadata={
        "help": "Event store URL or SQLite path (default: $KVPLANE_DB; empty: record nothing)."})
    kvplane_run: str = field(default="", metadata={
        "help": "Run id the events are filed under (default: $KVPLANE_RUN, else a new one). "
                "Give every instance of one deployment the same run."})
    kv_lease_duration: float = field(default=30.0, metadata={
        "help": "Pull: seconds prefill holds finished blocks for decode's READ."})
    push_hold_timeout: float = field(default=30.0, metadata={
        "help": "Push: seconds prefill holds finished blocks waiting for a registration."})
    kv_wait_timeout: float = field(default=30.0, metadata={
        "help": "Push: seconds decode waits for the WRITE before computing the prompt itself."})
    write_margin: float = field(default=2.0, metadata={
        "help": "Push: longest a WRITE may take; a registration closer than this to decode's "
                "deadline is dropped."})
    transfer_timeout: float = field(default=20.0, metadata={
        "help": "Seconds a single READ or WRITE may take before it counts as failed."})
    bidirectional_kv_xfer: bool = field(default=False, metadata={
        "help": "Decode retains every finished request's blocks (a request may override)."})
    decoder_kv_blocks_ttl: float = field(default=480.0, metadata={
        "help": "Seconds decode retains blocks (a request's retain_ttl may shorten it)."})
    lease_renewable: bool = field(default=False, metadata={
        "help": "Retained leases can be renewed by heartbeat (the router's renew/ request on the "
                "side channel); off: a fixed TTL, as published."})
    lease_extension: float = field(default=60.0, metadata={
        "help": "A heartbeat moves a renewable lease's expiry to now + this many seconds."})
    handle_key: str = field(default="", metadata={
        "help": "HMAC key (UTF-8) the router signs retained handles with; when set, a reuse "
                "handle, renew or release without a valid signature is refused."})
    kv_recompute_threshold: int = field(default=64, metadata={
        "help": "Prefill reads retained KV only when it supplies at least this many tokens."})
    reuse_read_estimate: float = field(default=1.0, metadata={
        "help": "Seconds a D->P read is assumed to take when checking the lease's expiry."})
    hash_salt: str = field(default="", metadata={
        "help": "Salt of the block hash chain (set it per model/tenant on both sides)."})
    progress_thread: bool = field(default=False, metadata={
        "help": "NIXL's own progress thread (off: our transfer thread polls; better on few "
                "cores)."})

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, engine_id: str = "") -> ConnectorConfig:
        extra = dict(extra or {})
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in extra:
                continue
            raw = extra[f.name]
            kind = type(f.default)
            try:
                if kind is bool:
                    values[f.name] = raw if isinstance(raw, bool) else str(raw).lower() in (
                        "1", "true", "yes", "on")
                else:
                    values[f.name] = kind(raw)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"kv_connector_extra_config[{f.name!r}]={raw!r}: {exc}") from exc
        cfg = cls(**values)
        fill: dict[str, Any] = {}
        if not cfg.instance:
            fill["instance"] = engine_id or "kvplane"
        if not cfg.side_channel_host:
            fill["side_channel_host"] = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST",
                                                       "127.0.0.1")
        if not cfg.side_channel_port:
            fill["side_channel_port"] = _env_int("VLLM_NIXL_SIDE_CHANNEL_PORT", 5600)
        if not cfg.kvplane_db:
            fill["kvplane_db"] = os.environ.get("KVPLANE_DB", "")
        if not cfg.kvplane_run:
            fill["kvplane_run"] = os.environ.get("KVPLANE_RUN", "")
        if fill:
            cfg = cls(**{**{f.name: getattr(cfg, f.name) for f in fields(cls)}, **fill})
        for name in ("kv_lease_duration", "push_hold_timeout", "kv_wait_timeout",
                     "transfer_timeout", "decoder_kv_blocks_ttl"):
            if getattr(cfg, name) <= 0:
                raise ValueError(f"kv_connector_extra_config[{name!r}] must be positive")
        return cfg
