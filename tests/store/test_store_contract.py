"""The event store's contract, run against every backend (SQLite file, real PostgreSQL)."""

from __future__ import annotations

import dataclasses
import math
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import Text, cast, func, inspect, select
from store_samples import every_type_samples, in_threads, sample_event

from kvplane.core.errors import SchemaError
from kvplane.core.events import (
    EVENT_TYPES,
    SCHEMA_VERSION,
    BlocksReserved,
    DecodeBlocksReserved,
    Event,
    RequestArrived,
    TransferPlanned,
)
from kvplane.store import (
    EventRefused,
    EventStore,
    RunNotFound,
    block_count,
    current_revision,
    events_of,
    events_table,
    has_block_counts,
    has_packed_lists,
    head_revision,
    model_drift,
    open_store,
    runs_table,
)
from kvplane.store.migrate import downgrade


def blocks(i: int, *, request: str = "r1", at: float | None = None) -> BlocksReserved:
    return BlocksReserved(
        at=float(i) if at is None else at, instance="d0", request=request,
        blocks=(i, i + 1, i + 2), purpose="prefill",
    )  # fmt: skip


def stored_seqs(store: EventStore, run_id: str) -> list[int]:
    with store.engine.connect() as conn:
        rows = conn.execute(
            select(events_table.c.seq).where(events_of(store.engine, run_id)).order_by("seq")
        )
        return [r[0] for r in rows]


# --- round trip ------------------------------------------------------------------------------


def test_every_event_type_round_trips(store: EventStore) -> None:
    samples = every_type_samples(per_type=4)
    assert {type(e).__name__ for e in samples} == set(EVENT_TYPES)
    run = store.create_run("sim", "round-trip")
    assert store.append(run, samples) == range(len(samples))
    back = list(store.events(run))
    assert back == samples
    assert [type(e) for e in back] == [type(e) for e in samples]
    assert store.count(run) == len(samples)


def test_values_come_back_exactly(store: EventStore) -> None:
    awkward = [
        dataclasses.replace(sample_event(RequestArrived), at=at, conversation=text)
        for at, text in [
            (0.1 + 0.2, "ünï\u00e7ødé 😀"),
            (1e-300, "tab\tnewline\nreturn\rbackslash\\"),
            (123456789.00000001, '"quoted" and \\N'),
            (5e-324, ""),
            (-0.0, "\\."),
        ]
    ]
    run = store.create_run("sim", "exact")
    store.append(run, awkward)
    back = list(store.events(run))
    assert back == awkward
    assert [e.at for e in back] == [e.at for e in awkward]  # == on floats: bit-exact here


# --- seq and order ---------------------------------------------------------------------------


def test_seq_is_contiguous_per_run_across_batches(store: EventStore) -> None:
    a, b = store.create_run("sim", "a"), store.create_run("sim", "b")
    assert store.append(a, [blocks(i) for i in range(3)]) == range(3)
    assert store.append(b, [blocks(i) for i in range(2)]) == range(2)
    assert store.append(a, []) == range(3, 3)
    assert store.append(a, [blocks(i) for i in range(3, 8)]) == range(3, 8)
    assert stored_seqs(store, a) == list(range(8))
    assert stored_seqs(store, b) == [0, 1]
    # Order is seq order, not time order.
    store.append(a, [blocks(100, at=-1.0)])
    assert [e.at for e in store.events(a)] == [*map(float, range(8)), -1.0]


def test_concurrent_appenders_get_distinct_contiguous_seqs(store_url: str) -> None:
    stores = [open_store(store_url) for _ in range(4)]
    run = stores[0].create_run("live", "concurrent")

    def writer(k: int) -> None:
        for n in range(10):
            stores[k].append(run, [blocks(1000 * k + 10 * n + j) for j in range(10)])

    in_threads(writer, range(4))
    assert stored_seqs(stores[0], run) == list(range(400))
    # Each batch landed whole and in order.
    ats = [int(e.at) for e in stores[0].events(run)]
    for start in range(0, 400, 10):
        batch = ats[start : start + 10]
        assert batch == list(range(batch[0], batch[0] + 10))
    for s in stores:
        s.close()


# --- filtering -------------------------------------------------------------------------------


def test_filter_by_type_and_request(store: EventStore) -> None:
    run = store.create_run("sim", "filters")
    mixed: list[Event] = []
    for i in range(12):
        request = f"r{i % 3}"
        mixed.append(dataclasses.replace(sample_event(RequestArrived, i), request=request))
        mixed.append(blocks(i, request=request))
    store.append(run, mixed)

    only_blocks = list(store.events(run, types=[BlocksReserved]))
    assert only_blocks == [e for e in mixed if isinstance(e, BlocksReserved)]
    assert list(store.events(run, types="RequestArrived")) == [
        e for e in mixed if isinstance(e, RequestArrived)
    ]
    assert list(store.events(run, types=BlocksReserved, request="r1")) == [
        e for e in mixed if isinstance(e, BlocksReserved) and e.request == "r1"
    ]
    assert list(store.events(run, request="r2")) == [e for e in mixed if e.request == "r2"]
    assert list(store.events(run, request="nobody")) == []
    assert list(store.events(run, types=[])) == []
    assert store.count(run, types=["BlocksReserved", RequestArrived]) == 24
    assert store.count(run, types=TransferPlanned) == 0
    with pytest.raises(SchemaError, match="TransferPlaned"):
        list(store.events(run, types=["TransferPlaned"]))


def test_events_streams_lazily(store: EventStore) -> None:
    run = store.create_run("sim", "stream")
    store.append(run, [blocks(i) for i in range(5000)])
    stream = store.events(run)
    assert next(stream) == blocks(0)
    # A writer can go on while a reader is part-way through a run.
    store.append(run, [blocks(5000)])
    assert sum(1 for _ in stream) >= 4999
    assert store.count(run) == 5001


# --- refusals: nothing stored is lost or altered ---------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NotInTheSchema(Event):
    what: str = "?"


def bad_events() -> list[tuple[Event, str]]:
    ok = blocks(1)
    return [
        (NotInTheSchema(at=1.0, instance="x"), "unknown event type"),
        (dataclasses.replace(ok, purpose="sideways"), "purpose"),  # type: ignore[arg-type]
        (dataclasses.replace(ok, blocks=(1, "two", 3)), "blocks"),  # type: ignore[arg-type]
        (dataclasses.replace(ok, blocks=(1, True)), "blocks"),
        (dataclasses.replace(ok, instance=7), "instance"),  # type: ignore[arg-type]
        (dataclasses.replace(ok, at="soon"), "at"),  # type: ignore[arg-type]
        (dataclasses.replace(ok, at=math.nan), "NaN"),
        (dataclasses.replace(ok, request="a\x00b"), "NUL"),
        (dataclasses.replace(sample_event(TransferPlanned), bytes=math.inf), "bytes"),
    ]


@pytest.mark.parametrize("bad, why", bad_events(), ids=lambda v: str(v)[:30])
def test_refused_batch_leaves_the_store_untouched(store: EventStore, bad: Event, why: str) -> None:
    run = store.create_run("sim", "refusals")
    kept = [blocks(i) for i in range(5)]
    store.append(run, kept)
    batch = [blocks(10), blocks(11), bad, blocks(12)]
    with pytest.raises(EventRefused) as refused:
        store.append(run, batch)
    assert refused.value.index == 2
    assert refused.value.type_name == type(bad).__name__
    message = str(refused.value)
    assert "#2" in message and type(bad).__name__ in message and why in message
    assert isinstance(refused.value, SchemaError)
    assert list(store.events(run)) == kept
    assert stored_seqs(store, run) == list(range(5))
    # The run still takes good batches, numbered on from where it was.
    assert store.append(run, [blocks(20)]) == range(5, 6)


# --- runs -------------------------------------------------------------------------------------


def test_runs_round_trip(store: EventStore) -> None:
    started = datetime(2026, 3, 1, 9, 30, 15, 123456, tzinfo=timezone(timedelta(hours=2)))
    meta = {"qps": 4.5, "modes": ["push", "pull"], "nested": {"tp": 2}, "ok": True}
    first = store.create_run("live", "scenarios/2p2d.yaml", meta=meta, started=started)
    info = store.run(first)
    assert info.id == first and info.kind == "live" and info.scenario == "scenarios/2p2d.yaml"
    assert info.meta == meta and info.parent is None and info.schema_version == SCHEMA_VERSION
    assert info.started == started and info.started.tzinfo is not None
    replay = store.create_run("replay", "scenarios/2p2d.yaml", parent=first)
    imported = store.create_run("import", "bench.json", run_id="my-own-id")
    assert imported == "my-own-id"
    assert store.run(replay).parent == first
    assert datetime.now(UTC) - store.run(replay).started < timedelta(minutes=5)
    assert [r.id for r in store.runs()] == [first, replay, imported]
    assert [r.id for r in store.runs(kind="replay")] == [replay]


def test_run_arguments_are_checked(store: EventStore) -> None:
    with pytest.raises(ValueError, match="kind"):
        store.create_run("dream", "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="JSON"):
        store.create_run("sim", "x", meta={"when": datetime.now()})
    with pytest.raises(ValueError, match="timezone"):
        store.create_run("sim", "x", started=datetime(2026, 1, 1))
    with pytest.raises(RunNotFound):
        store.create_run("replay", "x", parent="no-such-run")
    assert store.runs() == []


def test_unknown_runs_are_reported(store: EventStore) -> None:
    for call in (
        lambda: store.run("nope"),
        lambda: store.append("nope", [blocks(1)]),
        lambda: store.events("nope"),
        lambda: store.count("nope"),
        lambda: store.delete_run("nope"),
    ):
        with pytest.raises(RunNotFound, match="nope"):
            call()


def test_delete_run_removes_its_events_and_orphans_its_children(store: EventStore) -> None:
    parent = store.create_run("sim", "p")
    child = store.create_run("replay", "p", parent=parent)
    other = store.create_run("sim", "o")
    store.append(parent, [blocks(i) for i in range(7)])
    store.append(child, [blocks(i) for i in range(3)])
    store.append(other, [blocks(i) for i in range(2)])
    assert store.delete_run(parent) == 7
    with pytest.raises(RunNotFound):
        store.run(parent)
    assert store.run(child).parent is None
    assert store.count(child) == 3 and store.count(other) == 2
    with store.engine.connect() as conn:
        orphans = conn.execute(
            select(func.count()).select_from(events_table).where(events_of(store.engine, parent))
        ).scalar_one()
    assert orphans == 0


# --- migrations and the read side -------------------------------------------------------------


def test_migrations_are_idempotent_and_match_the_models(store_url: str) -> None:
    first = open_store(store_url)
    run = first.create_run("sim", "kept")
    first.append(run, [blocks(1)])
    first.close()
    for _ in range(2):
        again = open_store(store_url)
        assert current_revision(again.engine) == head_revision()
        assert model_drift(again.engine) == []
        assert list(again.events(run)) == [blocks(1)]
        tables = set(inspect(again.engine).get_table_names())
        assert {"runs", "events", "schema_meta"} <= tables
        indexes = {ix["name"] for ix in inspect(again.engine).get_indexes("events")}
        assert indexes == {"ix_events_run_type_cover"}  # (run, request): dropped in 0004
        again.close()


def stored_block_counts(store: EventStore, run_id: str) -> list[int | None]:
    with store.engine.connect() as conn:
        return list(conn.execute(select(events_table.c.blocks).where(
            events_of(store.engine, run_id)).order_by(events_table.c.seq)).scalars())


def test_block_counts_are_stored_beside_the_events(store: EventStore) -> None:
    samples = every_type_samples(per_type=3)
    run = store.create_run("sim", "counts")
    store.append(run, samples)
    counted = stored_block_counts(store, run)
    assert counted == [block_count(e) for e in samples]
    # every event type with a block list is counted, and the count is its list's length
    assert {type(e).__name__ for e, n in zip(samples, counted, strict=True) if n is not None} \
        == {"BlocksReserved", "DecodeBlocksReserved", "BlocksFreed", "RegistrationSent",
            "RegistrationArrived",
            "PrefillFinished", "TransferPlanned", "MetadataRelayed", "LeaseGranted"}
    transfer = next(e for e in samples if isinstance(e, TransferPlanned))
    assert block_count(transfer) == len(transfer.dst_blocks)


def test_an_old_store_is_read_as_it_is_then_upgraded_with_its_counts(store_url: str) -> None:
    # less the types that came after revision 0002 (no store of revision 0001 holds them)
    samples = [e for e in every_type_samples(per_type=3)
               if not isinstance(e, DecodeBlocksReserved)]
    with open_store(store_url) as first:
        run = first.create_run("sim", "old")
        first.append(run, samples)
        downgrade(first.engine, "0001")  # as a kvplane before revision 0002 left it
    with open_store(store_url, read_only=True) as old:
        assert old.revision == "0001" and not has_block_counts(old.engine)
        assert list(old.events(run)) == samples  # read as it is, nothing written
        note = old.upgrade_note
        assert note is not None and "kvplane upgrade" in note and "0001" in note
        assert current_revision(old.engine) == "0001"
    with open_store(store_url) as new:  # a writer migrates it, counting the stored blocks
        assert new.revision == head_revision() and new.upgrade_note is None
        assert has_block_counts(new.engine) and model_drift(new.engine) == []
        assert stored_block_counts(new, run) == [block_count(e) for e in samples]
        assert list(new.events(run)) == samples


def packed_and_json(store: EventStore, run_id: str) -> tuple[int, int]:
    """How many of the run's rows have packed lists, and how many hold them in the JSON."""
    e = events_table
    with store.engine.connect() as conn:
        rows = conn.execute(select(e.c.lists, cast(e.c.payload, Text)).where(
            events_of(store.engine, run_id), e.c.blocks.is_not(None))).all()
    packed = sum(1 for lists, _ in rows if lists is not None)
    in_json = sum(1 for lists, text in rows
                  if lists is None and ('_blocks"' in text or '"blocks"' in text))
    return packed, in_json


def test_a_store_before_0003_keeps_its_lists_in_the_json_and_reads_alike(store_url: str) -> None:
    samples = every_type_samples(per_type=3)
    big = BlocksReserved(at=9.0, instance="d0", request="r9", blocks=tuple(range(100, 1124)),
                         purpose="prefill")
    with open_store(store_url) as first:
        run = first.create_run("sim", "old")
        first.append(run, [*samples, big])
        with_lists = sum(1 for e in [*samples, big] if block_count(e) is not None)
        assert packed_and_json(first, run) == (with_lists, 0)
        downgrade(first.engine, "0002")  # as a kvplane before revision 0003 left it
    with open_store(store_url, read_only=True) as old:
        assert old.revision == "0002" and not has_packed_lists(old.engine)
        assert list(old.events(run)) == [*samples, big]  # read as it is, nothing written
        assert stored_block_counts(old, run) == [block_count(e) for e in [*samples, big]]
    with open_store(store_url) as new:  # the upgrade rewrites nothing: old rows keep the JSON
        assert has_packed_lists(new.engine) and model_drift(new.engine) == []
        assert packed_and_json(new, run) == (0, with_lists)
        new.append(run, [big, *samples])  # new rows beside them are packed
        assert packed_and_json(new, run) == (with_lists, with_lists)
        assert list(new.events(run)) == [*samples, big, big, *samples]
        assert list(new.events(run, BlocksReserved, request="r9")) == [big, big]


def test_concurrent_first_opens_migrate_once(store_url: str) -> None:
    def opener(_: int) -> str | None:
        s = open_store(store_url)
        try:
            return current_revision(s.engine)
        finally:
            s.close()

    assert in_threads(opener, range(4)) == [head_revision()] * 4


def test_read_side_aggregates_in_sql(store: EventStore) -> None:
    run = store.create_run("sim", "aggregates")
    transfers = [
        dataclasses.replace(sample_event(TransferPlanned, i), bytes=1000 * (i + 1))
        for i in range(4)
    ]
    store.append(run, [*transfers, blocks(1), blocks(2)])
    e = events_table
    by_type = select(e.c.type, func.count()).where(events_of(store.engine, run)).group_by(e.c.type)
    moved = select(func.sum(e.c.payload["bytes"].as_integer())).where(
        events_of(store.engine, run), e.c.type == "TransferPlanned"
    )
    with store.engine.connect() as conn:
        assert dict(conn.execute(by_type).all()) == {
            "TransferPlanned": 4, "BlocksReserved": 2,
        }  # fmt: skip
        assert conn.execute(moved).scalar_one() == 10_000
        kinds = conn.execute(select(runs_table.c.kind).where(runs_table.c.id == run))
        assert kinds.scalar_one() == "sim"
