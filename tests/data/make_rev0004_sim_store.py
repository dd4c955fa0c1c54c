"""Writes `store_rev0004_sim.sqlite`: the simulator's own recording as kvplane wrote it before
revision 0005 (main at 8dca3ec: block lists packed from their ids, no descending runs), for
`tests/store/test_store_runs.py`.

Run it with the old kvplane importable, exported the way `benchmarks/sim_speed.py
--baseline` does it:

    python -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; \
        import sim_speed; print(sim_speed.export('8dca3ec', Path('/tmp/old')))"
    PYTHONPATH=/tmp/old/pkg python tests/data/make_rev0004_sim_store.py \
        tests/data/store_rev0004_sim.sqlite

What it holds: one run per point of `POINTS` (the 16k-token 8 QPS points of
`seed_push_vs_pull`, push and pull, `REQUESTS` requests each, fresh servers), labelled by the
point, recorded as `kvplane sim run` records (a trusted `BatchingRecorder`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvplane.sim.config import Point, load_scenario
from kvplane.sim.runner import simulate
from kvplane.store import BatchingRecorder, open_store
from kvplane.store.migrate import current_revision

REQUESTS = 24


def points() -> list[Point]:
    """The points recorded (the test simulates them again with this tree's code)."""
    pp = load_scenario("seed_push_vs_pull")
    engine = pp.engine.model_copy(update={"pool_history": "none"})
    pp = pp.model_copy(update={"requests": REQUESTS, "warmup_requests": 0, "engine": engine})
    return [p for p in pp.points() if p.qps == 8 and p.input_len == 16384]


def main(out: Path) -> None:
    out.unlink(missing_ok=True)
    with open_store(f"sqlite:///{out}") as store:
        for point in points():
            run = store.create_run("sim", point.label)
            rec = BatchingRecorder(store, run, trusted=True)
            simulate(point, rec.record, drain=False)
            rec.close()
        assert current_revision(store.engine) == "0004"


if __name__ == "__main__":
    main(Path(sys.argv[1]))
