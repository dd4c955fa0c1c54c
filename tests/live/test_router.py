"""The router as a real aiohttp server on 127.0.0.1, in front of real HTTP stand-ins for vLLM.

Proxying (streamed and whole), the order of the legs in pull and push, bad input (400, 401,
404, 413), instances down (502), slow (504) or misconfigured (502 naming both sides' settings),
and the Prometheus page. Conversations, tenants, leases and restarts: test_router_sessions.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from test_router_standins import KEY, MODEL, StandIn, standins

from kvplane.core.events import (
    FirstTokenEmitted,
    MetadataRelayed,
    RequestArrived,
    RequestFinished,
    RequestRouted,
)
from kvplane.live.router import Router, start
from kvplane.live.router_config import RouterConfig, Timeouts, parse_upstream
from kvplane.store import ListRecorder

pytestmark = pytest.mark.timeout(60)


def make_config(prefill: list[StandIn], decode: list[StandIn], **kw: Any) -> RouterConfig:
    return RouterConfig(
        prefill=tuple(parse_upstream(s.spec, "prefill", i) for i, s in enumerate(prefill)),
        decode=tuple(parse_upstream(s.spec, "decode", i) for i, s in enumerate(decode)),
        hmac_key=KEY,
        **kw,
    )


@asynccontextmanager
async def serving(router: Router) -> AsyncIterator[str]:
    runner, url = await start(router)
    try:
        yield url
    finally:
        await runner.cleanup()


async def post(url: str, body: Any, *, headers: dict[str, str] | None = None,
               raw: bytes | None = None) -> tuple[int, Any, dict[str, str]]:
    async with aiohttp.ClientSession() as s:
        kw: dict[str, Any] = {"data": raw} if raw is not None else {"json": body}
        async with s.post(url, headers=headers, **kw) as r:
            text = await r.text()
            try:
                data: Any = json.loads(text)
            except json.JSONDecodeError:
                data = text
            return r.status, data, {k.lower(): v for k, v in r.headers.items()}


async def get_text(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.text()


def sse_events(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


async def stop(*instances: StandIn) -> None:
    for s in instances:
        await s.stop()


# --- proxying and leg order -------------------------------------------------------------------


def test_pull_whole_answer_prefill_first_then_decode_with_prefills_metadata() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0")
        rec = ListRecorder()
        router = Router(make_config([p], [d], mode="pull"), recorder=rec)
        try:
            async with serving(router) as url:
                status, body, headers = await post(
                    url + "/v1/completions",
                    {"model": MODEL, "prompt": "one two three four five six", "max_tokens": 3},
                )
            assert status == 200, body
            assert body["choices"][0]["text"] == "tok0 tok1 tok2"
            assert "kv_transfer_params" not in body  # the connector's metadata stays inside
            (pl,), (dl,) = p.completions_seen(), d.completions_seen()
            # one request id on both legs, and it is the one the client gets back
            assert pl.request_id == dl.request_id == headers["x-request-id"]
            # prefill: one token, whole; decode: the client's request
            assert pl.body["max_tokens"] == 1 and pl.body["stream"] is False
            assert pl.body["kv_transfer_params"]["do_remote_decode"] is True
            assert dl.body["max_tokens"] == 3
            # pull: decode's leg leaves after prefill answered, carrying prefill's held blocks
            assert pl.answered is not None and pl.answered <= dl.arrived
            params = dl.body["kv_transfer_params"]
            assert params["do_remote_prefill"] is True
            assert params["kvplane"]["pull"]["source"]["instance"] == "prefill-0"
            assert params["kvplane"]["xfer"] == pl.request_id
            kinds = [type(e) for e in rec.events]
            assert kinds[:3] == [RequestArrived, RequestRouted, MetadataRelayed]
            assert FirstTokenEmitted in kinds and kinds[-1] is RequestFinished
            fin = rec.events[-1]
            assert isinstance(fin, RequestFinished) and fin.ok and fin.output_tokens == 3
        finally:
            await stop(p, d)

    run(go)


def test_pull_stream_relays_every_event_and_strips_kv_params() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0", handle_in_stream=True)
        rec = ListRecorder()
        router = Router(make_config([p], [d], mode="bidirectional"), recorder=rec)
        try:
            async with serving(router) as url:
                status, text, headers = await post(
                    url + "/v1/chat/completions",
                    {"model": MODEL, "stream": True, "max_tokens": 5, "conversation_id": "c1",
                     "messages": [{"role": "user", "content": "hello there you"}]},
                )
            assert status == 200 and headers["content-type"].startswith("text/event-stream")
            events = sse_events(text)
            assert events[-1] == "[DONE]"
            chunks = events[:-1]
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            words = "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:])
            assert words == "tok0 tok1 tok2 tok3 tok4 "
            assert all("kv_transfer_params" not in c for c in chunks)  # stripped on the way
            assert "conversation_id" not in d.completions_seen()[0].body
            fin = rec.of_type(RequestFinished)[-1]
            assert isinstance(fin, RequestFinished) and fin.output_tokens == 5
            ft = rec.of_type(FirstTokenEmitted)
            assert len(ft) == 1 and 0 < ft[0].ttft <= fin.e2e  # type: ignore[attr-defined]
            # the handle came in the stream, so the table holds it without asking decode
            assert router.table.handle_of("default", "c1") is not None
        finally:
            await stop(p, d)

    run(go)


def test_push_sends_both_legs_at_once_with_one_request_id() -> None:
    async def go() -> None:
        # each stand-in waits for the other's leg (registration / written KV): a router that
        # sent the legs one after the other would time out here
        p, d = await standins("prefill-0", "decode-0", push_wait=3.0)
        router = Router(make_config([p], [d], mode="push"))
        try:
            async with serving(router) as url:
                for stream in (False, True):
                    status, body, _ = await post(
                        url + "/v1/completions",
                        {"model": MODEL, "prompt": "a b c d", "max_tokens": 2, "stream": stream},
                    )
                    assert status == 200, body
            for pl, dl in zip(p.completions_seen(), d.completions_seen()):
                assert pl.request_id == dl.request_id
                assert pl.answered is not None and dl.answered is not None
                assert dl.arrived < pl.answered and pl.arrived < dl.answered  # both in flight
                assert pl.body["kv_transfer_params"]["kvplane"]["mode"] == "push"
                source = dl.body["kv_transfer_params"]["kvplane"]["source"]
                layout = source.pop("layout")  # prefill's KV layout rides with its endpoint
                assert layout["tp"] == 1 and layout["block_size"] == p.block_size
                assert source == p.endpoint.to_dict()  # prefill's side channel, from first contact
        finally:
            await stop(p, d)

    run(go)


def test_push_prefill_failure_cuts_decode_and_answers_502() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0", push_wait=10.0)
        p.fail_status = 500
        router = Router(make_config([p], [d], mode="push"))
        try:
            async with serving(router) as url:
                status, body, _ = await post(url + "/v1/completions",
                                             {"model": MODEL, "prompt": "a b", "stream": True})
            assert status == 502
            assert body["error"]["code"] == "upstream_error"
            assert "prefill instance prefill-0" in body["error"]["message"]
            assert router.inflight == {"prefill-0": 0, "decode-0": 0}
        finally:
            await stop(p, d)

    run(go)


def test_client_going_away_mid_stream_cuts_decodes_stream() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0", tokens=200, token_delay=0.01)
        rec = ListRecorder()
        router = Router(make_config([p], [d]), recorder=rec)
        try:
            async with serving(router) as url:
                async with aiohttp.ClientSession() as s, s.post(
                    url + "/v1/completions", json={"model": MODEL, "prompt": "x",
                                                   "stream": True}
                ) as r:
                    assert r.status == 200
                    await r.content.readline()  # the first event arrived; now hang up
                for _ in range(100):
                    if d.stream_closed and rec.of_type(RequestFinished):
                        break
                    await asyncio.sleep(0.02)
            assert d.stream_closed  # decode saw its stream closed: vLLM aborts the request
            fin = rec.of_type(RequestFinished)
            assert len(fin) == 1 and not fin[0].ok  # type: ignore[attr-defined]
            assert router.inflight == {"prefill-0": 0, "decode-0": 0}
        finally:
            await stop(p, d)

    run(go)


def test_decode_choice_follows_the_policy_over_tracked_loads() -> None:
    async def go() -> None:
        p, d0, d1 = await standins("prefill-0", "decode-0", "decode-1")
        router = Router(make_config([p], [d0, d1], mode="pull"))
        try:
            async with serving(router) as url:
                for _ in range(4):
                    status, _, _ = await post(url + "/v1/completions",
                                              {"model": MODEL, "prompt": "x y"})
                    assert status == 200
            assert len(d0.completions_seen()) == len(d1.completions_seen()) == 2  # round robin
        finally:
            await stop(p, d0, d1)

    run(go)


# --- bad input ----------------------------------------------------------------------------------


def test_bad_input_gets_openai_shaped_4xx_and_reaches_no_instance() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0")
        router = Router(make_config([p], [d], max_body_bytes=2048,
                                    api_keys={"sk-good": "acme"}))
        try:
            async with serving(router) as url:
                cases: list[tuple[dict[str, Any], int, str]] = [
                    ({"raw": b"{not json"}, 400, "invalid_json"),
                    ({"raw": b"[1, 2]"}, 400, "invalid_json"),
                    ({"body": {"model": MODEL, "prompt": "x",
                               "kv_transfer_params": {"kvplane": {"role": "decode"}}}},
                     400, "kv_transfer_params_forbidden"),
                    ({"body": {"model": "gpt-17", "prompt": "x"}}, 404, "model_not_found"),
                    ({"body": {"model": MODEL, "prompt": "x" * 5000}}, 413, "request_too_large"),
                    ({"body": {"model": MODEL, "prompt": "x", "stream": "yes"}}, 400,
                     "invalid_value"),
                    ({"body": {"model": MODEL}}, 400, "missing_required_parameter"),
                    ({"body": {"model": MODEL, "prompt": "x", "conversation_id": "a b"}}, 400,
                     "invalid_value"),
                    ({"body": {"model": MODEL, "prompt": "x"},
                      "headers": {"Authorization": "Basic Zm9v"}}, 401, "invalid_api_key"),
                ]
                for case, want_status, want_code in cases:
                    status, body, _ = await post(
                        url + "/v1/completions", case.get("body"), raw=case.get("raw"),
                        headers=case.get("headers"),
                    )
                    assert status == want_status, (case, body)
                    err = body["error"]
                    assert err["code"] == want_code and err["type"] == "invalid_request_error"
                    assert isinstance(err["message"], str) and err["message"]
                # chunked upload without Content-Length, over the limit
                async def chunks() -> AsyncIterator[bytes]:
                    for _ in range(4):
                        yield b" " * 1024

                async with aiohttp.ClientSession() as s, s.post(
                    url + "/v1/completions", data=chunks()
                ) as r:
                    assert r.status == 413
                    assert (await r.json())["error"]["code"] == "request_too_large"
                status, body, _ = await post(url + "/v1/nothing", {})
                assert status == 404 and body["error"]["code"] == "not_found"
            assert p.completions_seen() == [] and d.completions_seen() == []
        finally:
            await stop(p, d)

    run(go)


def test_required_api_key() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0")
        router = Router(make_config([p], [d], api_keys={"sk-good": "acme"},
                                    require_api_key=True))
        try:
            async with serving(router) as url:
                body = {"model": MODEL, "prompt": "x"}
                status, out, _ = await post(url + "/v1/completions", body)
                assert status == 401 and out["error"]["code"] == "invalid_api_key"
                status, _, _ = await post(url + "/v1/completions", body,
                                          headers={"Authorization": "Bearer sk-bad"})
                assert status == 401
                status, _, _ = await post(url + "/v1/completions", body,
                                          headers={"Authorization": "Bearer sk-good"})
                assert status == 200
        finally:
            await stop(p, d)

    run(go)


def test_engine_rejection_is_passed_back_to_the_client() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0")
        p.fail_status = 400
        router = Router(make_config([p], [d]))
        try:
            async with serving(router) as url:
                status, body, _ = await post(url + "/v1/completions",
                                             {"model": MODEL, "prompt": "x"})
            assert status == 400
            assert body["error"]["message"] == "prefill-0 is failing on purpose"
        finally:
            await stop(p, d)

    run(go)


# --- instances down, slow, misconfigured ----------------------------------------------------------


def test_instance_down_is_502_naming_it() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0")
        cfg = make_config([p], [d])
        dead = d.spec.replace(d.url, "http://127.0.0.1:9")  # nothing listens on port 9
        cfg = RouterConfig(prefill=cfg.prefill, decode=(parse_upstream(dead, "decode", 0),),
                           hmac_key=KEY)
        router = Router(cfg)
        try:
            async with serving(router) as url:
                status, body, _ = await post(url + "/v1/completions",
                                             {"model": MODEL, "prompt": "x"})
                assert status == 502, body
                assert body["error"]["type"] == "server_error"
                assert body["error"]["code"] == "upstream_unavailable"
                assert "decode instance decode-0 (http://127.0.0.1:9) is unreachable" in \
                    body["error"]["message"]
                status, health = await get_text(url + "/health")
                assert status == 503 and json.loads(health)["instances"]["decode-0"]["state"] \
                    == "down"
        finally:
            await stop(p, d)

    run(go)


def test_instance_dying_after_first_contact_is_502() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0")
        router = Router(make_config([p], [d]))
        try:
            async with serving(router) as url:
                status, _, _ = await post(url + "/v1/completions", {"model": MODEL, "prompt": "x"})
                assert status == 200
                await d.stop()
                status, body, _ = await post(url + "/v1/completions",
                                             {"model": MODEL, "prompt": "x"})
                assert status == 502 and "decode instance decode-0" in body["error"]["message"]
        finally:
            await stop(p, d)

    run(go)


def test_a_closed_pooled_connection_is_sent_again_once() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0")
        router = Router(make_config([p], [d], mode="pull"))
        try:
            async with serving(router) as url:
                p.drop = d.drop = 1  # each closes one leg's connection unanswered
                status, body, _ = await post(url + "/v1/completions",
                                             {"model": MODEL, "prompt": "x", "max_tokens": 2})
                assert status == 200, body
                # each leg went out twice, under one request id
                assert len(p.completions_seen()) == len(d.completions_seen()) == 2
                assert len({s.request_id for s in p.completions_seen() + d.completions_seen()}) \
                    == 1
                _, page = await get_text(url + "/metrics")
                for role, inst in (("prefill", "prefill-0"), ("decode", "decode-0")):
                    line = (f'kvplane_router_stale_connection_retries_total{{instance="{inst}",'
                            f'role="{role}"}} 1.0')
                    assert line in page
                p.drop = 2  # twice running is an instance that is going away: no third try
                status, body, _ = await post(url + "/v1/completions",
                                             {"model": MODEL, "prompt": "x"})
                assert status == 502, body
                assert "prefill instance prefill-0" in body["error"]["message"]
                assert "closed the connection during the prefill leg" in body["error"]["message"]
                assert len(p.completions_seen()) == 4 and len(d.completions_seen()) == 2
        finally:
            await stop(p, d)

    run(go)


def test_slow_instance_is_504() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0")
        p.delay = 2.0
        router = Router(make_config([p], [d], timeouts=Timeouts(prefill=0.3)))
        try:
            async with serving(router) as url:
                status, body, _ = await post(url + "/v1/completions",
                                             {"model": MODEL, "prompt": "x"})
            assert status == 504
            assert body["error"]["code"] == "upstream_timeout"
            assert "prefill instance prefill-0" in body["error"]["message"]
            assert "0.3s" in body["error"]["message"]
        finally:
            await stop(p, d)

    run(go)


def test_slow_decode_stream_is_504_before_the_first_byte() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0")
        d.delay = 2.0
        router = Router(make_config([p], [d], timeouts=Timeouts(decode_first=0.3)))
        try:
            async with serving(router) as url:
                status, body, _ = await post(url + "/v1/completions",
                                             {"model": MODEL, "prompt": "x", "stream": True})
            assert status == 504 and "decode instance decode-0" in body["error"]["message"]
        finally:
            await stop(p, d)

    run(go)


def test_settings_mismatch_is_refused_naming_both_sides() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0")
        p.side.set("identity", json.dumps({  # type: ignore[union-attr]
            "endpoint": p.endpoint.to_dict(), "layout": {"block_size": 4},
            "settings": {"v": 1, "modes": ["pull"]}}).encode())
        router = Router(make_config([p], [d], mode="push"))
        try:
            async with serving(router) as url:
                status, body, _ = await post(url + "/v1/completions",
                                             {"model": MODEL, "prompt": "x"})
            assert status == 502 and body["error"]["code"] == "kv_mode_mismatch"
            msg = body["error"]["message"]
            assert "prefill instance prefill-0" in msg
            assert "modes=pull" in msg and "mode=push" in msg  # both sides' settings
            assert p.completions_seen() == []
        finally:
            await stop(p, d)

    run(go)


def test_instance_without_the_kvplane_connector_is_refused() -> None:
    async def go() -> None:
        (p,) = await standins("prefill-0")
        (d,) = await standins("decode-0", serve_identity=False)
        router = Router(make_config([p], [d]))
        try:
            async with serving(router) as url:
                status, body, _ = await post(url + "/v1/completions",
                                             {"model": MODEL, "prompt": "x"})
            assert status == 502 and body["error"]["code"] == "kv_mode_mismatch"
            assert "has no kvplane identity" in body["error"]["message"]
        finally:
            await stop(p, d)

    run(go)


def test_another_model_between_prefill_and_decode_is_refused() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0")
        d.side.set("identity", json.dumps({  # type: ignore[union-attr]
            "v": 1, "endpoint": d.endpoint.to_dict(),
            "layout": {"block_size": 4, "tp": 1, "num_layers": 4, "num_kv_heads": 2,
                       "head_bytes": 64},
            "settings": {"v": 1, "modes": ["pull", "push"]}}).encode())
        router = Router(make_config([p], [d]))
        try:
            async with serving(router) as url:
                status, body, _ = await post(url + "/v1/completions",
                                             {"model": MODEL, "prompt": "x"})
            assert status == 502 and body["error"]["code"] == "kv_layout_mismatch"
            msg = body["error"]["message"]
            assert "num_layers 2 vs 4" in msg and "decode-0" in msg
        finally:
            await stop(p, d)

    run(go)


def test_unequal_block_and_tp_sizes_pair() -> None:
    from kvplane.live.router_config import Upstream
    from kvplane.live.router_upstream import pair_mismatch, parse_identity

    def ident(bs: int, tp: int, layers: int = 2) -> Any:
        return parse_identity(json.dumps({
            "v": 1, "endpoint": {"instance": "x", "host": "h", "port": 1},
            "layout": {"block_size": bs, "tp": tp, "num_layers": layers, "num_kv_heads": 2,
                       "head_bytes": 64}}).encode())

    up_p = Upstream("prefill-0", "prefill", "http://127.0.0.1:1")
    up_d = Upstream("decode-0", "decode", "http://127.0.0.1:2")
    assert pair_mismatch(up_p, ident(16, 2), up_d, ident(64, 1)) is None
    assert "num_layers 2 vs 3" in (pair_mismatch(up_p, ident(16, 1), up_d, ident(16, 1, 3))
                                   or "")


# --- metrics and health ------------------------------------------------------------------------


def test_metrics_page_is_prometheus_text() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0")
        router = Router(make_config([p], [d], mode="pull"))
        try:
            async with serving(router) as url:
                await post(url + "/v1/completions", {"model": MODEL, "prompt": "x y z"})
                await post(url + "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True})
                await post(url + "/v1/completions", {"raw": 1, "kv_transfer_params": {}})
                status, text = await get_text(url + "/metrics")
                hstatus, health = await get_text(url + "/health")
                _mstatus, models = await get_text(url + "/v1/models")
            assert status == 200
            for line in (
                'kvplane_router_ttft_seconds_count{mode="pull",stream="false"} 1.0',
                'kvplane_router_ttft_seconds_count{mode="pull",stream="true"} 1.0',
                'kvplane_router_transfers_total{direction="P->D",mode="pull"} 2.0',
                ('kvplane_router_errors_total{code="kv_transfer_params_forbidden",'
                'type="invalid_request_error"} 1.0'),
                ('kvplane_router_requests_total{endpoint="completions",mode="pull",status="200"} '
                '2.0'),
                'kvplane_router_inflight{instance="decode-0",role="decode"} 0.0',
                'kvplane_router_sessions{state="active"} 0.0',
            ):
                assert line in text, line
            assert 'kvplane_router_upstream_seconds_bucket{instance="prefill-0",le="0.005",' \
                   'leg="prefill",role="prefill"}' in text
            assert "# TYPE kvplane_router_reuse_hits_total counter" in text
            assert hstatus == 200 and json.loads(health)["status"] == "ok"
            assert json.loads(models)["data"][0]["id"] == MODEL
        finally:
            await stop(p, d)

    run(go)
