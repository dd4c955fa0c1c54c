"""Staged transfers through the real NIXL transport (UCX, host memory, two processes).

A fragmented run list (one granule per run, scattered on both sides) is moved through staging
slots small enough that one transfer needs many chunks and several grant rounds; every byte is
checked where it landed. No test asserts a duration (benchmarks/transfer_fragmented.py times).
"""

from __future__ import annotations

import base64
import json
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvplane.core.errors import PeerError
from kvplane.core.transfer_method import MethodCosts
from kvplane.live.ipc import IpcSide
from kvplane.live.ipc import host_id as ipc_host_id
from kvplane.live.staging import (
    BlockLayout,
    StagingConfig,
    block_descriptors,
    block_runs_array,
    costs_from_profile,
    decode,
    encode,
    granules_of,
    staging_for,
)
from kvplane.live.transport import PeerInfo, Status, Transport, TransportError

pytestmark = pytest.mark.live

G = 4096
SIZE = 2 << 20  # per side: 512 granules
SLOT = 16 * G  # 64 KiB slots: 200 granules need 13 chunks
STAGING = StagingConfig(slot_bytes=SLOT, slots=2)
TIMEOUT = 30.0
REPLY = 60.0
ROOT = Path(__file__).resolve().parents[2]


def pattern(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _peer_main(conn: Connection, name: str, seed: int, staging: bool, knows: bool) -> None:
    t = Transport(name, granule=G, staging=STAGING if staging else None)
    buf = pattern(SIZE, seed)
    t.register(buf)
    conn.send(t.local_info())
    info = conn.recv()
    if knows:
        t.add_peer(info)
    conn.send("ready")
    while True:
        t.progress()
        if not conn.poll(0.0002):
            continue
        cmd, *args = conn.recv()
        if cmd == "pieces":  # the granules at these offsets, in order
            conn.send(b"".join(buf[o:o + G].tobytes() for o in args[0]))
        elif cmd == "notif":
            n = t.wait_notification(args[0], args[1])
            conn.send(None if n is None else n.message)
        elif cmd == "inbox":
            conn.send([n.message for n in t.notifications()])
        elif cmd == "slots":
            s = t._stager
            conn.send(None if s is None else (len(s.free_send), len(s.free_recv), len(s.jobs)))
        elif cmd == "die":
            os._exit(17)
        elif cmd == "exit":
            t.close()
            conn.send("bye")
            return


class Peer:
    def __init__(self, parent: Transport, name: str, seed: int, *, staging: bool = True,
                 knows: bool = True, forge: Any = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.seed = seed
        self.proc = ctx.Process(target=_peer_main, args=(child, name, seed, staging, knows),
                                daemon=True)
        self.proc.start()
        info = self.recv(None)
        if forge is not None:  # the handshake as the parent reads it, changed by the test
            info = forge(info)
        self.conn.send(parent.local_info())
        self.name = parent.add_peer(info)
        assert self.recv(parent) == "ready"

    def recv(self, t: Transport | None, timeout: float = REPLY) -> Any:
        waited = 0.0
        while not self.conn.poll(0.0005):
            if t is not None:
                t.progress()
            waited += 0.0005
            if waited > timeout or not self.proc.is_alive():
                raise AssertionError(f"peer did not answer (alive={self.proc.is_alive()})")
        return self.conn.recv()

    def ask(self, t: Transport, *cmd: Any) -> Any:
        self.conn.send(cmd)
        return self.recv(t)

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


def _parent(force: str | None, costs: MethodCosts | None = None) -> tuple[Transport, Any]:
    t = Transport(f"kvplane-stage-parent-{os.getpid()}-{force}", granule=G,
                  staging=StagingConfig(slot_bytes=SLOT, slots=2, force=force,  # type: ignore[arg-type]
                                        costs=costs))
    buf = np.zeros(SIZE, dtype=np.uint8)
    t.register(buf)
    return t, buf


@pytest.fixture(scope="module")
def staged() -> Iterator[tuple[Transport, np.ndarray, Peer]]:
    t, buf = _parent("staged")
    p = Peer(t, f"kvplane-stage-peer-{os.getpid()}", seed=5)
    yield t, buf, p
    p.stop()
    t.close()


def scattered(seed: int, n: int = 200) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.choice(SIZE // G, n, replace=False) * G, rng.choice(SIZE // G, n, replace=False) * G)


def runs_of(local: np.ndarray, remote: np.ndarray) -> np.ndarray:
    return np.stack([local, remote, np.full_like(local, G)], axis=1)


def test_staged_write_lands_every_piece_and_notifies_after_the_last_scatter(
        staged: tuple[Transport, np.ndarray, Peer]) -> None:
    t, buf, peer = staged
    buf[:] = pattern(SIZE, 31)
    src, dst = scattered(1)
    res = t.transfer(peer.name, "WRITE", runs_of(src, dst), notify=b"kv:req-1", timeout=TIMEOUT)
    assert res.status is Status.DONE, res
    assert res.method == "staged" and res.descriptors == 13  # 200 granules / 16 per slot
    assert peer.ask(t, "notif", b"kv:req-1", TIMEOUT) == b"kv:req-1"
    expected = b"".join(buf[s:s + G].tobytes() for s in src)
    assert peer.ask(t, "pieces", [int(d) for d in dst]) == expected
    # staging's own messages never reach the caller's inbox, the notification came once
    assert peer.ask(t, "inbox") == []
    assert peer.ask(t, "slots") == (2, 2, 0)  # every slot back, no job left


def test_staged_read_is_written_by_the_holder(staged: tuple[Transport, np.ndarray, Peer]) -> None:
    t, buf, peer = staged
    buf[:] = 0
    ours, theirs = scattered(2, 150)
    res = t.transfer(peer.name, "READ", runs_of(ours, theirs), notify=b"read-done",
                     timeout=TIMEOUT)
    assert res.status is Status.DONE, res
    assert res.method == "staged"
    expected = peer.ask(t, "pieces", [int(o) for o in theirs])
    assert b"".join(buf[o:o + G].tobytes() for o in ours) == expected
    untouched = np.setdiff1d(np.arange(SIZE // G) * G, ours)
    assert not any(buf[o:o + G].any() for o in untouched)
    # like a NIXL READ's notification, it reaches the holder after the data is in place
    assert peer.ask(t, "notif", b"read-done", TIMEOUT) == b"read-done"


def test_a_holder_that_never_added_its_reader_still_writes_to_it() -> None:
    """Pull mode: decode knows prefill, prefill need not know decode; the READ's first message
    carries the reader's handshake."""
    t, buf = _parent("staged")
    peer = Peer(t, f"kvplane-stage-stranger-{os.getpid()}", seed=9, knows=False)
    try:
        ours, theirs = scattered(3, 64)
        res = t.transfer(peer.name, "READ", runs_of(ours, theirs), timeout=TIMEOUT)
        assert res.status is Status.DONE and res.method == "staged", res
        expected = peer.ask(t, "pieces", [int(o) for o in theirs])
        assert b"".join(buf[o:o + G].tobytes() for o in ours) == expected
    finally:
        peer.stop()
        t.close()


def test_the_estimate_chooses_staging_for_fragments_and_direct_for_runs() -> None:
    # host-like costs where 4 KiB descriptors cost more than copying them twice
    costs = MethodCosts(bandwidth=5e9, per_descriptor=20e-6, copy_bandwidth=5e9,
                        round_trip=100e-6, chunk_bytes=SLOT, overlap=False)
    t, buf = _parent(None, costs)
    peer = Peer(t, f"kvplane-stage-auto-{os.getpid()}", seed=4)
    try:
        buf[:] = pattern(SIZE, 41)
        src, dst = scattered(4)
        frag = t.transfer(peer.name, "WRITE", runs_of(src, dst), notify=b"f", timeout=TIMEOUT)
        whole = t.transfer(peer.name, "WRITE", [(0, 0, 200 * G)], notify=b"w", timeout=TIMEOUT)
        assert (frag.method, whole.method) == ("staged", "direct")
        assert frag.ok and whole.ok
        assert peer.ask(t, "notif", b"w", TIMEOUT) == b"w"
        assert peer.ask(t, "pieces", [i * G for i in range(200)]) == buf[:200 * G].tobytes()
    finally:
        peer.stop()
        t.close()


def test_a_read_goes_direct_while_every_receive_slot_rests() -> None:
    """After a failed staged receive its granted slots rest for stale_s (the holder may still
    write into them); a READ meanwhile goes direct instead of timing out waiting for them."""
    costs = MethodCosts(bandwidth=5e9, per_descriptor=20e-6, copy_bandwidth=5e9,
                        round_trip=100e-6, chunk_bytes=SLOT, overlap=False)
    t, buf = _parent(None, costs)
    peer = Peer(t, f"kvplane-stage-parked-{os.getpid()}", seed=10)
    try:
        ours, theirs = scattered(12, 150)
        assert t.transfer(peer.name, "READ", runs_of(ours, theirs), timeout=TIMEOUT).method \
            == "staged"
        stager = t._stager
        assert stager is not None and not stager.parked()
        rest_until = time.monotonic() + 3600  # as _fail parks a failed job's granted slots
        stager.resting = [(rest_until, stager.pool_offset + s * SLOT) for s in stager.free_recv]
        stager.free_recv.clear()
        assert stager.parked()
        buf[:] = 0
        res = t.transfer(peer.name, "READ", runs_of(ours, theirs), timeout=TIMEOUT)
        assert res.ok and res.method == "direct", res
        expected = peer.ask(t, "pieces", [int(o) for o in theirs])
        assert b"".join(buf[o:o + G].tobytes() for o in ours) == expected
        # a WRITE still stages: the peer receives it, into its own slots
        res = t.transfer(peer.name, "WRITE", runs_of(ours, theirs), timeout=TIMEOUT)
        assert res.ok and res.method == "staged", res
    finally:
        peer.stop()
        t.close()


def test_a_peer_without_staging_gets_direct_transfers() -> None:
    t, buf = _parent("staged")
    peer = Peer(t, f"kvplane-stage-plain-{os.getpid()}", seed=6, staging=False)
    try:
        buf[:] = pattern(SIZE, 51)
        src, dst = scattered(5, 40)
        res = t.transfer(peer.name, "WRITE", runs_of(src, dst), notify=b"p", timeout=TIMEOUT)
        assert res.ok and res.method == "direct" and res.descriptors == 40
        assert peer.ask(t, "notif", b"p", TIMEOUT) == b"p"
        expected = b"".join(buf[s:s + G].tobytes() for s in src)
        assert peer.ask(t, "pieces", [int(d) for d in dst]) == expected
    finally:
        peer.stop()
        t.close()


def test_a_dead_peer_fails_the_staged_transfer_and_leaks_no_slot(
        staged: tuple[Transport, np.ndarray, Peer]) -> None:
    t, buf, healthy = staged
    doomed = Peer(t, f"kvplane-stage-doomed-{os.getpid()}", seed=8)
    try:
        src, dst = scattered(6, 32)
        assert t.transfer(doomed.name, "WRITE", runs_of(src, dst), timeout=TIMEOUT).ok
        doomed.conn.send(("die",))
        doomed.proc.join(30)
        assert doomed.proc.exitcode == 17
        for op in ("WRITE", "READ"):
            res = t.transfer(doomed.name, op, runs_of(src, dst), timeout=5.0)
            assert res.status in (Status.FAILED, Status.TIMED_OUT) and res.reason, res
        stager = t._stager
        assert stager is not None
        for _ in range(200):  # failed jobs end once their copies and WRITEs have
            t.progress()
            if not stager.jobs:
                break
        assert not stager.jobs and len(stager.free_send) == 2
        # the healthy peer is still served, staged
        buf[:] = pattern(SIZE, 61)
        src, dst = scattered(7, 50)
        res = t.transfer(healthy.name, "WRITE", runs_of(src, dst), notify=b"after",
                         timeout=TIMEOUT)
        assert res.ok and res.method == "staged", res
        assert healthy.ask(t, "notif", b"after", TIMEOUT) == b"after"
        assert healthy.ask(t, "pieces", [int(d) for d in dst]) == b"".join(
            buf[s:s + G].tobytes() for s in src)
    finally:
        t.remove_peer(doomed.name)
        doomed.stop()


# ---- block-level transfers (post_blocks) ---------------------------------------------------------

# Four piece groups ("layers") of 128 blocks of one granule each, side by side: block b of group p
# at p * 512 KiB + b * G. A strided variant leaves a gap after every piece (no merging).
DENSE = BlockLayout(tuple(p * (SIZE // 4) for p in range(4)), G, G, 128)
STRIDED = BlockLayout(tuple(p * (SIZE // 4) for p in range(4)), 2 * G, G, 64)


def block_offsets(layout: BlockLayout, ids: np.ndarray) -> list[int]:
    """Byte offsets of every piece, piece group outermost, in id order (the stream order)."""
    return [int(b + i * layout.stride) for b in layout.bases for i in ids]


def picked(seed: int, layout: BlockLayout, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.choice(layout.num_blocks, n, replace=False),
            rng.choice(layout.num_blocks, n, replace=False))


@pytest.fixture(scope="module")
def blocks() -> Iterator[tuple[Transport, np.ndarray, Peer]]:
    """A pair of its own: the dead-peer test leaves the shared parent's receive slots resting."""
    t, buf = _parent("staged")
    p = Peer(t, f"kvplane-stage-blocks-{os.getpid()}", seed=15)
    yield t, buf, p
    p.stop()
    t.close()


@pytest.mark.parametrize("layout", [DENSE, STRIDED], ids=["dense", "strided"])
@pytest.mark.parametrize("span", ["1", "0"], ids=["one-copy", "per-group"])
def test_staged_block_write_and_read_land_every_piece(
        blocks: tuple[Transport, np.ndarray, Peer], layout: BlockLayout, span: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    t, buf, peer = blocks
    stager = t._stager
    assert stager is not None
    monkeypatch.setenv("KVPLANE_STAGING_SPAN", span)
    stager.copier._spans.pop(layout, None)  # decide again under this setting (ours only)
    buf[:] = pattern(SIZE, 41)
    ours, theirs = picked(11, layout, 50)
    res = t.wait(t.post_blocks(peer.name, "WRITE", layout, ours, layout, theirs,
                               notify=b"blocks-1"), TIMEOUT)
    assert res.status is Status.DONE and res.method == "staged", res
    assert res.descriptors == 13  # 4 groups x 50 pieces = 200 granules, 16 per slot
    assert (stager.copier._spans[layout] is not None) == (span == "1")
    assert peer.ask(t, "notif", b"blocks-1", TIMEOUT) == b"blocks-1"
    sent = b"".join(buf[o:o + G].tobytes() for o in block_offsets(layout, ours))
    assert peer.ask(t, "pieces", block_offsets(layout, theirs)) == sent
    # and back: a staged READ of other blocks, written by the holder, scattered here
    buf[:] = 0
    ours, theirs = picked(12, layout, 40)
    res = t.wait(t.post_blocks(peer.name, "READ", layout, ours, layout, theirs), TIMEOUT)
    assert res.status is Status.DONE and res.method == "staged", res
    expected = peer.ask(t, "pieces", block_offsets(layout, theirs))
    assert b"".join(buf[o:o + G].tobytes() for o in block_offsets(layout, ours)) == expected
    touched = set(block_offsets(layout, ours))
    assert not any(buf[o:o + G].any() for o in range(0, SIZE, G) if o not in touched)
    assert peer.ask(t, "slots") == (2, 2, 0)


def test_direct_block_write_merges_consecutive_blocks() -> None:
    t, buf = _parent("direct")
    peer = Peer(t, f"kvplane-stage-bdirect-{os.getpid()}", seed=13)
    try:
        buf[:] = pattern(SIZE, 43)
        ours = np.array([5, 6, 7, 100, 3])
        theirs = np.array([20, 21, 22, 50, 51])  # 5->20..7->22 merge; 100->50, 3->51 do not
        res = t.wait(t.post_blocks(peer.name, "WRITE", DENSE, ours, DENSE, theirs), TIMEOUT)
        assert res.status is Status.DONE and res.method == "direct", res
        assert res.descriptors == 4 * 3
        sent = b"".join(buf[o:o + G].tobytes() for o in block_offsets(DENSE, ours))
        assert peer.ask(t, "pieces", block_offsets(DENSE, theirs)) == sent
    finally:
        peer.stop()
        t.close()


def test_bad_block_transfers_are_refused(blocks: tuple[Transport, np.ndarray, Peer]) -> None:
    t, _, peer = blocks
    with pytest.raises(TransportError, match="outside"):
        t.post_blocks(peer.name, "WRITE", DENSE, np.array([128]), DENSE, np.array([0]))
    with pytest.raises(TransportError, match="2 local blocks but 1"):
        t.post_blocks(peer.name, "WRITE", DENSE, np.array([0, 1]), DENSE, np.array([0]))
    huge = BlockLayout((SIZE - G,), G, G, 2)  # its second block is in the staging pool
    with pytest.raises(TransportError, match="past the registered KV memory"):
        t.post_blocks(peer.name, "WRITE", huge, np.array([1]), huge, np.array([1]))
    stager = t._stager
    assert stager is not None
    ids = np.array([0, 127])
    assert stager._bad_block_request(DENSE, ids, G, SLOT, 8 * G) == ""
    assert "block id" in stager._bad_block_request(DENSE, np.array([128]), G, SLOT, 4 * G)
    assert "add up" in stager._bad_block_request(DENSE, ids, G, SLOT, 4 * G)
    assert "slots" in stager._bad_block_request(DENSE, ids, G, 2 * SLOT, 8 * G)
    assert "past our KV memory" in stager._bad_block_request(huge, ids[:1], G, SLOT, G)


def test_block_runs_merge_only_where_both_sides_continue() -> None:
    ours, theirs = np.array([5, 6, 7, 100, 3]), np.array([20, 21, 22, 50, 51])
    runs = block_runs_array(DENSE, ours, DENSE, theirs)
    assert block_descriptors(DENSE, ours, DENSE, theirs) == len(runs) == 12
    first = [tuple(r) for r in runs[:3].tolist()]
    assert first == [(5 * G, 20 * G, 3 * G), (100 * G, 50 * G, G), (3 * G, 51 * G, G)]
    assert runs[3][0] == DENSE.bases[1] + 5 * G  # the next piece group, same pattern
    strided = block_runs_array(STRIDED, ours[:3], STRIDED, theirs[:3] - 10)
    assert len(strided) == 12 and (strided[:, 2] == G).all()  # gaps: never merged
    with pytest.raises(ValueError, match="stride >= piece"):
        BlockLayout((0,), G, 2 * G, 4)
    wire = BlockLayout.from_wire(STRIDED.to_wire())
    assert wire == STRIDED


# ---- pieces without NIXL --------------------------------------------------------------------------


def test_control_messages_round_trip_and_compress_a_kv_layout() -> None:
    rng = np.random.default_rng(0)
    piece, pool, blocks = 32768, 2048, rng.permutation(2048)[:1024]
    base = np.arange(64) // 2 * 2 * pool * piece + np.arange(64) % 2 * pool * piece
    offs = (base[:, None] + blocks[None, :] * piece).ravel()
    runs = np.stack([offs, np.full_like(offs, piece)], axis=1)
    msg = encode("offer", {"id": "a/1"}, runs, piece)
    kind, header, back = decode(msg)
    assert (kind, header["id"]) == ("offer", "a/1")
    assert (back == runs).all()
    assert len(msg) < 32 * 1024  # 65,536 runs: the per-layer block pattern repeats
    wide = np.array([[0, 8], [2**40, 8]])  # offsets past int32 in granules
    assert (decode(encode("pull", {"id": "b"}, wide, 8))[2] == wide).all()


def test_granules_follow_the_run_order() -> None:
    runs = np.array([[8 * G, 2 * G], [0, G], [4 * G, 3 * G]])
    assert granules_of(runs, G).tolist() == [8, 9, 0, 4, 5, 6]


def test_staging_config_and_profile_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="positive"):
        StagingConfig(slot_bytes=0)
    with pytest.raises(ValueError, match="force"):
        StagingConfig(force="fast")  # type: ignore[arg-type]
    bad = tmp_path / "bad.yaml"
    bad.write_text("nixl_measured: {write_bandwidth_GBps: {value: 1}}\n")
    with pytest.raises(ValueError, match="bad.yaml"):
        costs_from_profile(bad, chunk_bytes=SLOT, overlap=False)
    good = costs_from_profile(ROOT / "docs/measurements/nixl-h200-1gpu-vram.yaml",
                              chunk_bytes=64 << 20, overlap=True)
    assert good.bandwidth > 100e9 and good.per_descriptor > 1e-6 and good.copy_bandwidth > 1e11


def test_workers_get_staging_by_memory_kind_and_setting() -> None:
    import torch

    host = torch.zeros(8, dtype=torch.uint8)
    assert staging_for(host, "auto") is None  # host memory: per-run descriptors unless asked
    on = staging_for(host, "on")
    assert on is not None and on.force is None and on.slot_bytes == 4 << 20
    forced = staging_for(host, "staged")
    assert forced is not None and forced.force == "staged"
    assert staging_for(host, "off") is None
    with pytest.raises(ValueError, match="KVPLANE_STAGING"):
        staging_for(host, "sometimes")


def test_a_run_list_outside_our_memory_is_refused_before_any_copy(
        staged: tuple[Transport, np.ndarray, Peer]) -> None:
    t, _, _ = staged
    stager = t._stager
    assert stager is not None
    inside = np.array([[0, G], [4 * G, 2 * G]])
    assert stager._bad_request(inside, G, SLOT, 3 * G) == ""
    past = np.array([[SIZE - G, 2 * G]])  # runs into the staging pool
    assert "outside" in stager._bad_request(past, G, SLOT, 2 * G)
    assert "outside" in stager._bad_request(np.array([[G // 2, G]]), G, SLOT, G)
    assert "add up" in stager._bad_request(inside, G, SLOT, 4 * G)
    assert "slots" in stager._bad_request(inside, G, 2 * SLOT, 3 * G)


# ---- IPC copies (live/ipc.py): never chosen on host memory; a failure falls back ---------------


def test_ipc_is_never_chosen_on_host_memory() -> None:
    t, buf = _parent("ipc")  # forced where a route exists: host memory has none
    p = Peer(t, f"kvplane-stage-ipc-host-{os.getpid()}", seed=21)
    try:
        assert PeerInfo.from_bytes(t.local_info()).ipc is None  # nothing exported
        assert t.ipc_route(p.name) is None
        buf[:] = pattern(SIZE, 22)
        ours, theirs = picked(23, DENSE, 30)
        res = t.wait(t.post_blocks(p.name, "WRITE", DENSE, ours, DENSE, theirs), TIMEOUT)
        assert res.status is Status.DONE and res.method in ("staged", "direct"), res
        assert res.fallback == "" and t.fallbacks() == []
        sent = b"".join(buf[o:o + G].tobytes() for o in block_offsets(DENSE, ours))
        assert p.ask(t, "pieces", block_offsets(DENSE, theirs)) == sent
    finally:
        p.stop()
        t.close()


class _NoGpuIpc:
    """FAKE, named as such: an `IpcSide` for a machine without a GPU. It claims a route to
    every peer (as a GPU transport would for a peer on the same GPU); opening the peer's
    handles is the real `IpcSide.mapping`, which fails here (no CUDA), as it would on a GPU
    for a handle from another container."""

    route_to = "same-device"

    def __init__(self) -> None:
        self.device = "cuda:0"
        self.maps: dict[str, Any] = {}
        self.broken: dict[str, str] = {}

    def route(self, peer: str, theirs: Any) -> str | None:
        return None if peer in self.broken or not theirs else self.route_to

    mapping = IpcSide.mapping
    forget = IpcSide.forget


def _with_handles(info: bytes) -> bytes:
    """The peer's handshake with a CUDA IPC export of one region (a handle of zeros)."""
    d = json.loads(info)
    zeros = base64.b64encode(bytes(64)).decode()
    d["ipc"] = {"host": ipc_host_id(), "gpu": "GPU-elsewhere", "pid": 1,
                "regions": [{"h": zeros, "size": SIZE, "off": 0, "rh": zeros, "ro": 0,
                             "eh": "", "sync": False, "toff": 0, "len": SIZE, "addr": 0}]}
    return json.dumps(d).encode()


def test_a_failed_ipc_open_falls_back_records_it_and_moves_the_bytes() -> None:
    t, buf = _parent("ipc")
    p = Peer(t, f"kvplane-stage-ipc-fail-{os.getpid()}", seed=24, forge=_with_handles)
    try:
        t._ipc = _NoGpuIpc()  # type: ignore[assignment]
        assert t.ipc_route(p.name) == "same-device"
        assert t.method_for(p.name, 1 << 20, 200, blocks=True) == "ipc"
        assert t.method_for(p.name, 1 << 20, 200) != "ipc"  # run lists never go by IPC
        buf[:] = pattern(SIZE, 25)
        ours, theirs = picked(26, DENSE, 40)
        res = t.wait(t.post_blocks(p.name, "WRITE", DENSE, ours, DENSE, theirs,
                                   notify=b"ipc-fallback-1"), TIMEOUT)
        assert res.status is Status.DONE and res.method in ("staged", "direct"), res
        assert res.fallback.startswith(f"ipc -> {res.method}: "), res.fallback
        [fb] = t.fallbacks()
        assert (fb.peer, fb.chosen, fb.used) == (p.name, "ipc", res.method)
        assert "CUDA IPC handles failed" in fb.reason
        assert p.ask(t, "notif", b"ipc-fallback-1", TIMEOUT) == b"ipc-fallback-1"
        sent = b"".join(buf[o:o + G].tobytes() for o in block_offsets(DENSE, ours))
        assert p.ask(t, "pieces", block_offsets(DENSE, theirs)) == sent
        # the peer is off IPC now: the next transfer does not try again, a READ included
        assert t.ipc_route(p.name) is None
        buf[:] = 0
        ours, theirs = picked(27, DENSE, 20)
        res = t.wait(t.post_blocks(p.name, "READ", DENSE, ours, DENSE, theirs), TIMEOUT)
        assert res.status is Status.DONE and res.fallback == "", res
        assert len(t.fallbacks()) == 1
        expected = p.ask(t, "pieces", block_offsets(DENSE, theirs))
        assert b"".join(buf[o:o + G].tobytes() for o in block_offsets(DENSE, ours)) == expected
    finally:
        p.stop()
        t.close()


def test_handshakes_carry_an_ipc_export_and_old_ones_have_none() -> None:
    t, _ = _parent(None)
    try:
        plain = t.local_info()
        assert "ipc" not in json.loads(plain) and PeerInfo.from_bytes(plain).ipc is None
        forged = PeerInfo.from_bytes(_with_handles(plain))
        assert forged.ipc is not None and forged.ipc["gpu"] == "GPU-elsewhere"
        assert PeerInfo.from_bytes(forged.to_bytes()) == forged
        bad = json.loads(plain)
        bad["ipc"] = [1, 2]
        with pytest.raises(PeerError, match="ipc must be an object"):
            PeerInfo.from_bytes(json.dumps(bad).encode())
    finally:
        t.close()
