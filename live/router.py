"""The KV-cache-aware router: an async HTTP service in front of prefill and decode instances.

What it serves: OpenAI-compatible `POST /v1/completions` and `POST /v1/chat/completions`
(streamed as server-sent events or not), `GET /v1/models`, `GET /health` and `GET /metrics`
(Prometheus). Modes: `pull`, `push`, `bidirectional` (the designs: docs/published.md).
The legs it sends and the answers it reads are `router_upstream`'s (the connector contract).

This file follows one request: admit (check and refuse before any engine works on it,
`kvplane.core.router_rules`), choose, prefill leg, decode leg, relay, end. First contact with
the instances is `router_contacts`, the conversation table and its leases `router_leases`,
refusals and the reading of an instance's answer `router_errors`.

Rules it keeps:
- Only the router writes `kv_transfer_params`: a client body that carries the field is refused
  with 400. Decode's answers lose the field before they reach the client.
- What P/D cannot serve (batch prompts, beam search, `best_of` > 1, greedy `n` > 1,
  `prompt_logprobs`, bad `max_tokens`/`min_tokens`) is refused before the prefill leg; the
  prefill leg is the request cut to one token without output-shaping fields; when decode
  refuses its leg (4xx) in pull, prefill's hold is given back at once (`unhold/`).
- Pull and bidirectional: prefill's one-token leg first, then decode's leg with the metadata
  prefill returned. Push: both legs at once, one `X-Request-Id`; if prefill fails, decode's
  leg is cut and the client gets the reason.
- The decode instance is chosen by `kvplane.core.routing.choose` over loads the router tracks
  itself (legs in flight per instance); `kv_affinity` prefers the decode that retains the
  conversation's KV. Prefill instances are chosen round robin, or least loaded otherwise,
  among those whose KV layout fits the chosen decode.
- The conversation table is the core's `SessionTable`, keyed by (tenant, conversation): the
  tenant comes from the API key (or `X-Tenant` without one), so one tenant's conversation id
  never reaches another tenant's KV. A turn takes its conversation's handle (single use), hands
  it to prefill signed with the router's HMAC key, and stores decode's new handle when the turn
  ends; a turn that stored nothing puts an unexpired handle back. A replaced or superseded lease
  is released on its decode; renewable leases of active conversations get heartbeats, idle
  ones are left to expire.
- Every decision and observation is a core event handed to the recorder; recording never waits
  for the database (`BatchingRecorder` queues, a thread writes). On start the table is rebuilt
  by folding the run's `Session*` events, so a restart loses no conversation (decode's full
  handle, which the table does not keep, is asked of decode's side channel when next needed).
- At first contact the router reads each instance's identity (side channel) and does not route
  to one that does not fit its mode, or pair instances whose KV layouts differ; the refusal
  names both sides' settings.
- Errors are OpenAI-shaped JSON, `{"error": {"message", "type", "param", "code"}}`: 400
  malformed or forbidden input, 401 bad API key, 404 unknown model, 413 oversize body; 502 an
  instance down, broken or misconfigured; 504 an instance too slow. Reuse that fails falls back
  to recompute (a second prefill attempt without the handle) and is recorded (`KVLoadFailed`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import aiohttp
from aiohttp import web

from kvplane.core.connector_rules import next_attempt
from kvplane.core.events import (
    Event,
    FirstTokenEmitted,
    KVLoadFailed,
    MetadataRelayed,
    RequestArrived,
    RequestFinished,
    RequestRouted,
    SessionDropped,
    SessionRenewed,
    SessionStored,
    SessionTaken,
)
from kvplane.core.reuse import RetainedHandle
from kvplane.core.router_rules import (
    after_turn,
    asks_retain,
    check_request,
    retry_prefill_without_reuse,
)
from kvplane.core.routing import Load, Policy, choose
from kvplane.core.sessions import SessionKey, SessionTable

from .router_config import Role, RouterConfig, Upstream
from .router_contacts import Contact, ContactsMixin
from .router_errors import Refusal, answer, error_body, refusal_of
from .router_handles import (
    HandleError,
    core_handle,
    sign_wire,
    tenant_of,
    valid_name,
    with_expiry,
)
from .router_leases import LeasesMixin
from .router_metrics import CONTENT_TYPE, RouterMetrics
from .router_proxy import SSEReader, completion_tokens, sse, strip_params
from .router_upstream import (
    FetchHandle,
    Heartbeat,
    Release,
    UpstreamError,
    decode_body,
    describe,
    kvplane_params,
    prefill_body,
    side_fetch_handle,
    side_heartbeat,
    side_release,
    side_unhold,
)

UPSTREAM_KEEPALIVE = 2.5  # seconds an idle connection to an engine is kept for reuse

log = logging.getLogger("kvplane.router")

T = TypeVar("T")

SESSION_EVENTS: tuple[type[Event], ...] = (
    SessionStored, SessionTaken, SessionDropped, SessionRenewed,
)
# what prefill may report in `kvplane.reuse.outcome`: "could not read, recomputed instead"
_REUSE_FAILED = ("failed", "expired", "refused")


class RecorderLike(Protocol):
    """What the router needs of a recorder (`kvplane.store.Recorder` fits)."""

    def record(self, event: Event) -> None: ...

    def flush(self) -> None: ...


@dataclass(slots=True)
class Turn:
    """One client request on its way through the router."""

    id: str  # also the transfer id (`xfer`) both legs carry
    endpoint: str  # "completions" | "chat"
    path: str
    body: dict[str, Any]
    stream: bool
    tenant: str
    conversation: str | None
    arrived: float  # wall clock (event time)
    t0: float  # monotonic
    turn: int = 0
    attempt: int = 0
    taken: RetainedHandle | None = None
    taken_wire: dict[str, Any] | None = None  # decode's full handle for `taken`, if known
    prefill: Upstream | None = None
    decode: Upstream | None = None
    ttft: float | None = None
    output_tokens: int = 0
    retained: dict[str, Any] | None = None  # decode's new handle (its dict)
    stored: bool = False
    cut: bool = False  # the stream broke off (upstream or client) after it had started

    @property
    def key(self) -> SessionKey | None:
        return (self.tenant, self.conversation) if self.conversation is not None else None


class Router(ContactsMixin, LeasesMixin):
    """The router's state and handlers; `app()` is the aiohttp application serving them."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        recorder: RecorderLike | None = None,
        history: Iterable[Event] = (),
        clock: Callable[[], float] = time.time,
        heartbeat: Heartbeat | None = None,
        release: Release | None = None,
        fetch_handle: FetchHandle | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.config = config.checked()
        self.recorder = recorder
        self.clock = clock
        self.metrics = RouterMetrics()
        self.table = SessionTable(instance=config.instance)
        self.turns: dict[SessionKey, int] = {}
        self.xfers: dict[SessionKey, str] = {}  # the transfer that stored each handle
        self.wires: dict[SessionKey, dict[str, Any]] = {}  # decode's full handle, by key
        self.rebuilt = 0
        for ev in history:
            if isinstance(ev, SESSION_EVENTS):
                self.table.apply(ev)
                self.rebuilt += 1
                if isinstance(ev, SessionStored):
                    key = (ev.tenant, ev.conversation)
                    self.turns[key] = self.turns.get(key, 0) + 1
                    if ev.request is not None:
                        self.xfers[key] = ev.request
        self.last_turn: dict[SessionKey, float] = {}  # monotonic end of the last turn
        ups = config.prefill + config.decode
        self.contacts: dict[str, Contact] = {u.id: Contact() for u in ups}
        self.inflight: dict[str, int] = {u.id: 0 for u in ups}
        self._rr: dict[Role, int] = {"prefill": 0, "decode": 0}
        self._session: aiohttp.ClientSession | None = None
        t = config.timeouts.control
        self._heartbeat = heartbeat or side_heartbeat(t)
        self._release = release or side_release(t)
        self._fetch_handle = fetch_handle or side_fetch_handle(t)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._lease_task: asyncio.Task[None] | None = None
        self._started = time.monotonic()
        self._on_close = on_close

    # --- the application -------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_body_bytes, middlewares=[self._errors_middleware]
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _app: web.Application) -> None:
        self._started = time.monotonic()
        self._session = aiohttp.ClientSession(
            # an idle pooled connection is dropped before the engine's HTTP server closes it
            # (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s); aiohttp's default (15 s) reuses ones
            # the server has closed when a loaded host has not yet read the close, and the leg
            # fails ("Can not write request body", "Server disconnected"). A loaded engine's
            # event loop can fire its keep-alive timer before reading a leg that came in under
            # it, so the margin is wide and `_post` sends such a leg once more.
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0,
                                           keepalive_timeout=UPSTREAM_KEEPALIVE),
            auto_decompress=False,
        )
        # rebuilt conversations count as active from now: a restart must not idle them out
        for key in self.table.handles:
            self.last_turn.setdefault(key, self._started)
        self._expire()
        self._lease_task = asyncio.create_task(self._lease_loop(), name="kvplane-router-leases")
        self._spawn(self.contact_all())

    async def _cleanup(self, _app: web.Application) -> None:
        if self._lease_task is not None:
            self._lease_task.cancel()
            with suppress(asyncio.CancelledError):
                await self._lease_task
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with suppress(BaseException):
                await task
        if self._session is not None:
            await self._session.close()
        if self.recorder is not None:
            try:
                await asyncio.to_thread(self.recorder.flush)
            except Exception:
                log.exception("flushing the recorder at shutdown failed")
        if self._on_close is not None:
            await asyncio.to_thread(self._on_close)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router's application has not started")
        return self._session

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @web.middleware
    async def _errors_middleware(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
            return self._error_response(
                Refusal(exc.status, exc.reason, "invalid_request_error", code.get(exc.status)),
                "other",
            )
        except Exception as exc:  # a bug must still answer in the API's shape
            log.exception("unhandled error in %s %s", request.method, request.path)
            return self._error_response(
                Refusal(500, f"internal router error: {exc!r}", "server_error", "internal_error"),
                "other",
            )

    def _error_response(
        self, r: Refusal, endpoint: str, headers: Mapping[str, str] | None = None
    ) -> web.Response:
        self.metrics.errors.labels(r.type, r.code or "").inc()
        self.metrics.requests.labels(endpoint, self.config.mode, str(r.status)).inc()
        return web.json_response(
            error_body(r.message, r.type, r.code, r.param), status=r.status, headers=headers
        )

    # --- small endpoints -------------------------------------------------------------------------

    async def health(self, _request: web.Request) -> web.Response:
        await self.contact_all()
        instances = {}
        for u in self.config.prefill + self.config.decode:
            c = self.contacts[u.id]
            instances[u.id] = {
                "role": u.role,
                "url": u.url,
                "side_channel": "{}:{}".format(*u.side_channel),
                "state": c.state,
                "reason": c.reason or None,
                "inflight": self.inflight[u.id],
                "settings": c.identity.summary() if c.identity is not None else None,
            }
        routable = all(
            any(self.contacts[u.id].state == "ok" for u in ups)
            for ups in (self.config.prefill, self.config.decode)
        )
        body = {
            "status": "ok" if routable else "unavailable",
            "mode": self.config.mode,
            "policy": self.config.policy.kind,
            "sessions": len(self.table.handles),
            "instances": instances,
        }
        return web.json_response(body, status=200 if routable else 503)

    async def models(self, _request: web.Request) -> web.Response:
        await self.contact_all()
        data = [{"id": m, "object": "model", "owned_by": "kvplane"} for m in self.known_models()]
        return web.json_response({"object": "list", "data": data})

    async def metrics_page(self, _request: web.Request) -> web.Response:
        self._session_gauges()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # --- completions -----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def _handle(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        endpoint = "chat" if chat else "completions"
        t0, arrived = time.monotonic(), self.clock()
        try:
            turn = await self._admit(request, chat=chat, t0=t0, arrived=arrived)
        except Refusal as r:
            return self._error_response(r, endpoint)
        ok = False
        try:
            resp = await self._serve(request, turn)
            ok = not turn.cut
            self.metrics.requests.labels(endpoint, self.config.mode, str(resp.status)).inc()
            return resp
        except Refusal as r:
            return self._error_response(r, endpoint, {"X-Request-Id": turn.id})
        except UpstreamError as exc:
            self._mark_down(exc.instance, exc)
            return self._error_response(refusal_of(exc), endpoint, {"X-Request-Id": turn.id})
        finally:
            self._end_turn(turn, ok=ok)

    async def _admit(
        self, request: web.Request, *, chat: bool, t0: float, arrived: float
    ) -> Turn:
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise Refusal(413, f"request body of {request.content_length} bytes is over the "
                          f"limit of {limit} bytes", code="request_too_large")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise Refusal(413, f"request body is over the limit of {limit} bytes",
                          code="request_too_large") from None
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise Refusal(400, f"malformed JSON in the request body: {exc}",
                          code="invalid_json") from None
        if not isinstance(body, dict):
            raise Refusal(400, "the request body must be a JSON object", code="invalid_json")
        if "kv_transfer_params" in body:
            raise Refusal(400, "kv_transfer_params is set by the router only; a client may not "
                          "send it", code="kv_transfer_params_forbidden",
                          param="kv_transfer_params")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise Refusal(400, "stream must be true or false", code="invalid_value",
                          param="stream")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise Refusal(400, "model must be a string", code="invalid_value", param="model")
        if chat and not isinstance(body.get("messages"), list):
            raise Refusal(400, "messages must be a list", code="invalid_value",
                          param="messages")
        if not chat and "prompt" not in body:
            raise Refusal(400, "prompt is required", code="missing_required_parameter",
                          param="prompt")
        has_auth = "Authorization" in request.headers
        tenant, source = tenant_of(request.headers, self.config.api_keys)
        if source == "invalid":
            raise Refusal(401 if has_auth else 400,
                          "unusable Authorization (want `Bearer <key>`) or X-Tenant header",
                          code="invalid_api_key" if has_auth else "invalid_tenant")
        if self.config.require_api_key and source != "known_key":
            raise Refusal(401, "a valid API key is required (Authorization: Bearer <key>)",
                          code="invalid_api_key")
        conversation = body.pop("conversation_id", None)
        if conversation is None:
            conversation = request.headers.get("X-Conversation-Id")
        if conversation is not None and not valid_name(conversation):
            raise Refusal(400, "conversation_id must be 1-256 printable ASCII characters "
                          "without spaces", code="invalid_value", param="conversation_id")
        await self.contact_all()
        known = self.known_models()
        if model is not None and known and model not in known:
            raise Refusal(404, f"The model `{model}` does not exist (served: "
                          f"{', '.join(known)})", code="model_not_found", param="model")
        lens = [c.max_model_len for c in self.contacts.values() if c.max_model_len]
        problem = check_request(body, chat=chat, max_model_len=min(lens) if lens else None)
        if problem is not None:  # before any engine works on it
            raise Refusal(400, problem.message, code=problem.code, param=problem.param)
        turn = Turn(
            id=f"kvp-{uuid.uuid4().hex}",
            endpoint="chat" if chat else "completions",
            path="/v1/chat/completions" if chat else "/v1/completions",
            body=body,
            stream=stream,
            tenant=tenant,
            conversation=conversation,
            arrived=arrived,
            t0=t0,
        )
        if turn.key is not None:
            turn.turn = self.turns.get(turn.key, 0)
        prompt = body.get("prompt")
        token_ids = isinstance(prompt, list) and all(isinstance(x, int) for x in prompt)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        self._record(
            RequestArrived(
                at=arrived,
                instance=self.config.instance,
                request=turn.id,
                # 0: unknown here (the router does not tokenize text)
                prompt_tokens=len(prompt) if token_ids and isinstance(prompt, list) else 0,
                output_tokens=max_tokens if isinstance(max_tokens, int) else 0,
                conversation=conversation,
                tenant=tenant,
                turn=turn.turn,
            )
        )
        return turn

    async def _serve(self, request: web.Request, turn: Turn) -> web.StreamResponse:
        prefills, decodes = self._usable("prefill"), self._usable("decode")
        bidi = self.config.mode == "bidirectional"
        if bidi and turn.key is not None:
            self._take(turn)
        affinity = turn.taken.decode if turn.taken is not None else None
        turn.decode = self._choose("decode", decodes, affinity)
        turn.prefill = self._choose("prefill", self._pairable(prefills, turn.decode), None)
        self._record(
            RequestRouted(
                at=self.clock(),
                instance=self.config.instance,
                request=turn.id,
                mode="push" if self.config.mode == "push" else "pull",
                prefill=turn.prefill.id,
                decode=turn.decode.id,
                bidirectional=bidi,
            )
        )
        if self.config.mode == "push":
            return await self._push(request, turn)
        return await self._pull(request, turn)

    def _choose(self, role: Role, ups: list[Upstream], affinity: str | None) -> Upstream:
        loads = [Load(u.id, running=self.inflight[u.id]) for u in ups]
        policy = self.config.policy
        if role == "prefill" and policy.kind == "kv_affinity":
            policy = Policy("least_loaded")
        name = choose(policy, loads, self._rr[role], affinity)
        self._rr[role] += 1
        return next(u for u in ups if u.id == name)

    # --- the legs --------------------------------------------------------------------------------

    def _headers(self, turn: Turn) -> dict[str, str]:
        return {"X-Request-Id": turn.id, "Content-Type": "application/json",
                **self._upstream_auth()}

    def _upstream_auth(self) -> dict[str, str]:
        key = self.config.upstream_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _leg_started(self, up: Upstream) -> float:
        self.inflight[up.id] += 1
        self.metrics.inflight.labels(up.role, up.id).set(self.inflight[up.id])
        return time.monotonic()

    def _leg_ended(self, up: Upstream) -> None:
        self.inflight[up.id] -= 1
        self.metrics.inflight.labels(up.role, up.id).set(self.inflight[up.id])

    async def _post(self, up: Upstream, turn: Turn, body: Mapping[str, Any],
                    timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        """POST a leg; sent once more if the instance closed the pooled connection before
        answering (its keep-alive ran out as the leg went out: it never read the leg). A
        refused or timed-out connection, a second close, or a break after the answer began is
        not retried."""
        def send() -> Any:  # aiohttp's request context: awaited, the response
            return self.session.post(up.url + turn.path, json=body, headers=self._headers(turn),
                                     timeout=timeout)

        try:
            return await send()
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):
                raise
            log.info("%s closed a pooled connection before answering %s's %s leg (%s); "
                     "sending it again", up.id, turn.id, up.role, exc)
            self.metrics.stale_retries.labels(up.role, up.id).inc()
        return await send()

    async def _prefill_leg(self, turn: Turn, reuse: Mapping[str, Any] | None) -> dict[str, Any]:
        """Prefill's one-token leg; its answer (JSON object) or `UpstreamError`."""
        up = turn.prefill
        assert up is not None
        body = prefill_body(
            turn.body,
            chat=turn.endpoint == "chat",
            mode=self.config.mode,
            xfer=turn.id,
            attempt=turn.attempt,
            reuse=reuse,
            tenant=turn.tenant,
            conversation=turn.conversation,
        )
        limit = self.config.timeouts.prefill
        t = self._leg_started(up)
        try:
            timeout = aiohttp.ClientTimeout(total=limit, sock_connect=self.config.timeouts.connect)
            async with await self._post(up, turn, body, timeout) as resp:
                status, text = resp.status, await resp.text()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise describe(exc, up, "prefill leg", limit) from None
        finally:
            self._leg_ended(up)
            self.metrics.upstream_latency.labels("prefill", up.id, "prefill").observe(
                time.monotonic() - t
            )
        return answer(up, "prefill leg", status, text)

    async def _reuse_wire(self, turn: Turn) -> dict[str, Any] | None:
        """The signed handle for prefill's `reuse`, or None (recorded) if it cannot be had."""
        h, key = turn.taken, turn.key
        if h is None or key is None:
            return None
        wire = turn.taken_wire
        if wire is None:  # rebuilt after a restart: ask decode for the full handle
            up, xfer = self.config.upstream(h.decode), self.xfers.get(key)
            if up is not None and xfer is not None:
                try:
                    wire = await self._fetch_handle(up, xfer)
                except (TimeoutError, UpstreamError, aiohttp.ClientError) as exc:
                    log.warning("fetching %s's handle from %s failed: %s", xfer, h.decode, exc)
            if wire is None or wire.get("lease") != h.lease:
                self._reuse_failed(turn, "unavailable",
                                   f"decode {h.decode} has no handle for lease {h.lease}")
                return None
            turn.taken_wire = wire
        self.metrics.transfers.labels(self.config.mode, "D->P").inc()
        return sign_wire(self.config.hmac_key, with_expiry(wire, h), key[0], key[1])

    async def _prefill_with_fallback(self, turn: Turn) -> dict[str, Any]:
        """Prefill, reusing the taken handle if any; a failed reuse is recomputed (recorded)."""
        reuse = await self._reuse_wire(turn)
        try:
            answer = await self._prefill_leg(turn, reuse)
        except UpstreamError as exc:
            if not retry_prefill_without_reuse(reuse is not None, exc.kind, exc.status):
                raise
            self._reuse_failed(turn, "prefill_error", f"prefill failed with the handle: {exc}")
            turn.attempt = next_attempt(turn.attempt)
            return await self._prefill_leg(turn, None)
        info = kvplane_params(answer)
        outcome = info.get("reuse") if info else None
        if reuse is not None and isinstance(outcome, dict):
            what = outcome.get("outcome")
            if what in _REUSE_FAILED:
                self._reuse_failed(turn, str(what), str(outcome.get("reason") or what))
        return answer

    def _reuse_failed(self, turn: Turn, kind: str, reason: str) -> None:
        self.metrics.reuse_fallbacks.labels(kind).inc()
        self._record(
            KVLoadFailed(
                at=self.clock(),
                instance=self.config.instance,
                request=turn.id,
                attempt=turn.attempt,
                reason=f"reuse fell back to recompute ({kind}): {reason}",
            )
        )

    async def _pull(self, request: web.Request, turn: Turn) -> web.StreamResponse:
        answer = await self._prefill_with_fallback(turn)
        assert turn.prefill is not None and turn.decode is not None
        params = answer.get("kv_transfer_params")
        info = kvplane_params(answer)
        pull = info.get("pull") if info else None
        if not isinstance(params, dict) or not isinstance(pull, dict):
            # prefill kept nothing for decode (its connector said no transfer): decode computes
            # the prompt itself; slower, but the client still gets its answer
            self._reuse_failed(turn, "no_prefill_kv",
                               f"prefill {turn.prefill.id} returned no KV handle")
            return await self._decode_leg(request, turn, pulled=None, source=None, guard=None)
        blocks = pull.get("blocks")
        num_tokens = pull.get("num_tokens")
        self._record(
            MetadataRelayed(
                at=self.clock(),
                instance=self.config.instance,
                request=turn.id,
                attempt=turn.attempt,
                prefill=turn.prefill.id,
                decode=turn.decode.id,
                src_blocks=tuple(b for b in blocks if isinstance(b, int))
                if isinstance(blocks, list)
                else (),
                num_tokens=num_tokens if isinstance(num_tokens, int) else 0,
            )
        )
        self.metrics.transfers.labels(self.config.mode, "P->D").inc()
        try:
            return await self._decode_leg(request, turn, pulled=params, source=None,
                                          guard=None)
        except UpstreamError as exc:
            if exc.kind == "status" and 400 <= exc.status < 500:
                # decode refused the leg before its engine saw it: nothing will read
                # prefill's hold, so give it back now rather than after its lease
                await self._unhold(turn, pull)
            raise

    async def _unhold(self, turn: Turn, pull: Mapping[str, Any]) -> None:
        up = turn.prefill
        assert up is not None
        try:
            released = await side_unhold(up, pull, self.config.timeouts.control)
        except (TimeoutError, UpstreamError, aiohttp.ClientError) as exc:
            log.warning("giving back %s's hold on %s failed: %s", turn.id, up.id, exc)
            return
        log.info("decode refused %s: prefill %s %s its hold", turn.id, up.id,
                 "released" if released else "did not release")

    async def _push(self, request: web.Request, turn: Turn) -> web.StreamResponse:
        assert turn.prefill is not None
        ident = self.contacts[turn.prefill.id].identity
        if ident is None:
            raise Refusal(502, f"push needs prefill {turn.prefill.id}'s side-channel endpoint, "
                          "which the router has not learned (settings check off?)",
                          "server_error", "kv_mode_mismatch")
        self.metrics.transfers.labels(self.config.mode, "P->D").inc()
        prefill = asyncio.create_task(self._prefill_leg(turn, None))
        try:
            # prefill's KV layout goes with its endpoint: decode counts one completion per
            # prefill rank stream, so it must know prefill's TP
            layout = ident.raw.get("layout")
            source = {**ident.endpoint, **({"layout": layout} if isinstance(layout, dict) else {})}
            resp = await self._decode_leg(request, turn, pulled=None, source=source,
                                          guard=prefill)
        except BaseException:
            prefill.cancel()
            with suppress(BaseException):
                await prefill
            raise
        try:
            await prefill
        except UpstreamError as exc:  # decode answered anyway (it computed the prompt)
            log.warning("push: prefill leg of %s failed after decode answered: %s", turn.id, exc)
        return resp

    async def _race(self, aw: Awaitable[T], guard: asyncio.Task[Any] | None) -> T:
        """Await `aw`, unless the guard (push's prefill leg) fails first: then raise its error."""
        if guard is None or (guard.done() and guard.exception() is None):
            return await aw
        task = asyncio.ensure_future(aw)
        try:
            done, _ = await asyncio.wait({task, guard}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        if task in done:
            return task.result()
        exc = guard.exception()
        if exc is None:
            return await task
        task.cancel()
        with suppress(BaseException):
            await task
        raise exc

    async def _decode_leg(
        self,
        request: web.Request,
        turn: Turn,
        *,
        pulled: Mapping[str, Any] | None,
        source: Mapping[str, Any] | None,
        guard: asyncio.Task[Any] | None,
    ) -> web.StreamResponse:
        up, prefill = turn.decode, turn.prefill
        assert up is not None and prefill is not None
        retain = asks_retain(self.config.mode, turn.key is not None)
        body = decode_body(
            turn.body,
            mode=self.config.mode,
            xfer=turn.id,
            attempt=turn.attempt,
            prefill=prefill.id,
            pulled=pulled,
            source=source,
            retain=True if retain else None,
            retain_ttl=self.config.leases.ttl if retain else None,
            tenant=turn.tenant,
            conversation=turn.conversation,
        )
        to = self.config.timeouts
        if turn.stream:
            timeout = aiohttp.ClientTimeout(sock_connect=to.connect, sock_read=to.decode_gap)
        else:
            timeout = aiohttp.ClientTimeout(sock_connect=to.connect, total=to.decode_first)
        t = self._leg_started(up)
        resp: aiohttp.ClientResponse | None = None
        try:
            try:
                resp = await self._race(
                    asyncio.wait_for(self._post(up, turn, body, timeout), to.decode_first),
                    guard,
                )
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise describe(exc, up, "decode leg", to.decode_first) from None
            finally:
                self.metrics.upstream_latency.labels("decode", up.id, "decode").observe(
                    time.monotonic() - t
                )
            if resp.status != 200 or not turn.stream:
                try:
                    text = await self._race(resp.text(), guard)
                except (TimeoutError, aiohttp.ClientError) as exc:
                    raise describe(exc, up, "decode leg", to.decode_first) from None
                return self._reply_whole(turn, answer(up, "decode leg", resp.status, text),
                                         retain)
            return await self._relay(request, turn, resp, guard, retain)
        finally:
            if resp is not None:
                resp.release()
            self._leg_ended(up)

    def _reply_whole(self, turn: Turn, answer: dict[str, Any], retain: bool) -> web.Response:
        info = strip_params(answer)
        turn.ttft = time.monotonic() - turn.t0
        self._first_token(turn)
        turn.output_tokens = completion_tokens(answer) or 0
        if retain:
            handle = info.get("retained") if info else None
            turn.retained = handle if isinstance(handle, dict) else None
        return web.json_response(answer, headers={"X-Request-Id": turn.id})

    async def _relay(
        self,
        request: web.Request,
        turn: Turn,
        resp: aiohttp.ClientResponse,
        guard: asyncio.Task[Any] | None,
        retain: bool,
    ) -> web.StreamResponse:
        """Pass decode's SSE stream to the client, event by event."""
        up = turn.decode
        assert up is not None
        reader = SSEReader()
        client: web.StreamResponse | None = None

        async def send(raw: bytes, tokens: bool) -> None:
            nonlocal client
            if client is None:
                client = web.StreamResponse(
                    status=200,
                    headers={
                        "Content-Type": "text/event-stream",
                        "Cache-Control": "no-cache",
                        "X-Request-Id": turn.id,
                    },
                )
                await client.prepare(request)
            await client.write(raw)
            if tokens and turn.ttft is None:
                turn.ttft = time.monotonic() - turn.t0
                self._first_token(turn)

        gap = self.config.timeouts.decode_gap
        try:
            while True:
                try:
                    chunk = await self._race(resp.content.readany(), guard)
                except (TimeoutError, aiohttp.ClientError) as exc:
                    raise describe(exc, up, "decode stream", gap) from None
                if not chunk:
                    break
                for raw, tokens in reader.feed(chunk):
                    await send(raw, tokens)
            for raw, tokens in reader.rest():
                await send(raw, tokens)
        except UpstreamError as exc:
            if client is None:
                raise
            self._mark_down(exc.instance, exc)
            turn.cut = True  # the client gets the reason as a last event
            with suppress(ConnectionError):
                await client.write(
                    sse(error_body(exc.reason, "server_error", "upstream_stream_broken"))
                )
                await client.write(b"data: [DONE]\n\n")
        except ConnectionError:
            turn.cut = True  # the client went away; closing decode's stream aborts it there
            resp.close()
            return client or web.Response(status=499)
        turn.output_tokens = reader.output_tokens
        if retain and not turn.cut:
            handle = reader.kvplane.get("retained") if reader.kvplane else None
            if not isinstance(handle, dict):
                # vLLM 0.32 puts kv_transfer_params in whole answers only: ask decode's side
                # channel for the handle it retained for this transfer
                try:
                    handle = await self._fetch_handle(up, turn.id)
                except (TimeoutError, UpstreamError, aiohttp.ClientError) as exc:
                    log.warning("no retained handle for %s from %s: %s", turn.id, up.id, exc)
                    handle = None
            turn.retained = handle if isinstance(handle, dict) else None
        if client is None:  # an empty stream: still answer a well-formed one
            await send(b"data: [DONE]\n\n", False)
        assert client is not None
        with suppress(ConnectionError):
            await client.write_eof()
        return client

    def _end_turn(self, turn: Turn, *, ok: bool) -> None:
        """Record the outcome; store decode's new handle, or put the taken one back."""
        e2e = time.monotonic() - turn.t0
        ttft = turn.ttft if turn.ttft is not None else e2e
        n = turn.output_tokens
        mode = self.config.mode
        self._record(
            RequestFinished(
                at=self.clock(),
                instance=self.config.instance,
                request=turn.id,
                output_tokens=n,
                ttft=ttft,
                tpot=(e2e - ttft) / (n - 1) if n > 1 else 0.0,
                e2e=e2e,
                ok=ok,
            )
        )
        if ok:
            self.metrics.ttft.labels(mode, str(turn.stream).lower()).observe(ttft)
            self.metrics.e2e.labels(mode).observe(e2e)
        key = turn.key
        if key is None:
            return
        self.last_turn[key] = time.monotonic()
        if mode != "bidirectional":
            return
        now = self.clock()
        if ok and turn.retained is not None and turn.decode is not None:
            try:
                new = core_handle(turn.retained, decode=turn.decode.id)
            except HandleError as exc:
                log.warning("decode %s returned an unusable handle for %s: %s",
                            turn.decode.id, turn.id, exc)
                self.metrics.errors.labels("upstream_protocol", "bad_handle").inc()
            else:
                self._store(key, new, turn.retained, turn.id, now)
                self.turns[key] = self.turns.get(key, 0) + 1
                turn.stored = True
        taken = turn.taken
        if taken is None:
            return
        current = self.table.handle_of(*key)
        action = after_turn(stored_new=turn.stored, taken_lease=taken.lease,
                            current_lease=current.lease if current else None,
                            taken_expires_at=taken.expires_at, now=now)
        if action == "release":
            self._release_later(key, taken, turn.taken_wire, "superseded")
        elif action == "put_back":
            # nothing newer (the turn failed, or decode kept nothing): the old KV is still a
            # prefix of the conversation, so keep it for the next turn
            self._store(key, taken, turn.taken_wire, turn.id, now)

    # --- recording -------------------------------------------------------------------------------

    def _first_token(self, turn: Turn) -> None:
        assert turn.ttft is not None
        self._record(
            FirstTokenEmitted(
                at=self.clock(), instance=self.config.instance, request=turn.id, ttft=turn.ttft
            )
        )

    def _record(self, event: Event) -> None:
        if self.recorder is None:
            return
        try:
            self.recorder.record(event)  # checks and queues; never waits for the database
        except Exception:  # a recorder problem must not fail a client request
            self.metrics.recorder_failures.inc()
            log.exception("recording %s failed", type(event).__name__)

    def _record_all(self, events: Iterable[Event]) -> None:
        for ev in events:
            self._record(ev)


# --- running it ----------------------------------------------------------------------------------


async def start(
    router: Router, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, str]:
    """Serve the router; `(runner, base URL)`. `await runner.cleanup()` stops it."""
    runner = web.AppRunner(router.app(), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    addr = runner.addresses[0]
    return runner, f"http://{addr[0]}:{addr[1]}"


# --- the store: which run, and the table's history -----------------------------------------------


def resume_run(
    store: Any, *, name: str = "router", run_id: str | None = None, fresh: bool = False
) -> tuple[str, list[Event]]:
    """The run the router records into, and the `Session*` events to rebuild its table from.

    `run_id` given: that run (created if new: every process of a deployment may share one).
    Otherwise the newest live run of this router (`scenario` `router:<name>`), unless `fresh`
    or there is none: then a new run. Blocking (database I/O): call it before serving.
    """
    from kvplane.store import RunNotFound

    scenario = f"router:{name}"
    meta = {"component": "router", "name": name}
    if run_id is not None:
        try:
            store.run(run_id)
        except RunNotFound:
            store.create_run("live", scenario, meta=meta, run_id=run_id)
    else:
        runs = [] if fresh else [r for r in store.runs("live") if r.scenario == scenario]
        run_id = runs[-1].id if runs else store.create_run("live", scenario, meta=meta)
    assert run_id is not None
    history = list(store.events(run_id, types=list(SESSION_EVENTS)))
    return run_id, history
