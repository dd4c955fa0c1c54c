"""The live suite's ports: below the kernel's ephemeral range, never handed out twice.

A port picked by binding port 0 comes from the ephemeral range, where the engines' own outgoing
connections take their local ports; between the pick and a vLLM server binding it (seconds), one
of them took a decode server's side-channel port (`Address already in use`, 2 Dec)."""

from __future__ import annotations

import socket

import kvplane_live_servers as servers


def test_ports_are_below_the_ephemeral_range_distinct_and_free() -> None:
    low = servers._ephemeral_low()
    ports = [servers.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    top = low if low > 21000 else 65535
    assert all(20000 <= p < top for p in ports)
    for p in ports[:20]:  # nothing listens there: a listener binds it now
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
            s.listen(1)


def test_a_port_in_use_is_skipped(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        taken.listen(1)
        picks = iter([busy, busy, 20001, 20002, 20003])

        class Fixed:
            def randrange(self, a: int, b: int) -> int:
                return next(picks)

        monkeypatch.setattr(servers.random, "SystemRandom", lambda: Fixed())
        monkeypatch.setattr(servers, "_ephemeral_low", lambda: 65000)
        monkeypatch.setattr(servers, "_HANDED_OUT", set())  # none of the picks handed out yet
        got = servers.free_port()
    assert got != busy and got in (20001, 20002, 20003)
