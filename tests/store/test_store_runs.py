"""Block lists that reach the recorder with their runs are packed per run (revision 0006).

- A `RunBlocks` (the simulator's lists while it records) is packed from its runs: kind 2 when
  every run ascends, kind 5 when one descends; it reads back as the same ids, on both backends.
- A store written before 0006 by main's simulator (`tests/data/store_rev0004_sim.sqlite`,
  made by `tests/data/make_rev0004_sim_store.py` with main's code at 8dca3ec) opens read-only
  and upgraded, and holds exactly the events this tree's simulator makes for the same points.
- Downgrading to 0005 rewrites every kind-5 list with the older kinds, so an older kvplane
  reads the store as it was.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from kvplane.core.blocks import RunBlocks, runs_of
from kvplane.core.events import BlocksFreed, BlocksReserved, Event, TransferPlanned, expand
from kvplane.core.replay import replay
from kvplane.sim.runner import simulate
from kvplane.store import BatchingRecorder, EventStore, events_table, model_drift, open_store
from kvplane.store.encoding import _kinds, encode_trusted_one, payload_of
from kvplane.store.migrate import current_revision, downgrade, upgrade

DATA = Path(__file__).resolve().parents[1] / "data"
sys.path.insert(0, str(DATA))
from make_rev0004_sim_store import points


def runs(ids: list[int]) -> RunBlocks:
    return RunBlocks(ids, runs_of(ids))


ASCENDING = runs([*range(100, 600), *range(900, 1300), *range(2000, 2124)])
DESCENDING = runs([*range(5000, 4600, -1), *range(8000, 7700, -1), *range(300, 624)])
SCATTERED = runs(list(range(0, 2048, 2)))  # runs of one id: packed by its ids instead


def samples() -> list[Event]:
    return [
        BlocksReserved(at=1.0, instance="p0", request="r1", blocks=ASCENDING, purpose="prefill"),
        BlocksReserved(at=1.5, instance="d0", request="r1", blocks=DESCENDING,
                       purpose="remote_kv"),
        TransferPlanned(at=2.0, instance="p0", request="r1", attempt=0, direction="P->D",
                        src="p0", dst="d0", src_blocks=ASCENDING, dst_blocks=DESCENDING,
                        num_tokens=1024 * 16, runs=3, descriptors=3, bytes=1 << 20,
                        expected_notifications=1),
        BlocksFreed(at=3.0, instance="d0", request="r1", blocks=SCATTERED, reason="done"),
    ]


def test_run_lists_are_packed_per_run_and_read_back_as_their_ids() -> None:
    rows = [encode_trusted_one(ev) for ev in samples()]
    kinds = [_kinds(row.lists) for row in rows if row.lists is not None]
    assert kinds == [[2], [5], [2, 5], [3]]  # per run: few bytes; the scattered list by ids
    assert len(rows[1].lists or b"") < 40  # 3 runs, not 1,024 ids
    for ev, row in zip(samples(), rows, strict=True):
        fields = {n: list(getattr(ev, n)) for n in ("blocks", "src_blocks", "dst_blocks")
                  if hasattr(ev, n)}
        assert {n: payload_of(row)[n] for n in fields} == fields


def recorded_samples(store: EventStore) -> str:
    """A new run holding `samples()` as the simulator's trusted recorder writes them."""
    run: str = store.create_run("sim", "runs")
    rec = BatchingRecorder(store, run, trusted=True)
    for ev in samples():
        rec.record(ev)
    rec.close()
    return run


def test_a_recording_of_run_lists_reads_back_equal(store_url: str) -> None:
    with open_store(store_url) as store:
        run = recorded_samples(store)
        got = list(store.events(run))
        assert got == samples() and all(type(ev.blocks if hasattr(ev, "blocks") else ())
                                        is tuple for ev in got)


def test_downgrade_to_0005_rewrites_descending_runs(store_url: str) -> None:
    with open_store(store_url) as store:
        run = recorded_samples(store)
        downgrade(store.engine, "0005")
        assert current_revision(store.engine) == "0005"
        with store.engine.connect() as conn:
            lists = [bytes(v) for (v,) in conn.execute(
                events_table.select().with_only_columns(events_table.c.lists))
                if v is not None]
        assert len(lists) == 4 and not any(5 in _kinds(v) for v in lists)
        assert list(store.events(run)) == samples()
        upgrade(store.engine)
        assert model_drift(store.engine) == [] and list(store.events(run)) == samples()


def test_a_store_written_by_main_s_simulator_opens_and_holds_what_this_tree_simulates(
        tmp_path: Path) -> None:
    path = tmp_path / "main.db"
    shutil.copyfile(DATA / "store_rev0004_sim.sqlite", path)
    url = f"sqlite:///{path}"
    wanted = {}
    for point in points():
        events: list[Event] = []
        simulate(point, events.append, drain=False)
        assert any(type(ev) is BlocksReserved and type(ev.blocks) is RunBlocks
                   for ev in events)  # packed per run here, from their ids by main
        wanted[point.label] = events
    for read_only in (True, False):  # as found (0004), then upgraded by a writer
        with open_store(url, read_only=read_only) as store:
            assert current_revision(store.engine) == ("0004" if read_only else "0006")
            found = {r.scenario: list(store.events(r.id)) for r in store.runs()}
            # the same, once what this tree folds into fewer events is unfolded
            assert found == {k: list(expand(v)) for k, v in wanted.items()}
            assert all(len(wanted[k]) < len(v) for k, v in found.items())
            for events in found.values():
                assert replay(events).violations == []


@pytest.mark.parametrize("kind", [2, 5])
def test_a_damaged_run_piece_is_refused_with_its_field(kind: int) -> None:
    from kvplane.store.encoding import unpack_lists

    row = encode_trusted_one(samples()[0 if kind == 2 else 1])
    assert row.lists is not None
    broken = row.lists[:-8] + (0).to_bytes(4, "little") * 2  # a run of length 0
    with pytest.raises(ValueError, match="blocks"):
        unpack_lists(broken)
