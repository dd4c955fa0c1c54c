"""KvplaneConnector's settings: `kv_connector_extra_config` keys, with defaults and help.

Built once per process from the dict vLLM hands us. An unknown key (a typo, or a key of
another connector such as `mode`) is a `ValueError` at start-up that lists the known ones, and
so is a known key with a bad value: a setting never silently does nothing.

The HMAC key that signs handles is a secret, and vLLM prints `kv_connector_extra_config` in its
start-up log: so it is never taken from there (a `handle_key` there is refused). It comes from
`$KVPLANE_HANDLE_KEY`, else from the file `handle_key_file` names (`load_handle_key`, the only
place that reads a file, called when the connector starts, not when the config is built).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any

log = logging.getLogger(__name__)


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
    handle_key_file: str = field(default="", metadata={
        "help": "File holding the HMAC key that signs handles (pull handles, which prefill "
                "issues, and reuse handles, which the router issues), when $KVPLANE_HANDLE_KEY "
                "is not set. With a key, a handle without a valid signature is refused."})
    backends: tuple[str, ...] = field(default=("UCX",), metadata={
        "help": "NIXL backends to create (this connector's transport creates UCX)."})
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
    def known_keys(cls) -> list[str]:
        return sorted(f.name for f in fields(cls))

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, engine_id: str = "") -> ConnectorConfig:
        extra = dict(extra or {})
        if "handle_key" in extra:
            raise ValueError(
                "kv_connector_extra_config['handle_key'] is refused: vLLM prints this dict in "
                "its start-up log. Export KVPLANE_HANDLE_KEY or name a file in handle_key_file.")
        unknown = sorted(set(extra) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))} for "
                f"KvplaneConnector; known keys: {', '.join(cls.known_keys())}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in extra:
                continue
            raw = extra[f.name]
            kind = type(f.default)
            try:
                if kind is tuple:
                    if isinstance(raw, str) or not isinstance(raw, (list, tuple)):
                        raise TypeError("a list of strings is expected")
                    values[f.name] = tuple(str(x) for x in raw)
                elif kind is bool:
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
        if cfg.transfer_timeout >= cfg.kv_lease_duration:
            # decode pins prefill's KV for a pull READ for the whole transfer time-out, and
            # prefill refuses a pin that outlives its hold lease: with the same settings on
            # both sides every pull READ is refused and decode computes the prompt itself
            log.warning("kvplane connector: transfer_timeout (%g s) is not below "
                        "kv_lease_duration (%g s): a prefill with these settings refuses "
                        "every pull READ's pin, and decode recomputes instead",
                        cfg.transfer_timeout, cfg.kv_lease_duration)
        return cfg


def load_handle_key(cfg: ConnectorConfig) -> bytes:
    """The handle key: $KVPLANE_HANDLE_KEY, else the file `handle_key_file` names, else b""
    (handles unsigned). Never logged."""
    env = os.environ.get(HANDLE_KEY_ENV, "")
    if env:  # as the router reads it (kvplane router), byte for byte
        return env.encode()
    if cfg.handle_key_file:
        try:
            with open(cfg.handle_key_file, "rb") as f:
                key = f.read().strip()
        except OSError as exc:
            raise ValueError(f"kv_connector_extra_config['handle_key_file']: cannot read "
                             f"{cfg.handle_key_file}: {exc.strerror}") from None
        if not key:
            raise ValueError(f"kv_connector_extra_config['handle_key_file']: "
                             f"{cfg.handle_key_file} is empty")
        return key
    return b""


HANDLE_KEY_ENV = "KVPLANE_HANDLE_KEY"
