"""What `kvplane runs` and `kvplane replay` say about a store that is missing, damaged, foreign
or newer, a run that cannot be read, or a file it cannot write: one line on stderr, a
non-zero exit, no traceback (unless `--debug` or KVPLANE_DEBUG=1), and never a store created
by a read.

Most cases call the CLI's own `main()` in this process (the path the `kvplane` script takes);
the first runs the real `kvplane` command in a subprocess.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from recorded_stores import PAIRS, execute, record

from kvplane.cli import main
from kvplane.core.events import SCHEMA_VERSION

Kvplane = Callable[..., tuple[int, str, str]]


@pytest.fixture
def kvplane(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Kvplane:
    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", ["kvplane", *args])
        with pytest.raises(SystemExit) as exited:
            main()
        out, err = capsys.readouterr()
        code = exited.value.code
        return (code if isinstance(code, int) else 1), out, err

    return run


def one_line(err: str) -> str:
    assert "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err[len("error: ") : -1]


def test_runs_on_a_typo_creates_nothing_and_says_so(tmp_path: Path) -> None:
    def kvplane(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvplane", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, check=False,
                              env={**os.environ, "KVPLANE_DEBUG": ""})  # fmt: skip

    done = kvplane("runs", "--db", "typo.db")
    assert (done.returncode, done.stdout, done.stderr) == (2, "", "error: no store at typo.db\n")
    debug = kvplane("--debug", "runs", "--db", "typo.db")
    assert debug.returncode == 2
    assert debug.stderr.startswith("Traceback (most recent call last):")
    assert "StoreMissing" in debug.stderr
    assert debug.stderr.endswith("error: no store at typo.db\n")
    assert list(tmp_path.iterdir()) == []


def test_kvplane_debug_in_the_environment_shows_the_traceback(
    kvplane: Kvplane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = str(tmp_path / "typo.db")
    monkeypatch.setenv("KVPLANE_DEBUG", "1")
    code, _out, err = kvplane("replay", "latest", "--db", db)
    assert code == 2 and err.startswith("Traceback") and err.endswith(f"no store at {db}\n")
    monkeypatch.setenv("KVPLANE_DEBUG", "0")
    code, _out, err = kvplane("replay", "latest", "--db", db)
    assert code == 2 and one_line(err) == f"no store at {db}"
    assert list(tmp_path.iterdir()) == []


def damaged(kind: str, tmp_path: Path) -> tuple[str, str]:
    """A store damaged in one way, and the message the CLI must print for it."""
    path = tmp_path / f"{kind}.db"
    if kind == "random":
        path.write_bytes(os.urandom(20000))
        return str(path), f"{path} is not a SQLite database (it does not start with SQLite's header)"
    if kind == "truncated":
        record(str(path))
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        return str(path), f"{path} is truncated: its header promises"
    if kind == "foreign":
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY, jpeg BLOB)")
        return str(path), f"{path} is not a kvplane store (no schema_meta table; it holds photos)"
    if kind == "newer":
        record(str(path))
        execute(str(path), "UPDATE schema_meta SET version_num = 'ff00_next'")
        return str(path), ("this store was written by a newer kvplane (revision ff00_next); "
                           "upgrade kvplane")  # fmt: skip
    assert kind == "missing"
    return str(path), f"no store at {path}"


@pytest.mark.parametrize("kind", ["missing", "random", "truncated", "foreign", "newer"])
@pytest.mark.parametrize("command", [["runs"], ["replay", "latest"]], ids=["runs", "replay"])
def test_a_bad_store_is_one_clear_line(
    kvplane: Kvplane, tmp_path: Path, kind: str, command: list[str]
) -> None:
    db, message = damaged(kind, tmp_path)
    before = Path(db).read_bytes() if Path(db).exists() else None
    code, out, err = kvplane(*command, "--db", db)
    assert code == 2 and out == ""
    assert one_line(err).startswith(message)
    assert (Path(db).read_bytes() if Path(db).exists() else None) == before


def test_replay_reads_a_good_store_without_writing_to_it(kvplane: Kvplane, tmp_path: Path) -> None:
    db = str(tmp_path / "good.db")
    run = record(db)
    before = Path(db).read_bytes()
    code, out, err = kvplane("replay", run, "--db", db)
    assert (code, err) == (0, "")
    assert f"{run} read-only: {2 * PAIRS} events, 0 transfers, 0 live leases: ok" in out
    code, out, err = kvplane("runs", "--db", db)
    assert code == 0 and run[:8] in out  # the table shows short ids
    assert Path(db).read_bytes() == before


def test_a_file_it_cannot_write_is_one_clear_line(kvplane: Kvplane, tmp_path: Path) -> None:
    db = str(tmp_path / "good.db")
    run = record(db)
    # a missing folder is refused before anything is read (the option's own check)
    target = tmp_path / "no-such-folder" / "run.csv"
    code, _out, err = kvplane("export", run, "--db", db, "--out", str(target))
    assert code == 2 and "Traceback" not in err
    said = re.sub(r"[\s│]+", "", err)  # the message as the error box wraps it, unwrapped
    assert re.sub(r"\s+", "", f"the folder {target.parent} does not exist") in said
    assert not target.parent.exists()
    # a folder that exists but takes no files (/proc): the write fails, said in one line
    code, _out, err = kvplane("export", run, "--db", db, "--out", "/proc/run.csv")
    assert code == 2 and one_line(err).startswith("/proc/run.csv: ")


def test_replay_refuses_a_run_from_a_newer_event_schema(
    kvplane: Kvplane, tmp_path: Path
) -> None:
    db = str(tmp_path / "s.db")
    run = record(db)
    execute(db, "UPDATE runs SET schema_version = :v", v=SCHEMA_VERSION + 1)
    code, out, err = kvplane("replay", run, "--db", db)
    assert code == 2 and "ok" not in out
    assert one_line(err) == (f"run {run} was recorded with event schema version "
                             f"{SCHEMA_VERSION + 1}, newer than this kvplane's {SCHEMA_VERSION}; "
                             "upgrade kvplane to read it")  # fmt: skip


def test_replay_names_an_unreadable_event(kvplane: Kvplane, tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    run = record(db)
    execute(db, "UPDATE events SET payload = 'not json' WHERE seq = 11")
    code, _out, err = kvplane("replay", run, "--db", db)
    assert code == 2
    assert one_line(err).startswith(
        f"run {run}, event seq 11 (BlocksFreed): its payload is not JSON (Expecting value")


def test_replay_reports_a_sequence_gap_as_a_violation(kvplane: Kvplane, tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    run = record(db)
    # the reserve and free of one request go together, so the replay itself stays clean
    execute(db, "DELETE FROM events WHERE seq BETWEEN 4 AND 7")
    code, out, err = kvplane("replay", run, "--db", db)
    assert (code, err) == (1, "")
    assert f"{run} read-only: {2 * PAIRS - 4} events, 0 transfers, 0 live leases: " \
           "1 violation(s)" in out
    assert "    sequence-gap: events 4..7 missing\n" in out
    assert "1 run(s) violate an invariant" in out


def test_a_writing_command_on_a_newer_store_is_one_clear_line(
    kvplane: Kvplane, tmp_path: Path
) -> None:
    db, message = damaged("newer", tmp_path)
    code, out, err = kvplane("twin", "latest", "--db", db)
    assert code == 2 and out == "" and one_line(err) == message


def test_an_older_store_is_read_as_it_is_and_kvplane_upgrade_migrates_it(
    kvplane: Kvplane, tmp_path: Path
) -> None:
    from kvplane.store import current_revision, head_revision, make_engine, open_store
    from kvplane.store.migrate import downgrade

    db = tmp_path / "old.db"
    url = f"sqlite:///{db}"
    with open_store(url) as store:
        store.create_run("sim", "kept")
        downgrade(store.engine, "0001")  # as a kvplane before revision 0002 left it
    before = db.read_bytes()
    code, out, err = kvplane("runs", "--db", url)
    assert code == 0 and "kept" in out
    assert "revision 0001" in err and f"kvplane upgrade --db {db}" in err
    assert db.read_bytes() == before  # a read never migrates
    code, out, _ = kvplane("upgrade", "--db", url)
    assert code == 0 and f"0001 -> {head_revision()}" in out
    engine = make_engine(url)
    assert current_revision(engine) == head_revision()
    engine.dispose()
    code, out, err = kvplane("runs", "--db", url)
    assert code == 0 and "kept" in out and "upgrade" not in err
    code, out, _ = kvplane("upgrade", "--db", url)
    assert code == 0 and "already" in out


def test_a_writer_that_migrates_an_older_store_says_so_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvplane.store import head_revision, open_store
    from kvplane.store.migrate import downgrade

    url = f"sqlite:///{tmp_path / 'old.db'}"
    with open_store(url) as store:
        store.create_run("sim", "kept")
        downgrade(store.engine, "0001")
    capsys.readouterr()
    with open_store(url) as store:  # a writer: migrates, and says so on stderr
        assert [r.scenario for r in store.runs()] == ["kept"]
    err = capsys.readouterr().err
    assert f"from revision 0001 to {head_revision()}" in err
    with open_store(url):  # already at the head: nothing to say
        pass
    assert capsys.readouterr().err == ""
