"""Run as a subprocess by test_store_recorders.py: records events for ever, until killed.

argv: store URL, run id, batch size. Event i has `at = i`, so a reader can tell exactly which
events made it. Prints "started" once the first batch is committed.
"""

from __future__ import annotations

import sys

from kvplane.core.events import BlocksReserved
from kvplane.store import BatchingRecorder, open_store


def main() -> None:
    url, run_id, batch_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = open_store(url)
    # A flush interval far beyond the test: only full batches are ever written.
    recorder = BatchingRecorder(store, run_id, batch_size=batch_size, flush_interval=3600)
    blocks = tuple(range(64))
    announced = False
    i = 0
    while True:
        recorder.record(
            BlocksReserved(at=float(i), instance="p0", request=f"r{i}", blocks=blocks,
                           purpose="prefill")
        )  # fmt: skip
        i += 1
        if not announced and recorder.written > 0:
            print("started", flush=True)
            announced = True


if __name__ == "__main__":
    main()
