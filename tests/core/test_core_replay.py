"""The replay checker catches what it promises: each hand-made bad log yields its rule."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from kvplane_core_harness import Pair, layout

from kvplane.core.events import (
    BlocksFreed,
    BlocksReserved,
    DecodeBlocksReserved,
    Event,
    KVReceived,
    LeaseExpired,
    LeaseGranted,
    LeasePinned,
    LeaseReleased,
    NotificationReceived,
    RegistrationSent,
    ReuseDecided,
    TransferCompleted,
    TransferFailed,
    TransferPlanned,
)
from kvplane.core.replay import Violation, replay


def rules(log: list[Event], final: bool = False) -> list[str]:
    return [v.rule for v in replay(log, final=final).violations]


def reserved(inst: str, req: str, blocks: tuple[int, ...], attempt: int = 0, at: float = 0.0,
             purpose: str = "prefill") -> BlocksReserved:
    return BlocksReserved(at=at, instance=inst, request=req, attempt=attempt, blocks=blocks,
                          purpose=purpose)  # type: ignore[arg-type]


def freed(inst: str, req: str, blocks: tuple[int, ...], attempt: int = 0,
          at: float = 1.0) -> BlocksFreed:
    return BlocksFreed(at=at, instance=inst, request=req, attempt=attempt, blocks=blocks,
                       reason="x")


def planned(req: str, src_blocks: tuple[int, ...], dst_blocks: tuple[int, ...], *,
            direction: str = "P->D", src: str = "P", dst: str = "D", instance: str = "P",
            attempt: int = 0, expected: int = 1) -> TransferPlanned:
    return TransferPlanned(
        at=0.5, instance=instance, request=req, attempt=attempt, direction=direction,  # type: ignore[arg-type]
        src=src, dst=dst, src_blocks=src_blocks, dst_blocks=dst_blocks, num_tokens=16, runs=1,
        descriptors=2, bytes=100, expected_notifications=expected,
    )


def completed(req: str, direction: str = "P->D", instance: str = "P",
              attempt: int = 0) -> TransferCompleted:
    return TransferCompleted(at=0.7, instance=instance, request=req, attempt=attempt,
                             direction=direction)  # type: ignore[arg-type]


def granted(inst: str, req: str, lease: str, blocks: tuple[int, ...], *, attempt: int = 0,
            expires_at: float = 10.0, purpose: str = "retained") -> LeaseGranted:
    return LeaseGranted(at=0.0, instance=inst, request=req, attempt=attempt, lease=lease,
                        blocks=blocks, num_tokens=16, block_hashes=("h",), expires_at=expires_at,
                        renewable=False, purpose=purpose)  # type: ignore[arg-type]


def decided(req: str, lease: str) -> ReuseDecided:
    return ReuseDecided(at=0.1, instance="P", request=req, lease=lease, outcome="read",
                        prompt_tokens=40, local_hit_tokens=0, matched_tokens=16,
                        remote_tokens=16, threshold=16)


# a clean push: both sides reserve, plan, one notification, KV, transfer done, both free
CLEAN: list[Event] = [
    reserved("P", "r1", (1, 2)),
    reserved("D", "r1", (7, 8), purpose="remote_kv"),
    RegistrationSent(at=0.1, instance="D", request="r1", attempt=0, prefill="P",
                     dst_blocks=(7, 8), num_tokens=20, src_tp=1, expected_notifications=1,
                     deadline=30.0),
    planned("r1", (1, 2), (7, 8)),
    NotificationReceived(at=0.6, instance="D", request="r1", attempt=0, src_rank=0, dst_rank=0),
    KVReceived(at=0.6, instance="D", request="r1", attempt=0, num_tokens=20),
    completed("r1"),
    freed("P", "r1", (1, 2)),
    freed("D", "r1", (7, 8)),
]


def test_a_clean_log_passes() -> None:
    assert rules(CLEAN, final=True) == []


def test_double_free() -> None:
    assert rules([*CLEAN, freed("P", "r1", (1, 2))]) == ["double-free"]
    # freeing another request's blocks is a double free too
    assert rules([reserved("P", "r1", (1,)), freed("P", "r2", (1,))]) == ["double-free"]
    # so is freeing them under another attempt of the same request
    assert rules([reserved("P", "r1", (1,), attempt=1), freed("P", "r1", (1,), attempt=0)]) == [
        "double-free"
    ]
    # the same block twice in one free
    assert rules([reserved("P", "r1", (1,)), freed("P", "r1", (1, 1))]) == ["double-free"]


def test_double_allocation() -> None:
    assert rules([reserved("P", "r1", (1, 2)), reserved("P", "r2", (2, 3))]) == [
        "double-allocation"
    ]
    # other instances have their own block ids
    assert rules([reserved("P", "r1", (1, 2)), reserved("D", "r2", (1, 2))]) == []


def test_transfer_into_foreign_blocks() -> None:
    log = [reserved("P", "r1", (1,)), reserved("D", "r2", (7,)), planned("r1", (1,), (7,))]
    assert rules(log) == ["foreign-blocks"]
    # out of blocks the source does not hold for the request
    log = [reserved("P", "r2", (1,)), reserved("D", "r1", (7,)), planned("r1", (1,), (7,))]
    assert rules(log) == ["foreign-blocks"]
    # into freed blocks
    log = [reserved("P", "r1", (1,)), reserved("D", "r1", (7,)), freed("D", "r1", (7,)),
           planned("r1", (1,), (7,))]
    assert rules(log) == ["foreign-blocks"]
    # into blocks of an older attempt of the same request
    log = [reserved("P", "r1", (1,), attempt=1), reserved("D", "r1", (7,), attempt=0),
           planned("r1", (1,), (7,), attempt=1)]
    assert rules(log) == ["foreign-blocks"]
    # a reuse read into prefill blocks not reserved for it
    log = [reserved("D", "old", (5,)), granted("D", "old", "L", (5,)), decided("r2", "L"),
           planned("r2", (5,), (3,), direction="D->P", src="D", dst="P")]
    assert rules(log) == ["foreign-blocks"]
    # a reuse read of blocks outside the lease
    log = [reserved("D", "old", (5, 6)), granted("D", "old", "L", (5,)), decided("r2", "L"),
           reserved("P", "r2", (3,)),
           planned("r2", (6,), (3,), direction="D->P", src="D", dst="P")]
    assert rules(log) == ["foreign-blocks"]


def test_lease_over_blocks_the_request_does_not_own() -> None:
    assert rules([reserved("D", "r1", (5,)), granted("D", "r2", "L", (5,))]) == ["foreign-blocks"]
    assert rules([granted("D", "r1", "L", (5,))]) == ["foreign-blocks"]


def test_read_after_lease_expiry_or_release() -> None:
    base: list[Event] = [reserved("D", "old", (5,)), granted("D", "old", "L", (5,)),
                         reserved("P", "r2", (3,))]
    read = [decided("r2", "L"), planned("r2", (5,), (3,), direction="D->P", src="D", dst="P")]
    for end in (LeaseExpired(at=10.0, instance="D", request="old", lease="L"),
                LeaseReleased(at=10.0, instance="D", request="old", lease="L", reason="x")):
        assert rules([*base, end, freed("D", "old", (5,)), *read]) == ["dead-lease-read"]
        pin = LeasePinned(at=11.0, instance="D", request="old", lease="L", reader="P:r2#0",
                          until=12.0)
        assert rules([*base, end, pin]) == ["dead-lease-read"]
    # a read without any lease behind it
    assert rules([reserved("P", "r2", (3,)), *read]) == ["dead-lease-read"]


def test_lease_ending_while_a_read_is_in_flight() -> None:
    log: list[Event] = [
        reserved("D", "old", (5,)), granted("D", "old", "L", (5,)), reserved("P", "r2", (3,)),
        decided("r2", "L"), planned("r2", (5,), (3,), direction="D->P", src="D", dst="P"),
        LeaseExpired(at=10.0, instance="D", request="old", lease="L"),
    ]
    assert rules(log) == ["dead-lease-read"]
    ok = [*log[:-1], completed("r2", "D->P"), log[-1]]
    assert rules(ok) == []


def test_pull_hold_ending_while_decode_reads() -> None:
    log: list[Event] = [
        reserved("P", "r1", (1,)), granted("P", "r1", "H", (1,), purpose="pull_hold"),
        reserved("D", "r1", (7,), purpose="remote_kv"),
        planned("r1", (1,), (7,), instance="D"),  # decode plans the READ
        LeaseExpired(at=0.6, instance="P", request="r1", lease="H"),
    ]
    assert rules(log) == ["dead-lease-read"]
    ok = [*log[:-1], completed("r1", instance="D"), log[-1]]
    assert rules(ok) == []
    aborted = LeaseReleased(at=0.6, instance="P", request="r1", lease="H", reason="aborted")
    assert rules([*log[:-1], aborted]) == ["dead-lease-read"]


def test_pull_hold_released_by_the_readers_own_read_done() -> None:
    """Decode sends read-done only after its READ ended: that release is the read's end, even
    when (instances record concurrently) decode's own completion is recorded after it."""
    log: list[Event] = [
        reserved("P", "r1", (1,)), granted("P", "r1", "H", (1,), purpose="pull_hold"),
        reserved("D", "r1", (7,), purpose="remote_kv"),
        planned("r1", (1,), (7,), instance="D"),
        LeaseReleased(at=0.6, instance="P", request="r1", lease="H", reason="read by decode"),
        completed("r1", instance="D"),
    ]
    assert rules(log) == []


def test_transfer_ended_twice_or_never_planned_or_planned_twice() -> None:
    assert rules([*CLEAN, completed("r1")]) == ["transfer-outcome"]
    failed = TransferFailed(at=0.8, instance="P", request="r1", attempt=0, direction="P->D",
                            reason="x")
    assert rules([*CLEAN, failed]) == ["transfer-outcome"]
    assert rules([completed("r9")]) == ["transfer-outcome"]
    assert rules([*CLEAN[:4], CLEAN[3]]) == ["transfer-outcome"]


def test_kv_received_early() -> None:
    log = [e for e in CLEAN if not isinstance(e, NotificationReceived)]
    assert rules(log) == ["early-receive"]
    # a duplicate does not count
    dup = NotificationReceived(at=0.6, instance="D", request="r1", attempt=0, src_rank=0,
                               dst_rank=0, duplicate=True)
    log = [dup if isinstance(e, NotificationReceived) else e for e in CLEAN]
    assert rules(log) == ["early-receive"]
    # a notification folded into the `KVReceived` counts; a stream named twice counts once
    def kv(streams: list[tuple[int, int]], expected: int) -> list[Event]:
        sent = RegistrationSent(at=0.1, instance="D", request="r1", attempt=0, prefill="P",
                                dst_blocks=(7, 8), num_tokens=20, src_tp=2,
                                expected_notifications=expected, deadline=30.0)
        got = KVReceived(at=0.6, instance="D", request="r1", attempt=0, num_tokens=20,
                         src_ranks=tuple(s for s, _ in streams),
                         dst_ranks=tuple(d for _, d in streams))
        return [sent if isinstance(e, RegistrationSent) else got if isinstance(e, KVReceived)
                else e for e in CLEAN if not isinstance(e, NotificationReceived)]
    assert rules(kv([(0, 0), (1, 0)], 2), final=True) == []
    assert rules(kv([(0, 0)], 2)) == ["early-receive"]
    assert rules(kv([(0, 0), (0, 0)], 2)) == ["early-receive"]
    one = NotificationReceived(at=0.5, instance="D", request="r1", attempt=0, src_rank=1,
                               dst_rank=0)
    log = kv([(0, 0)], 2)
    assert rules([*log[:4], one, *log[4:]], final=True) == []


def test_a_decode_macro_steps_reservations_are_its_requests() -> None:
    """A `DecodeBlocksReserved` is checked and folded as each request's `BlocksReserved`."""
    grown = DecodeBlocksReserved(at=1.0, instance="D", requests=("r1", "r2"), attempts=(0, 1),
                                 counts=(2, 1), blocks=(3, 4, 5))
    assert rules([grown, freed("D", "r1", (3, 4)), freed("D", "r2", (5,), attempt=1)],
                 final=True) == []
    assert rules([grown, freed("D", "r1", (3, 4, 5))]) == ["double-free"]
    assert rules([reserved("D", "r0", (4,)), grown]) == ["double-allocation"]
    twice = DecodeBlocksReserved(at=1.0, instance="D", requests=("r1", "r2"), attempts=(0, 0),
                                 counts=(1, 1), blocks=(3, 3))
    assert rules([twice]) == ["double-allocation"]
    assert rules([grown], final=True) == ["leak"]


def test_leak_and_unfinished_transfer_only_when_final() -> None:
    log = CLEAN[:-1]  # decode never frees
    assert rules(log) == []
    assert rules(log, final=True) == ["leak"]
    log = CLEAN[:5]  # the transfer never ends either
    assert rules(log, final=True) == ["leak", "leak", "unfinished-transfer"]  # P and D
    # blocks under a live lease are retained, not leaked
    kept = [*CLEAN[:-1], granted("D", "r1", "L", (7, 8))]
    assert rules(kept, final=True) == []
    assert rules([], final=True) == []


def test_violations_name_the_event() -> None:
    (v,) = replay([*CLEAN, freed("P", "r1", (1, 2), at=3.0)]).violations
    assert isinstance(v, Violation)
    assert v.index == len(CLEAN) and v.event.at == 3.0
    assert "[double-free]" in str(v) and "BlocksFreed" in str(v) and "r1" in str(v)


# --- mutations of real logs -----------------------------------------------------------------------


def real_log() -> list[Event]:
    pair = Pair(layout(tp=2), layout(tp=4))
    pair.push_request("r1", 60)
    pair.pull_request("r2", 40)
    return pair.log


Mutation = Callable[[list[Event]], list[Event]]


def _dup_first(kind: type) -> Mutation:
    def m(log: list[Event]) -> list[Event]:
        i = next(i for i, e in enumerate(log) if isinstance(e, kind))
        return [*log[: i + 1], log[i], *log[i + 1 :]]
    return m


def _drop_first(kind: type) -> Mutation:
    def m(log: list[Event]) -> list[Event]:
        i = next(i for i, e in enumerate(log) if isinstance(e, kind))
        return [*log[:i], *log[i + 1 :]]
    return m


@pytest.mark.parametrize(
    ("mutate", "rule"),
    [
        (_dup_first(BlocksFreed), "double-free"),
        (_dup_first(BlocksReserved), "double-allocation"),
        (_dup_first(TransferCompleted), "transfer-outcome"),
        (_drop_first(NotificationReceived), "early-receive"),
        (_drop_first(BlocksFreed), "leak"),
        (_drop_first(TransferCompleted), "unfinished-transfer"),
        (_drop_first(BlocksReserved), "foreign-blocks"),
    ],
)
def test_mutated_real_logs_are_caught(mutate: Mutation, rule: str) -> None:
    log = real_log()
    assert rules(log, final=True) == []
    assert rule in rules(mutate(log), final=True)
