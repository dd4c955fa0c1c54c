"""Writes `store_rev0003.sqlite`: a store as kvplane wrote it before revision 0004 (events naming
their run by its text id), for `tests/store/test_store_run_keys.py`.

Run it with the old kvplane importable, e.g. main at 2e4d876 exported the way
`benchmarks/sim_speed.py --baseline` does it:

    git archive 2e4d876 | tar -x -C /tmp/old   # then a `kvplane` package of its rooms
    PYTHONPATH=/tmp/old-pkg python tests/data/make_old_store.py tests/data/store_rev0003.sqlite

What it holds (the test checks each after the upgrade): three runs, the third a child of the
second; the first run's events written twice, once at revision 0002 (block lists inside the
payload JSON; `downgrade` then `upgrade` as an older kvplane left them) and once at 0003
(lists packed apart), with a 1,024-block list among them.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "store"))

from store_samples import every_type_samples

from kvplane.core.events import BlocksReserved
from kvplane.store import open_store
from kvplane.store.migrate import current_revision, downgrade, upgrade

BIG = BlocksReserved(at=9.0, instance="d0", request="r9", blocks=tuple(range(100, 1124)),
                     purpose="prefill")
RUNS = ("11111111-0000-4000-8000-000000000001", "22222222-0000-4000-8000-000000000002",
        "33333333-0000-4000-8000-000000000003")


def main(out: Path) -> None:
    out.unlink(missing_ok=True)
    samples = every_type_samples(per_type=3)
    with open_store(f"sqlite:///{out}") as store:
        # started out of id order, so the keys' order (by start) is not the ids' order
        a = store.create_run("sim", "old-a", run_id=RUNS[0], meta={"n": 1},
                             started=datetime(2026, 1, 2, tzinfo=UTC))
        p = store.create_run("sim", "old-sweep", run_id=RUNS[1],
                             started=datetime(2026, 1, 1, tzinfo=UTC))
        b = store.create_run("replay", "old-b", parent=p, run_id=RUNS[2],
                             started=datetime(2026, 1, 3, tzinfo=UTC))
        store.append(a, samples)
        downgrade(store.engine, "0002")  # these rows keep their lists in the JSON
        upgrade(store.engine)
        store.append(a, [BIG, *samples])  # packed apart
        store.append(b, samples[:10])
        assert current_revision(store.engine) == "0003"


if __name__ == "__main__":
    main(Path(sys.argv[1]))
