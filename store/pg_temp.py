"""A throwaway PostgreSQL server for tests and benchmarks, started from Debian's binaries.

Rules kept here:
- Never skips quietly: if `initdb`/`pg_ctl` cannot be found, or the server does not come up,
  `TemporaryPostgres.start()` raises `PostgresUnavailable` with what was tried and the
  server's log, and the caller (a pytest fixture) fails loudly.
- Binaries are looked up in `$KVPLANE_PG_BIN`, then `/usr/lib/postgresql/<newest>/bin`,
  then `$PATH`.
- PostgreSQL refuses to run as root, so when we are root every server command runs as the
  `postgres` OS user (`runuser -u postgres --`), and the data directory lives in a temporary
  directory handed to that user.
- The server listens on 127.0.0.1 at a free port, with its socket in the temporary directory
  (so it never touches a system server's socket or port), trust authentication, user
  `postgres`. `durable=False` (the default) turns fsync off: fast, and fine for data thrown
  away at the end. `stop()` shuts it down and removes the directory.

Used by `tests/conftest.py` (fixtures `postgres_server`, `postgres_url`) and by
`benchmarks/store_write.py`; `python -m kvplane.store.pg_temp` starts one, prints its URL,
and stops it on Ctrl-C (SIGINT), SIGTERM or SIGHUP, leaving no server and no directory behind
(the server is a daemon of its own, so stopping it is ours to do, on every way out).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from types import FrameType, TracebackType
from typing import Final, NoReturn, Self

from sqlalchemy.engine import URL

OS_USER: Final = "postgres"
DB_USER: Final = "postgres"


class PostgresUnavailable(RuntimeError):
    """The temporary PostgreSQL server could not be found or started."""


def find_bin_dir() -> Path:
    """The directory holding initdb and pg_ctl, or `PostgresUnavailable`."""
    tried: list[str] = []
    candidates: list[str] = []
    if os.environ.get("KVPLANE_PG_BIN"):
        candidates.append(os.environ["KVPLANE_PG_BIN"])
    debian = sorted(
        glob.glob("/usr/lib/postgresql/*/bin"),
        key=lambda p: [int(x) if x.isdigit() else 0 for x in Path(p).parent.name.split(".")],
        reverse=True,
    )
    candidates += debian
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(str(Path(on_path).parent))
    for candidate in candidates:
        tried.append(candidate)
        path = Path(candidate)
        if (path / "initdb").is_file() and (path / "pg_ctl").is_file():
            return path
    raise PostgresUnavailable(
        "PostgreSQL server binaries (initdb, pg_ctl) not found; tried "
        f"{tried or ['$KVPLANE_PG_BIN', '/usr/lib/postgresql/*/bin', '$PATH']}. "
        "Install Debian's `postgresql` package (`make system-deps`) or set KVPLANE_PG_BIN."
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TemporaryPostgres:
    """One private PostgreSQL server: `start()`, `url(db)`, `create_database()`, `stop()`."""

    def __init__(self, *, durable: bool = False) -> None:
        self.durable = durable
        self.port = 0
        self.root: Path | None = None
        self.bin_dir: Path | None = None
        self._as_root = os.geteuid() == 0

    @property
    def started(self) -> bool:
        return self.root is not None and self.port != 0

    def start(self) -> Self:
        self.bin_dir = find_bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="kvplane-pg-"))
        data, log = self.root / "data", self.root / "server.log"
        if self._as_root:
            try:
                entry = pwd.getpwnam(OS_USER)
            except KeyError:
                self._cleanup()
                raise PostgresUnavailable(
                    f"running as root, but there is no {OS_USER!r} OS user to run "
                    "PostgreSQL as (it refuses root); install Debian's postgresql package"
                ) from None
            os.chmod(self.root, 0o700)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._run(
            "initdb", "-D", str(data), "-U", DB_USER, "-A", "trust", "-E", "UTF8",
            "--locale=C", "--no-sync",
        )  # fmt: skip
        options = [
            "-c listen_addresses=127.0.0.1",
            f"-c unix_socket_directories={self.root}",
            "-c max_connections=200",
            "-c shared_buffers=128MB",
        ]
        if not self.durable:
            options += ["-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off"]
        last_error = ""
        for _attempt in range(5):  # the free port can be taken between probe and bind
            self.port = _free_port()
            try:
                self._run(
                    "pg_ctl", "-D", str(data), "-l", str(log), "-w", "-t", "60",
                    "-o", " ".join([f"-p {self.port}", *options]), "start",
                )  # fmt: skip
                return self
            except PostgresUnavailable as exc:
                last_error = str(exc)
        self.port = 0
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
        self._cleanup()
        raise PostgresUnavailable(f"PostgreSQL did not start: {last_error}\n{tail}")

    def url(self, database: str = "postgres") -> str:
        if not self.started:
            raise PostgresUnavailable("the temporary PostgreSQL server is not running")
        return URL.create(
            "postgresql+psycopg", username=DB_USER, host="127.0.0.1", port=self.port,
            database=database,
        ).render_as_string(hide_password=False)  # fmt: skip

    def create_database(self, name: str | None = None) -> str:
        """Create a fresh, empty database and return its URL."""
        import psycopg  # the postgres extra; imported here so SQLite-only users never need it

        name = name or f"t_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(
            host="127.0.0.1", port=self.port, user=DB_USER, dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    @property
    def pid(self) -> int | None:
        """The server's process id, from its data directory (None when it is not running)."""
        if self.root is None:
            return None
        try:
            return int((self.root / "data" / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        if self.root is None:
            return
        # Also when start() was interrupted after pg_ctl launched the server.
        running = self.started or (self.root / "data" / "postmaster.pid").exists()
        if running and self.bin_dir is not None:
            try:
                self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "immediate", "-w",
                          "stop")  # fmt: skip
            except PostgresUnavailable:
                pass  # best effort; the directory goes either way
        self.port = 0
        self._cleanup()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _cleanup(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def _run(self, tool: str, *args: str) -> None:
        assert self.bin_dir is not None
        command = [str(self.bin_dir / tool), *args]
        if self._as_root:
            command = ["runuser", "-u", OS_USER, "--", *command]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=120, cwd=self.root, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PostgresUnavailable(f"{' '.join(command)}: {exc}") from None
        if done.returncode != 0:
            raise PostgresUnavailable(
                f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
            )


_STOP_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, _frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def serve() -> None:
    """Run one server until a stop signal; then stop it and remove its directory."""
    for signum in _STOP_SIGNALS:
        signal.signal(signum, _interrupt)
    server = TemporaryPostgres()
    try:
        server.start()
        print(server.url(), flush=True)
        print(f"PostgreSQL pid {server.pid}, data in {server.root}; Ctrl-C or SIGTERM stops it",
              file=sys.stderr, flush=True)  # fmt: skip
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    except PostgresUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        for signum in _STOP_SIGNALS:  # a second signal must not cut the clean-up short
            signal.signal(signum, signal.SIG_IGN)
        server.stop()


if __name__ == "__main__":
    serve()
