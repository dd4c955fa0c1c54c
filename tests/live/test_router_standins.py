"""Stand-ins for vLLM instances, for the router's tests: real HTTP servers, not vLLM.

`StandIn` is a small aiohttp server on 127.0.0.1 that speaks the OpenAI API shape
(`/v1/models`, `/v1/completions`, `/v1/chat/completions`, streamed or not) and the router <->
connector contract the way `KvplaneConnector` does: it reads `kv_transfer_params` with the
contract's own parser (`connector_wire.parse_leg`), answers prefill legs with
`prefill_response` and retaining decode legs with `decode_response`, and serves its identity,
retained handles and lease renewals on a real `sidechannel` server. It moves no KV: a push
"transfer" is an in-process rendezvous between the two stand-ins (`Rendezvous`), so a decode
leg that arrives without its prefill leg (or the other way round) waits, as on real instances.

The end-to-end tests against real vLLM live with the connector's tests; these keep the
router's own tests fast (seconds) and deterministic.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvplane.core.errors import PeerError
from kvplane.core.hashing import block_hashes
from kvplane.core.plan import KVLayout
from kvplane.live.connector_wire import (
    Endpoint,
    Retained,
    SourceHandle,
    decode_response,
    parse_leg,
    prefill_response,
)
from kvplane.live.router_handles import HandleError, verify_wire
from kvplane.live.sidechannel import IDENTITY_KEY, SideChannelServer

KEY = b"test-handle-key-0123456789abcdef"
MODEL = "tiny"
BLOCK = 4


def tokens_of(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) % 50_000 for w in text.split()]


def prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return " ".join(str(m.get("content", "")) for m in body["messages"])
    p = body.get("prompt", "")
    return " ".join(map(str, p)) if isinstance(p, list) else str(p)


@dataclass
class Seen:
    """One request a stand-in received."""

    path: str
    request_id: str | None
    body: dict[str, Any]
    arrived: float
    answered: float | None = None

    @property
    def kvplane(self) -> dict[str, Any]:
        return (self.body.get("kv_transfer_params") or {}).get("kvplane") or {}


class Rendezvous:
    """Push mode between two stand-ins: registrations and finished prefills, by transfer id."""

    def __init__(self) -> None:
        self.registered: dict[str, asyncio.Event] = {}
        self.written: dict[str, asyncio.Event] = {}

    def event(self, table: dict[str, asyncio.Event], xfer: str) -> asyncio.Event:
        return table.setdefault(xfer, asyncio.Event())


class _Side(SideChannelServer):
    """The connector's side channel, with the keys the router asks for beyond `identity`."""

    def __init__(self, owner: StandIn) -> None:
        super().__init__("127.0.0.1", 0)
        self.standin = owner

    def get(self, key: str) -> bytes | None:
        kind, _, rest = key.partition("/")
        if kind == "retained":
            r = self.standin.retained.get(rest)
            return json.dumps(r.to_dict()).encode() if r is not None else None
        if kind in ("renew", "release"):
            return self.standin.lease_call(kind, rest)
        return super().get(key)


@dataclass
class StandIn:
    """One instance. Knobs: `delay`, `fail_status`, `reuse_fails`, `renewable`, ..."""

    name: str
    rendezvous: Rendezvous = field(default_factory=Rendezvous)
    block_size: int = BLOCK
    delay: float = 0.0  # seconds before answering a completion
    fail_status: int | None = None  # answer every completion with this status
    reuse_fails: bool = False  # prefill: answer 500 when asked to reuse a handle
    renewable: bool = False  # decode: retained leases accept heartbeats
    handle_in_stream: bool = False  # decode: put kv_transfer_params in the last stream chunk
    ttl: float = 60.0
    identity: dict[str, Any] | None = None  # override what the side channel says
    serve_identity: bool = True
    push_wait: float = 5.0
    tokens: int = 4
    token_delay: float = 0.001  # seconds between streamed tokens
    stream_closed: bool = False  # a stream's reader went away before the end
    drop: int = 0  # close this many completions' connections without answering
    seen: list[Seen] = field(default_factory=list)
    retained: dict[str, Retained] = field(default_factory=dict)  # by xfer
    leases: dict[str, float] = field(default_factory=dict)  # lease -> expires_at
    released: list[tuple[str, str]] = field(default_factory=list)  # (lease, reason)
    heartbeats: list[str] = field(default_factory=list)
    forged: list[str] = field(default_factory=list)  # what the signature check caught
    reuse_seen: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""
    side: _Side | None = None
    runner: web.AppRunner | None = None

    # --- running ---

    async def start(self) -> StandIn:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        self.side = _Side(self)
        self.side.start()
        if self.serve_identity:
            ident = self.identity or {  # the shape KvplaneConnector serves
                "v": 1,
                "endpoint": self.endpoint.to_dict(),
                "layout": {"block_size": self.block_size, "tp": 1, "num_layers": 2,
                           "num_kv_heads": 2, "head_bytes": 64},
                "ranks": [0],
                "settings": {"v": 1, "modes": ["pull", "push"], "bidirectional_kv_xfer": False,
                             "lease_renewable": self.renewable, "signed_handles": True},
            }
            self.side.set(IDENTITY_KEY, json.dumps(ident).encode())
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        if self.side is not None:
            # socketserver's shutdown() waits out its 0.5 s poll: let a thread wait for it
            threading.Thread(target=self.side.close, daemon=True).start()

    @property
    def spec(self) -> str:
        """The router's `--prefill/--decode` spec for this stand-in."""
        assert self.side is not None
        return f"{self.url},id={self.name},side=127.0.0.1:{self.side.port}"

    @property
    def endpoint(self) -> Endpoint:
        assert self.side is not None
        return Endpoint(self.name, "127.0.0.1", self.side.port, f"engine-{self.name}")

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.block_size, 1, 2, 2, 64)

    def completions_seen(self) -> list[Seen]:
        return [s for s in self.seen if s.path.endswith("completions")]

    # --- HTTP ---

    async def _models(self, _r: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _health(self, _r: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen = Seen(request.path, request.headers.get("X-Request-Id"), body, time.monotonic())
        self.seen.append(seen)
        if self.drop:  # as a server whose keep-alive ran out as the request came in
            self.drop -= 1
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        try:
            return await self._answer(request, body, seen)
        finally:
            seen.answered = time.monotonic()

    async def _answer(self, request: web.Request, body: dict[str, Any],
                      seen: Seen) -> web.StreamResponse:
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail_status is not None:
            return web.json_response(
                {"error": {"message": f"{self.name} is failing on purpose", "type": "x",
                           "code": self.fail_status}}, status=self.fail_status)
        try:
            leg = parse_leg(body.get("kv_transfer_params"), seen.request_id or "")
        except PeerError as exc:
            return web.json_response({"error": {"message": f"bad params: {exc}"}}, status=500)
        text = prompt_text(body)
        toks = tokens_of(text)
        chat = request.path.endswith("chat/completions")
        if leg is not None and leg.role == "prefill":
            return await self._prefill(leg, body, toks, chat)
        if leg is not None and leg.role == "decode" and leg.mode == "push":
            rv = self.rendezvous
            rv.event(rv.registered, leg.xfer).set()
            try:
                await asyncio.wait_for(rv.event(rv.written, leg.xfer).wait(), self.push_wait)
            except TimeoutError:
                return web.json_response({"error": {"message": "no KV arrived"}}, status=500)
        n = int(body.get("max_tokens") or self.tokens)
        retained = None
        if leg is not None and leg.role == "decode" and leg.retain:
            retained = self._retain(leg.xfer, leg.attempt, toks, leg.retain_ttl)
        if body.get("stream"):
            return await self._stream(request, n, chat, retained)
        out = self._completion_body(n, chat, len(toks))
        if retained is not None:
            out["kv_transfer_params"] = decode_response(retained)
        return web.json_response(out)

    async def _prefill(self, leg: Any, body: dict[str, Any], toks: list[int],
                       chat: bool) -> web.Response:
        reuse = (body["kv_transfer_params"]["kvplane"] or {}).get("reuse")
        if reuse is not None:
            self.reuse_seen.append(reuse)
            try:
                verify_wire(KEY, reuse)
            except HandleError as exc:
                self.forged.append(str(exc))
            if self.reuse_fails:
                return web.json_response({"error": {"message": "reuse read failed"}},
                                         status=500)
        out = self._completion_body(1, chat, len(toks))
        if leg.mode == "push":
            rv = self.rendezvous
            try:  # registration first or prefill first: both orders must work
                await asyncio.wait_for(rv.event(rv.registered, leg.xfer).wait(), self.push_wait)
            except TimeoutError:
                return web.json_response({"error": {"message": "no registration"}}, status=500)
            rv.event(rv.written, leg.xfer).set()
            return web.json_response(out)
        blocks = tuple(range(len(toks) // self.block_size + 1))
        handle = SourceHandle(self.endpoint, leg.xfer, leg.attempt, blocks, len(toks),
                              f"{leg.xfer}#{leg.attempt}/hold", time.time() + 30, self.layout)
        out["kv_transfer_params"] = prefill_response(handle, "pull")
        return web.json_response(out)

    def _retain(self, xfer: str, attempt: int, toks: list[int],
                ttl: float | None) -> Retained:
        expires = time.time() + min(self.ttl, ttl or self.ttl)
        lease = f"{xfer}#{attempt}/retained"
        r = Retained(self.endpoint, xfer, attempt, lease, tuple(range(len(toks) // BLOCK)),
                     len(toks), self.block_size, block_hashes(toks, self.block_size), expires,
                     self.renewable, self.layout)
        self.retained[xfer] = r
        self.leases[lease] = expires
        return r

    def _completion_body(self, n: int, chat: bool, prompt_tokens: int) -> dict[str, Any]:
        text = " ".join(f"tok{i}" for i in range(n))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": "cmpl-standin", "object": "chat.completion" if chat else "text_completion",
            "model": MODEL, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                      "total_tokens": prompt_tokens + n},
        }

    async def _stream(self, request: web.Request, n: int, chat: bool,
                      retained: Retained | None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        def chunk(i: int, last: bool) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
            if chat:
                c["delta"] = {"content": f"tok{i} "}
            else:
                c["text"] = f"tok{i} "
            return {"id": "cmpl-standin", "model": MODEL, "choices": [c]}

        if chat:  # vLLM's first chat chunk carries the role and no text
            first = {"id": "cmpl-standin", "model": MODEL,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
            await resp.write(b"data: " + json.dumps(first).encode() + b"\n\n")
        try:
            for i in range(n):
                c = chunk(i, i == n - 1)
                if i == n - 1 and retained is not None and self.handle_in_stream:
                    c["kv_transfer_params"] = decode_response(retained)
                data = b"data: " + json.dumps(c).encode() + b"\n\n"
                # split events across writes, as TCP may: the router must reassemble them
                await resp.write(data[:7])
                await asyncio.sleep(self.token_delay)
                await resp.write(data[7:])
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionError:
            self.stream_closed = True  # vLLM aborts the request here
            return resp
        await resp.write_eof()
        return resp

    # --- side channel: leases ---

    def lease_call(self, kind: str, payload: str) -> bytes | None:
        try:
            wire = json.loads(payload)
            verify_wire(KEY, wire)
        except (ValueError, HandleError) as exc:
            self.forged.append(f"{kind}: {exc}")
            return None
        lease = wire.get("lease")
        if lease not in self.leases:
            return None
        if kind == "release":
            self.released.append((lease, "released"))
            del self.leases[lease]
            return json.dumps({"lease": lease, "released": True}).encode()
        self.heartbeats.append(lease)
        if not self.renewable:
            return None
        self.leases[lease] = time.time() + self.ttl
        return json.dumps({"lease": lease, "expires_at": self.leases[lease]}).encode()


async def standins(*names: str, **knobs: Any) -> list[StandIn]:
    """Start stand-ins sharing one rendezvous."""
    rv = Rendezvous()
    return [await StandIn(n, rendezvous=rv, **knobs).start() for n in names]


# --- the stand-ins' own checks ---------------------------------------------------------------


def test_standin_speaks_the_contract_parser() -> None:
    async def go() -> None:
        (p,) = await standins("prefill-0")
        try:
            import aiohttp

            body = {"model": MODEL, "prompt": "a b c d e", "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True,
                                           "kvplane": {"v": 1, "mode": "pull", "xfer": "x1"}}}
            async with aiohttp.ClientSession() as s, s.post(p.url + "/v1/completions",
                                                            json=body) as r:
                out = await r.json()
            pull = out["kv_transfer_params"]["kvplane"]["pull"]
            assert SourceHandle.from_dict(pull).xfer == "x1"
        finally:
            await p.stop()

    asyncio.run(go())
