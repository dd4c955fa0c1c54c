"""`kvplane runs`, `show`, `compare`, `export`: results you can take away; `upgrade`;
`rollup` (the dashboard's per-run rollups).

`register(app)` adds them to the main app. The figures come from kvplane/results.py (plain
SQL and the standard library); Parquet needs pyarrow (the dashboard extra brings it).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from kvplane.cli_paths import writable_file

DbOpt = Annotated[
    Optional[str],  # noqa: UP045 (typer needs Optional on 3.11)
    typer.Option("--db", help="Event store URL (sqlite:///file.db or postgresql+psycopg://...)."),
]
RunArg = Annotated[str, typer.Argument(help="Run id, a unique prefix of one (as `kvplane runs` "
                                       "shows), or `latest`.")]


def _fail(msg: str, code: int = 2) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def runs(db: DbOpt = None,
         as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead.")] = False,
         ) -> None:
    """List the runs in the event store, newest first, with requests and TTFT/TPOT p50/p90."""
    from kvplane.results import format_runs_table, json_safe, runs_table_rows
    from kvplane.store import open_store

    with open_store(db, read_only=True) as store:
        rows = runs_table_rows(store)
        if as_json:
            typer.echo(json.dumps(json_safe([{**r, "started": str(r["started"])}
                                             for r in rows]), indent=2, allow_nan=False))
            return
        if not rows:
            typer.echo(f"no runs in {store.url}")
            return
        typer.echo(format_runs_table(rows))
        if store.upgrade_note:
            typer.secho(f"note: {store.upgrade_note}", fg=typer.colors.YELLOW, err=True)


def upgrade(db: DbOpt = None) -> None:
    """Migrate the event store to this kvplane's schema revision (creating it if missing).

    Reading commands and the dashboard read an older store as it is, correctly but slower
    (revision 0002 adds block counts beside the events and a covering index; 0003 packs new
    events' block lists apart from their JSON, leaving stored rows as they are; 0004 names
    each event's run by an integer key, rewriting the events once; 0005 adds the table of
    per-run rollups, empty: `kvplane rollup` fills it); every writing command migrates it
    anyway. This does only that, once, and says what it did."""
    import time

    from kvplane.store import current_revision, head_revision, make_engine, open_store

    engine = make_engine(db, read_only=True)
    try:
        before = current_revision(engine)
    except Exception:  # noqa: BLE001 - a missing or damaged store: open_store says what
        before = None
    finally:
        engine.dispose()
    t = time.perf_counter()
    with open_store(db) as store:
        where = store.url
    head = head_revision()
    if before == head:
        typer.echo(f"{where} is at revision {head} already")
    else:
        typer.echo(f"{where}: revision {before or '(new)'} -> {head} in "
                   f"{time.perf_counter() - t:.1f} s")


def show(run: RunArg, db: DbOpt = None,
         as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead.")] = False,
         ) -> None:
    """One run: size, offered rate, routing, TTFT/TPOT/E2E mean and percentiles, child runs."""
    from kvplane.results import RunRefError, format_summary, resolve_run, summarize_run
    from kvplane.store import open_store

    with open_store(db, read_only=True) as store:
        try:
            info = resolve_run(store, run)
        except RunRefError as exc:
            _fail(str(exc))
            return
        s = summarize_run(store, info)
    if as_json:
        typer.echo(json.dumps(s.as_dict(), indent=2, allow_nan=False))
    else:
        typer.echo(format_summary(s))


def compare(a: RunArg, b: RunArg, db: DbOpt = None,
            as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead.")] = False,
            ) -> None:
    """Two runs side by side (B against A), saying what differs besides the results."""
    from kvplane.results import (
        RunRefError,
        differences,
        format_compare,
        resolve_run,
        summarize_run,
    )
    from kvplane.store import open_store

    with open_store(db, read_only=True) as store:
        try:
            ra, rb = resolve_run(store, a), resolve_run(store, b)
        except RunRefError as exc:
            _fail(str(exc))
            return
        sa, sb = summarize_run(store, ra), summarize_run(store, rb)
    if as_json:
        typer.echo(json.dumps({"a": sa.as_dict(), "b": sb.as_dict(),
                               "differences": differences(sa, sb)}, indent=2, allow_nan=False))
    else:
        typer.echo(format_compare(sa, sb))


def export(
    run: RunArg,
    db: DbOpt = None,
    fmt: Annotated[str, typer.Option("--format", help="csv, parquet or json.")] = "csv",
    out: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        "--out", "-o", callback=writable_file, help="File to write (default: <run "
        "prefix>.<format>; `-`: stdout, csv and json only).")] = None,
) -> None:
    """Write one row per request (a sweep: of every point, with a `run` column): arrival,
    tokens, conversation and turn, routing, TTFT, TPOT, E2E (seconds), ok."""
    from kvplane.results import REQUEST_COLUMNS, RunRefError, json_safe, request_rows, resolve_run
    from kvplane.store import open_store

    if fmt not in ("csv", "parquet", "json"):
        _fail(f"--format must be csv, parquet or json, not {fmt!r}")
    with open_store(db, read_only=True) as store:
        try:
            info = resolve_run(store, run)
        except RunRefError as exc:
            _fail(str(exc))
            return
        targets = [info] + sorted((r for r in store.runs() if r.parent == info.id),
                                  key=lambda r: r.scenario)
        rows: list[dict[str, Any]] = []
        for t in targets:
            rows += [{"run": t.id, "point": t.scenario, **r}
                     for r in request_rows(store.engine, t.id)]
    columns = ["run", "point", *REQUEST_COLUMNS]
    target = out if out is not None else Path(f"{info.id[:8]}.{fmt}")
    if fmt == "parquet":
        if str(target) == "-":
            _fail("parquet cannot go to stdout: give --out FILE")
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            _fail("parquet needs pyarrow: pip install -e '.[dashboard]' (or pip install pyarrow)")
        table = pa.Table.from_pylist(rows, schema=_schema(pa)) if rows else \
            pa.Table.from_pylist([], schema=_schema(pa))
        pq.write_table(table, str(target))
    elif fmt == "json":
        text = json.dumps(json_safe(rows), indent=1, allow_nan=False)
        if str(target) == "-":
            sys.stdout.write(text + "\n")
        else:
            target.write_text(text + "\n")
    else:
        fh = sys.stdout if str(target) == "-" else open(target, "w", newline="")  # noqa: SIM115
        try:
            w = csv.DictWriter(fh, fieldnames=columns)
            w.writeheader()
            w.writerows(json_safe(rows))
        finally:
            if fh is not sys.stdout:
                fh.close()
    if str(target) != "-":
        typer.echo(f"{len(rows)} requests of {len(targets)} run(s) written to {target}",
                   err=True)


def _schema(pa: Any) -> Any:
    s, i, f, b = pa.string(), pa.int64(), pa.float64(), pa.bool_()
    return pa.schema([("run", s), ("point", s), ("request", s), ("arrived", f),
                      ("prompt_tokens", i), ("output_tokens", i), ("conversation", s),
                      ("turn", i), ("mode", s), ("bidirectional", b), ("prefill", s),
                      ("decode", s), ("ttft", f), ("tpot", f), ("e2e", f), ("ok", b)])


def rollup(
    refs: Annotated[Optional[list[str]], typer.Argument(  # noqa: UP045
        help="Runs (ids, unique prefixes or `latest`); default: every run with events whose "
             "rollup is missing or older than its events.", show_default=False)] = None,
    db: DbOpt = None,
) -> None:
    """Write the dashboard's rollup of runs: what its pages show of a whole run, computed once
    from the events, so a long run's pages open without reading them again.

    `kvplane sim run` writes one for each point it records; this is for runs recorded
    otherwise (live runs, imports) or before (a store from before revision 0005 is migrated
    first). A run recorded on after its rollup is read from its events until rolled up again.
    Needs the dashboard extra (pandas)."""
    import time

    try:
        from kvplane.dashboard import rollup as rollups
    except ImportError as exc:
        _fail(f"kvplane rollup needs the dashboard extra (pip install 'kvplane[dashboard]'): "
              f"{exc}")
        return
    from kvplane.results import RunRefError, resolve_run
    from kvplane.store import open_store

    with open_store(db) as store:
        if refs:
            try:
                ids = [resolve_run(store, r).id for r in refs]
            except RunRefError as exc:
                _fail(str(exc))
                return
        else:
            counts = {r.id: store.count(r.id) for r in store.runs()}
            have = store.rollups(list(counts), "heads")
            ids = [i for i, n in counts.items() if n and i not in have]
        if not ids:
            typer.echo(f"every run with events in {store.url} has a current rollup")
        for run_id in ids:
            t = time.perf_counter()
            events = rollups.write(store, run_id)
            typer.echo(f"rolled up run {run_id} ({events:,} events) in "
                       f"{time.perf_counter() - t:.1f} s")


def register(app: typer.Typer) -> None:
    app.command("runs")(runs)
    app.command("show")(show)
    app.command("compare")(compare)
    app.command("export")(export)
    app.command("upgrade")(upgrade)
    app.command("rollup")(rollup)
