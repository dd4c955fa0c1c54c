"""The router's configuration: which instances it fronts, how it routes, what it refuses.

Rules kept here:
- Configuration is frozen dataclasses; building one does no I/O (no socket, no file, no clock).
  `RouterConfig.check()` returns every problem at once, so a bad command line fails with the
  whole list, not the first mistake.
- An upstream is one vLLM instance: an id the router and its events use (`prefill-0`,
  `decode-1`, ...; the same name its connector's `instance` setting gives its own events), the
  base URL of its OpenAI server, and `host:port` of its kvplane side channel (the connector's
  `kvplane.live.sidechannel` server: identity and settings, retained handles, lease
  heartbeats; see docs/notes/live-protocol.md). The side channel defaults to the URL's host
  and port 5600 (vLLM's default `VLLM_NIXL_SIDE_CHANNEL_PORT`).
- Modes: `pull` (prefill first, then decode with prefill's metadata), `push` (both legs at
  once, one request id), `bidirectional` (pull plus retained decode KV reused by the next turn
  of a conversation). The decode choice is a `kvplane.core.routing.Policy`.
- The HMAC key that signs retained-KV handles is bytes; it never appears in `repr` or logs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args
from urllib.parse import urlsplit

from kvplane.core.routing import Policy, PolicyKind

RouterMode = Literal["pull", "push", "bidirectional"]
ROUTER_MODES: tuple[str, ...] = get_args(RouterMode)
POLICY_KINDS: tuple[str, ...] = get_args(PolicyKind)
Role = Literal["prefill", "decode"]

DEFAULT_SIDE_PORT = 5600  # vLLM's default VLLM_NIXL_SIDE_CHANNEL_PORT
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")


class ConfigError(ValueError):
    """The router was configured wrongly; the message lists every problem."""


@dataclass(frozen=True, slots=True)
class Upstream:
    """One vLLM instance behind the router."""

    id: str
    role: Role
    url: str  # base of the OpenAI server, e.g. http://10.0.0.1:8100 (no trailing /v1)
    side_host: str = ""  # the kvplane side channel; "" = the URL's host
    side_port: int = DEFAULT_SIDE_PORT

    @property
    def side_channel(self) -> tuple[str, int]:
        return (self.side_host or urlsplit(self.url).hostname or "127.0.0.1", self.side_port)


def parse_upstream(spec: str, role: Role, index: int) -> Upstream:
    """`URL[,side=HOST:PORT|PORT][,id=NAME]` -> `Upstream` (id defaults to `<role>-<index>`)."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise ConfigError(f"empty {role} instance spec")
    url, extra = parts[0], parts[1:]
    side_host, side_port = "", DEFAULT_SIDE_PORT
    name = f"{role}-{index}"
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise ConfigError(
                f"{role} spec {spec!r}: expected key=value after the URL, got {item!r}"
            )
        if key == "side":
            host, _, port = value.removeprefix("tcp://").rpartition(":")
            if not port.isdigit():
                raise ConfigError(f"{role} spec {spec!r}: side must be HOST:PORT or PORT")
            side_host, side_port = host, int(port)
        elif key == "id":
            name = value
        else:
            raise ConfigError(f"{role} spec {spec!r}: unknown key {key!r} (known: side, id)")
    return Upstream(name, role, url.rstrip("/"), side_host, side_port)


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds. `connect` bounds opening a connection; the others bound a whole leg or a gap."""

    connect: float = 5.0
    prefill: float = 300.0  # the whole prefill leg (one token)
    decode_first: float = 300.0  # from sending decode's leg to its response headers
    decode_gap: float = 120.0  # longest silence between two chunks of decode's stream
    control: float = 5.0  # settings probe, heartbeat, release


@dataclass(frozen=True, slots=True)
class Leases:
    """How the router keeps retained KV alive while a conversation is active."""

    ttl: float = 480.0  # asked of decode in `retain`; decode may grant less
    renewable: bool = True
    heartbeat_every: float = 5.0  # seconds between heartbeat rounds
    idle_after: float = 120.0  # a conversation with no turn for this long gets no heartbeats
    recheck_after: float = 5.0  # retry a failed first contact with an instance after this


@dataclass(frozen=True, slots=True)
class RouterConfig:
    prefill: tuple[Upstream, ...]
    decode: tuple[Upstream, ...]
    mode: RouterMode = "pull"
    policy: Policy = field(default_factory=Policy)
    models: tuple[str, ...] = ()  # empty: learn them from the instances' /v1/models
    max_body_bytes: int = 4 * 1024 * 1024
    timeouts: Timeouts = field(default_factory=Timeouts)
    leases: Leases = field(default_factory=Leases)
    hmac_key: bytes = field(default=b"", repr=False)
    api_keys: Mapping[str, str] = field(default_factory=dict, repr=False)  # key -> tenant
    require_api_key: bool = False
    upstream_api_key: str | None = field(default=None, repr=False)  # sent to the instances
    check_settings: bool = True  # ask every instance for its kvplane settings at first contact
    instance: str = "router"  # the `instance` of the router's own events

    def check(self) -> list[str]:
        """Every problem with this configuration (empty when it is usable)."""
        problems: list[str] = []
        if self.mode not in ROUTER_MODES:
            problems.append(f"mode must be one of {ROUTER_MODES}, not {self.mode!r}")
        if self.policy.kind not in POLICY_KINDS:
            problems.append(f"policy must be one of {POLICY_KINDS}, not {self.policy.kind!r}")
        if not self.prefill:
            problems.append("at least one prefill instance is needed")
        if not self.decode:
            problems.append("at least one decode instance is needed")
        seen: set[str] = set()
        for up in self.prefill + self.decode:
            if not _ID.match(up.id):
                problems.append(f"instance id {up.id!r} must be 1-64 of [A-Za-z0-9_.:-]")
            if up.id in seen:
                problems.append(f"instance id {up.id!r} is used twice")
            seen.add(up.id)
            parts = urlsplit(up.url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                problems.append(f"{up.id}: url {up.url!r} must be http(s)://host:port")
            if not 0 < up.side_port < 65536:
                problems.append(f"{up.id}: side channel port {up.side_port} is not a port")
        if len(self.hmac_key) < 16:
            problems.append("the handle HMAC key must be at least 16 bytes")
        if self.max_body_bytes < 1024:
            problems.append("max_body_bytes must be at least 1024")
        if self.require_api_key and not self.api_keys:
            problems.append("require_api_key needs at least one API key")
        for name, value in (
            ("connect", self.timeouts.connect),
            ("prefill", self.timeouts.prefill),
            ("decode_first", self.timeouts.decode_first),
            ("decode_gap", self.timeouts.decode_gap),
            ("control", self.timeouts.control),
            ("lease ttl", self.leases.ttl),
            ("heartbeat_every", self.leases.heartbeat_every),
            ("idle_after", self.leases.idle_after),
        ):
            if not value > 0:
                problems.append(f"{name} must be positive, not {value!r}")
        return problems

    def checked(self) -> RouterConfig:
        """This configuration, or `ConfigError` listing every problem."""
        problems = self.check()
        if problems:
            raise ConfigError("router configuration:\n  - " + "\n  - ".join(problems))
        return self

    def upstream(self, instance_id: str) -> Upstream | None:
        for up in self.prefill + self.decode:
            if up.id == instance_id:
                return up
        return None
