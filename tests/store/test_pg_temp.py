"""`python -m kvplane.store.pg_temp` (a throwaway PostgreSQL for benchmarks and manual tests)
stops its server on SIGTERM or Ctrl-C and leaves nothing behind: a real server, real signals."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(180)]


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie waiting for a parent to reap it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return re.search(r"^State:\s+Z", status, re.MULTILINE) is None


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def server_on(port: int) -> tuple[int, Path]:
    """The pid and temporary directory of the postgres server listening on `port`, found from
    the process table (not from what the module prints, so that any version can be checked)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        args = [a.decode(errors="replace") for a in argv]
        if args and Path(args[0]).name in ("postgres", "postmaster") and "-D" in args and \
                f"-p {port}" in " ".join(args):  # fmt: skip
            return int(proc.name), Path(args[args.index("-D") + 1]).parent
    raise AssertionError(f"no postgres server on port {port}")


def wait_for(condition, what: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_server_is_stopped_and_removed_on_a_signal(signum: int) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "kvplane.store.pg_temp"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stderr is not None
        url = make_url(proc.stdout.readline().strip())
        assert url.port is not None
        pid, root = server_on(url.port)
        assert alive(pid) and root.is_dir()
        with psycopg.connect(host="127.0.0.1", port=url.port, user=url.username,
                             dbname=url.database) as conn:  # fmt: skip
            assert conn.execute("SELECT 1").fetchone() == (1,)
        proc.send_signal(signum)
        assert proc.wait(timeout=90) == 0
        wait_for(lambda: not alive(pid), f"server process {pid} to end")
        assert not port_open(url.port)
        assert not root.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
