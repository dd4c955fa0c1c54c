"""The NIXL transport moving real bytes between two agents in two processes (UCX, host memory).

The parent process holds one transport; each peer is a spawned process with its own transport
that keeps polling NIXL between commands (with the progress thread off, a target that stops
polling stalls the initiator). Data is checked byte for byte. Time-outs are generous and no test
asserts a duration: on 2 shared cores, timings say nothing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

from kvplane.live.transport import (
    Region,
    Run,
    Status,
    TransferResult,
    Transport,
    count_descriptors,
    merge_runs,
)

pytestmark = pytest.mark.live

G = 4096  # granule: one "block" of these tests
PEER_BYTES = 4 << 20  # two regions of 2 MiB: the boundary is at offset 512 * G
BOUNDARY = PEER_BYTES // 2
PARENT_BYTES = 4 << 20
REPLY_TIMEOUT = 60.0  # seconds to wait for a peer's answer (spawn + agent creation included)
XFER_TIMEOUT = 30.0


def pattern(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


# ---- the peer process --------------------------------------------------------------------------


def _peer_main(conn: Connection, name: str, size: int, seed: int) -> None:
    """Serve commands from the parent while polling NIXL in between."""
    transport = Transport(name, granule=G)
    # Two separately allocated regions, like two layers of a KV cache: offsets run across both.
    full = pattern(size, seed)
    halves = [full[: size // 2].copy(), full[size // 2:].copy()]
    del full
    for half in halves:
        transport.register(half)

    def read(off: int, length: int) -> bytes:
        return np.concatenate(halves)[off:off + length].tobytes()

    conn.send(transport.local_info())
    parent = transport.add_peer(conn.recv())
    conn.send(parent)
    while True:
        transport.progress()
        if not conn.poll(0.0005):
            continue
        cmd, *args = conn.recv()
        if cmd == "bytes":
            off, length = args
            conn.send(read(off, length))
        elif cmd == "notif":
            message, timeout, *prefix = args
            n = transport.wait_notification(message, timeout, prefix=bool(prefix and prefix[0]))
            conn.send(None if n is None else (n.peer, n.message))
        elif cmd == "inbox":
            conn.send([(n.peer, n.message) for n in transport.notifications()])
        elif cmd == "send":
            conn.send(transport.send_notification(parent, args[0]).ok)
        elif cmd == "write":
            runs, notify = args
            conn.send(transport.transfer(parent, "WRITE", runs, notify=notify,
                                         timeout=XFER_TIMEOUT).status.value)
        elif cmd == "sleep":
            conn.send("sleeping")
            time.sleep(args[0])  # blocked elsewhere: NIXL gets no progress meanwhile
            conn.send("awake")
        elif cmd == "die":
            os._exit(17)  # a crash: no clean-up, no goodbye to the parent's agent
        elif cmd == "exit":
            transport.close()
            conn.send("bye")
            return


class Peer:
    """The parent's handle on a peer process."""

    def __init__(self, parent: Transport, name: str, seed: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.seed = seed
        self.proc = ctx.Process(target=_peer_main, args=(child, name, PEER_BYTES, seed),
                                daemon=True)
        self.proc.start()
        self.info = info = self._recv()
        self.conn.send(parent.local_info())
        self.name = parent.add_peer(info)
        assert self.name == name
        # The peer's add_peer answer; the parent polls meanwhile so both sides can progress.
        self.parent_name = self._recv(parent)

    def _recv(self, transport: Transport | None = None, timeout: float = REPLY_TIMEOUT) -> Any:
        waited = 0.0
        while not self.conn.poll(0.001):
            if transport is not None:
                transport.progress()
            waited += 0.001
            if waited > timeout or not self.proc.is_alive():
                raise AssertionError(f"peer {self.proc.name} did not answer "
                                     f"(alive={self.proc.is_alive()})")
        return self.conn.recv()

    def ask(self, parent: Transport, *cmd: Any) -> Any:
        self.conn.send(cmd)
        return self._recv(parent)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
                self.conn.poll(10)
            except (BrokenPipeError, EOFError, OSError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture(scope="module")
def parent() -> Iterator[tuple[Transport, np.ndarray]]:
    transport = Transport(f"kvplane-test-parent-{os.getpid()}", granule=G)
    buf = np.zeros(PARENT_BYTES, dtype=np.uint8)
    transport.register(buf)
    yield transport, buf
    transport.close()


@pytest.fixture(scope="module")
def peer(parent: tuple[Transport, np.ndarray]) -> Iterator[Peer]:
    p = Peer(parent[0], f"kvplane-test-peer-{os.getpid()}", seed=7)
    yield p
    p.stop()


def expect_done(result: TransferResult) -> None:
    assert result.status is Status.DONE, result


# ---- tests --------------------------------------------------------------------------------------


def test_write_lands_byte_for_byte_and_notifies(parent: tuple[Transport, np.ndarray],
                                                peer: Peer) -> None:
    transport, buf = parent
    buf[:] = pattern(PARENT_BYTES, 11)
    runs = [(0, 64 * G, 32 * G)]  # parent bytes [0, 128 KiB) -> peer offset 256 KiB
    result = transport.transfer(peer.name, "WRITE", runs, notify=b"req-1:done",
                                timeout=XFER_TIMEOUT)
    expect_done(result)
    assert result.nbytes == 32 * G and result.descriptors == 1
    got = peer.ask(transport, "notif", b"req-1:done", XFER_TIMEOUT)
    assert got == (transport.name, b"req-1:done")
    landed = peer.ask(transport, "bytes", 64 * G, 32 * G)
    assert landed == buf[: 32 * G].tobytes()
    # Bytes around the target are untouched.
    before = peer.ask(transport, "bytes", 63 * G, G)
    assert before == pattern(PEER_BYTES, peer.seed)[63 * G: 64 * G].tobytes()


def test_read_pulls_the_peers_bytes(parent: tuple[Transport, np.ndarray], peer: Peer) -> None:
    transport, buf = parent
    buf[:] = 0
    theirs = pattern(PEER_BYTES, peer.seed)
    result = transport.transfer(peer.name, "READ", [(G, 200 * G, 100 * G)], timeout=XFER_TIMEOUT)
    expect_done(result)
    assert buf[G: 101 * G].tobytes() == theirs[200 * G: 300 * G].tobytes()
    assert not buf[:G].any() and not buf[101 * G:].any()


def test_adjacent_runs_merge_into_fewer_descriptors(parent: tuple[Transport, np.ndarray],
                                                    peer: Peer) -> None:
    transport, buf = parent
    buf[:] = pattern(PARENT_BYTES, 12)
    # 64 one-granule runs, adjacent on both sides, given out of order: one descriptor.
    adjacent = [(i * G, (400 + i) * G, G) for i in reversed(range(64))]
    assert merge_runs(adjacent) == [Run(0, 400 * G, 64 * G)]
    merged = transport.transfer(peer.name, "WRITE", adjacent, notify=b"adj",
                                timeout=XFER_TIMEOUT)
    expect_done(merged)
    # Adjacent in offsets but across the peer's two regions: one cut, two descriptors.
    across = [((64 + i) * G, (500 + i) * G, G) for i in range(24)]
    crossing = transport.transfer(peer.name, "WRITE", across, notify=b"across",
                                  timeout=XFER_TIMEOUT)
    expect_done(crossing)
    assert crossing.descriptors == 2
    # The same bytes with a gap every other granule on the remote side: nothing merges.
    gapped = [(i * G, (700 + 2 * i) * G, G) for i in range(64)]
    split = transport.transfer(peer.name, "WRITE", gapped, notify=b"gap", timeout=XFER_TIMEOUT)
    expect_done(split)
    assert merged.descriptors == 1 and split.descriptors == 64
    assert merged.nbytes == split.nbytes == 64 * G
    for tag in (b"adj", b"across", b"gap"):
        assert peer.ask(transport, "notif", tag, XFER_TIMEOUT) is not None
    assert peer.ask(transport, "bytes", 400 * G, 64 * G) == buf[: 64 * G].tobytes()
    assert peer.ask(transport, "bytes", 500 * G, 24 * G) == buf[64 * G: 88 * G].tobytes()
    for i in range(64):
        landed = peer.ask(transport, "bytes", (700 + 2 * i) * G, G)
        assert landed == buf[i * G:(i + 1) * G].tobytes()


def test_scattered_runs_both_ways(parent: tuple[Transport, np.ndarray], peer: Peer) -> None:
    transport, buf = parent
    rng = np.random.default_rng(3)
    n_local, n_remote = PARENT_BYTES // G, PEER_BYTES // G
    src = rng.choice(n_local, size=200, replace=False)
    dst = rng.choice(np.arange(800, n_remote), size=200, replace=False)  # clear of other tests
    runs = [(int(s) * G, int(d) * G, G) for s, d in zip(src, dst)]
    buf[:] = pattern(PARENT_BYTES, 13)
    expect_done(transport.transfer(peer.name, "WRITE", runs, notify=b"scatter",
                                   timeout=XFER_TIMEOUT))
    assert peer.ask(transport, "notif", b"scatter", XFER_TIMEOUT) is not None
    for s, d in zip(src[:50], dst[:50]):
        assert peer.ask(transport, "bytes", int(d) * G, G) == buf[s * G:(s + 1) * G].tobytes()
    # Read them back into a cleared buffer, to other places.
    snapshot = buf.copy()
    buf[:] = 0
    back = [(int(i) * G, int(d) * G, G) for i, d in enumerate(dst)]
    expect_done(transport.transfer(peer.name, "READ", back, timeout=XFER_TIMEOUT))
    for i, s in enumerate(src):
        assert buf[i * G:(i + 1) * G].tobytes() == snapshot[s * G:(s + 1) * G].tobytes()


def test_standalone_notification_and_prefix_match(parent: tuple[Transport, np.ndarray],
                                                  peer: Peer) -> None:
    transport, _ = parent
    assert transport.send_notification(peer.name, b"register:req-9").ok
    got = peer.ask(transport, "notif", b"register:", XFER_TIMEOUT, True)
    assert got == (transport.name, b"register:req-9")


def test_misuse_raises_but_unknown_peer_is_a_result(parent: tuple[Transport, np.ndarray],
                                                    peer: Peer) -> None:
    transport, _ = parent  # `peer`: the handshake has happened, even when run alone
    result = transport.transfer("nobody", "WRITE", [(0, 0, G)], timeout=1.0)
    assert result.status is Status.FAILED and "unknown peer" in result.reason
    with pytest.raises(ValueError):
        transport.register(np.zeros(G, dtype=np.uint8))  # after the handshake


def test_peer_that_died_fails_or_times_out_cleanly(parent: tuple[Transport, np.ndarray],
                                                   peer: Peer) -> None:
    transport, buf = parent
    doomed = Peer(transport, f"kvplane-test-doomed-{os.getpid()}", seed=21)
    try:
        # A first transfer works, so the connection is up before the crash.
        expect_done(transport.transfer(doomed.name, "READ", [(0, 0, 8 * G)],
                                       timeout=XFER_TIMEOUT))
        doomed.conn.send(("die",))
        doomed.proc.join(30)
        assert doomed.proc.exitcode == 17
        results = [transport.transfer(doomed.name, op, [(0, 0, 64 * G)], notify=b"late",
                                      timeout=15.0) for op in ("WRITE", "READ")]
        for r in results:
            assert r.status in (Status.FAILED, Status.TIMED_OUT), r
            assert r.reason
        # The transport still serves the healthy peer.
        buf[:] = pattern(PARENT_BYTES, 14)
        expect_done(transport.transfer(peer.name, "WRITE", [(0, 0, 4 * G)], notify=b"after",
                                       timeout=XFER_TIMEOUT))
        assert peer.ask(transport, "notif", b"after", XFER_TIMEOUT) is not None
        assert peer.ask(transport, "bytes", 0, 4 * G) == buf[: 4 * G].tobytes()
    finally:
        transport.remove_peer(doomed.name)
        doomed.stop()


def test_peer_that_stops_polling_times_out_then_recovers(parent: tuple[Transport, np.ndarray],
                                                        peer: Peer) -> None:
    """With the progress thread off, a target that blocks elsewhere stalls the initiator's
    WRITE: the initiator gets TIMED_OUT (not a hang, not an exception), and once the target
    polls again, transfers go through."""
    transport, buf = parent
    assert peer.ask(transport, "sleep", 12.0) == "sleeping"
    result = transport.transfer(peer.name, "WRITE", [(0, 0, 16 * G)], notify=b"stalled",
                                timeout=2.0)  # well inside the peer's 12 s nap
    assert result.status is Status.TIMED_OUT, result
    assert "not done" in result.reason
    assert peer._recv(transport, timeout=REPLY_TIMEOUT) == "awake"
    buf[:] = pattern(PARENT_BYTES, 15)
    expect_done(transport.transfer(peer.name, "WRITE", [(0, 0, 16 * G)], notify=b"resumed",
                                   timeout=XFER_TIMEOUT))
    assert peer.ask(transport, "notif", b"resumed", XFER_TIMEOUT) is not None
    assert peer.ask(transport, "bytes", 0, 16 * G) == buf[: 16 * G].tobytes()


def test_the_parent_as_target(parent: tuple[Transport, np.ndarray], peer: Peer) -> None:
    """The other direction: the peer writes into the parent and notifies; the parent waits on
    its own inbox (prefix match), other notifications stay queued."""
    transport, buf = parent
    transport.notifications()  # start from an empty inbox
    buf[:] = 0
    assert peer.ask(transport, "send", b"hello") is True
    status = peer.ask(transport, "write", [(40 * G, 8 * G, 16 * G)], b"kv:req-5:rank0")
    assert status == Status.DONE.value
    got = transport.wait_notification(b"kv:req-5", XFER_TIMEOUT, prefix=True)
    assert got is not None and got.message == b"kv:req-5:rank0" and got.peer == peer.name
    assert buf[8 * G: 24 * G].tobytes() == pattern(PEER_BYTES, peer.seed)[40 * G: 56 * G].tobytes()
    assert not buf[: 8 * G].any() and not buf[24 * G:].any()
    rest = transport.wait_notification(b"hello", XFER_TIMEOUT, peer=peer.name)
    assert rest is not None
    assert transport.wait_notification(b"never", 0.2) is None


def test_descriptor_count_cuts_at_region_boundaries() -> None:
    one = [Region(0x1000, 8 * G, 0)]
    two = [Region(0x9000, 4 * G, 0), Region(0x100000, 4 * G, 0)]
    assert count_descriptors([(0, 0, 8 * G)], one, one) == 1
    assert count_descriptors([(0, 0, 8 * G)], one, two) == 2
    assert count_descriptors([(0, 0, 8 * G)], two, two) == 2  # same cut on both sides
    assert count_descriptors([(0, G, 6 * G)], two, two) == 3  # cuts at 3 G and 4 G
    assert count_descriptors([(i * G, i * G, G) for i in range(8)], two, two) == 2
    assert count_descriptors(np.array([(0, 0, G), (2 * G, 2 * G, G)]), one, one) == 2


def test_import_without_nixl_works_and_says_how_to_install() -> None:
    code = (
        "import sys; sys.modules['nixl'] = None\n"
        "import kvplane.live.transport as t\n"
        "try:\n"
        "    t.Transport('x')\n"
        "except ImportError as e:\n"
        "    print('HINT' if 'install_live.sh' in str(e) else 'NOHINT')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "HINT"


def test_a_known_peer_added_again_keeps_its_connection(
        parent: tuple[Transport, np.ndarray]) -> None:
    """A transport meets a peer twice (the stager adds the reader that sent it a staged READ,
    later the connector adds the same peer from its own handshake): the second add must not
    drop the connection, or the peer's next messages are lost without an error (seen on an
    H200: a staged READ's request never arrived, and the READ timed out)."""
    transport, _ = parent
    p = Peer(transport, f"kvplane-test-readd-{os.getpid()}", seed=9)
    try:
        assert p.ask(transport, "send", b"readd:before")
        assert transport.wait_notification(b"readd:before", XFER_TIMEOUT) is not None
        prepared = transport._peers[p.name]
        assert transport.add_peer(p.info) == p.name
        # kept, not removed and loaded again (on host memory UCX happens to survive that; on
        # a GPU over cuda_ipc it did not)
        assert transport._peers[p.name] is prepared
        for i in range(3):
            message = f"readd:after-{i}".encode()
            assert p.ask(transport, "send", message)
            got = transport.wait_notification(message, 10.0)
            assert got is not None, f"message {i} from the re-added peer never arrived"
        buf_runs = [(0, 0, G)]
        assert p.ask(transport, "write", buf_runs, b"readd:write") == Status.DONE.value
    finally:
        p.stop()
