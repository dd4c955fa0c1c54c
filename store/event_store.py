"""The event store: runs, and the events of each run in order.

Rules kept here:
- `open_store(url)` resolves the URL (see `engine.py`), migrates the database to the newest
  schema and returns an `EventStore`; opening the same database twice changes nothing.
- `open_store(url, read_only=True)` is for commands that only read: it creates nothing,
  migrates nothing and writes nothing (a store at an older schema revision is read as it is,
  correctly but slower; `upgrade_note` says how to migrate it) (a write raises `StoreReadOnly`), and a store that is
  missing, damaged, another application's or from a newer kvplane is refused on open with an
  error saying so (`diagnose.py`); a store damaged further in is reported the same way when a
  read reaches the damage.
- A run is created once, with a kind (sim, live, replay, import), a scenario, an optional
  parent run and JSON `meta`; it remembers the event `SCHEMA_VERSION` it was recorded under.
- `append` checks every event of a batch first (`encoding.encode_batch`); one unfit event
  refuses the whole batch with `EventRefused` naming its index and type, before any I/O. A
  fit batch is written in one transaction, numbered on from the run's last seq (contiguous from
  0), so a reader sees whole batches or nothing of them, even if the writer dies mid-batch.
- Appends to one run are serialised (the run's row is locked on PostgreSQL; SQLite's write
  lock is taken at `BEGIN IMMEDIATE`), so two writers never hand out the same seq.
- `events` streams rows in seq order through a server-side cursor (PostgreSQL) or chunked
  fetches (SQLite) and decodes each with the core's `decode`, so a long run is never loaded
  whole. It refuses a run recorded under a newer event `SCHEMA_VERSION` (`RunTooNew`), names
  the run, seq and type of a stored event that cannot be rebuilt (`StoredEventUnreadable`),
  and, reading a whole run, notices seqs missing between two it meets (`SequenceGap`: raised,
  or handed to `on_gap` so a replay can report it and go on).
- Deleting a run deletes its events; its child runs stay, with their parent set to none.

The read side for dashboards is `EventStore.engine` plus `schema.runs_table` and
`schema.events_table`: plain SQLAlchemy Core, any aggregate query the backends can run (the
run part of it through `migrate.events_of` and friends: `events.run` is an integer key).
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self, cast

from sqlalchemy import (
    Connection,
    Engine,
    RowMapping,
    Select,
    Text,
    delete,
    func,
    insert,
    null,
    select,
    type_coerce,
    update,
)
from sqlalchemy.engine import URL

from ._core import EVENT_TYPES, SCHEMA_VERSION, Event, SchemaError, decode
from .bulk import bulk_insert
from .diagnose import check_schema, reading, require_file
from .encoding import EncodedEvent, FlatRows, encode_batch, merge_lists
from .engine import WRITE_LOCK, make_engine, resolve_url, sqlite_file
from .errors import (
    RunNotFound,
    RunTooNew,
    SequenceGap,
    StoredEventUnreadable,
    StoreMissing,
    StoreReadOnly,
    StoreUnreadable,
)
from .migrate import (
    all_types,
    by_type,
    events_of,
    fresh_rollups,
    has_packed_lists,
    has_rollups,
    head_revision,
    known_revisions,
    revision_of,
    upgrade,
    upgrade_note,
)
from .schema import RUN_KINDS, RunKind, events_table, rollups_table, runs_table

_STREAM_CHUNK: Final = 2000


@dataclass(frozen=True, slots=True)
class RunInfo:
    """One row of `runs`."""

    id: str
    kind: RunKind
    scenario: str
    started: datetime
    parent: str | None
    meta: dict[str, Any]
    schema_version: int


EventTypes = str | type[Event] | Iterable[str | type[Event]]
OnGap = Callable[[SequenceGap], None]


class EventStore:
    """Runs and their events in one database; see the module docstring for the rules."""

    def __init__(self, engine: Engine, *, read_only: bool = False,
                 revision: str | None = None) -> None:
        """Wrap an engine whose database is already migrated (`open_store` does both), or,
        read-only, at an older `revision` that is read as it is."""
        self._engine = engine
        self.revision = revision
        self._writer = engine.execution_options(**{WRITE_LOCK: True})
        self.read_only = read_only
        self._file = sqlite_file(engine.url)
        self._where = self._file if self._file is not None else self.url

    # --- the read side for aggregate SQL ---

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def upgrade_note(self) -> str | None:
        """For a store read at an older schema revision: that it is slower, how to migrate."""
        return upgrade_note(self.revision, self._where)

    @property
    def url(self) -> str:
        """The database URL, password hidden."""
        return self._engine.url.render_as_string(hide_password=True)

    # --- runs ---

    def create_run(
        self,
        kind: RunKind,
        scenario: str,
        parent: str | None = None,
        meta: Mapping[str, Any] | None = None,
        *,
        run_id: str | None = None,
        started: datetime | None = None,
    ) -> str:
        """Start a run and return its id (a fresh UUID unless `run_id` is given)."""
        self._writable()
        if kind not in RUN_KINDS:
            raise ValueError(f"run kind must be one of {RUN_KINDS}, not {kind!r}")
        meta_dict = dict(meta or {})
        try:
            json.dumps(meta_dict, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"run meta must be plain JSON: {exc}") from None
        new_id = run_id if run_id is not None else str(uuid.uuid4())
        when = started if started is not None else datetime.now(UTC)
        if when.tzinfo is None:
            raise ValueError("run start time must be timezone-aware")
        when = when.astimezone(UTC)  # SQLite keeps no offset, so store every time as UTC
        with self._writer.begin() as conn:
            if parent is not None:
                self._require_run(conn, parent)
            conn.execute(
                insert(runs_table).values(
                    id=new_id,
                    kind=kind,
                    scenario=scenario,
                    started=when,
                    parent=parent,
                    meta=meta_dict,
                    schema_version=SCHEMA_VERSION,
                )
            )
        return new_id

    def runs(self, kind: RunKind | None = None) -> list[RunInfo]:
        """Every run (of one kind, if given), oldest first."""
        stmt = _runs_select().order_by(runs_table.c.started, runs_table.c.id)
        if kind is not None:
            stmt = stmt.where(runs_table.c.kind == kind)
        with self._reading(), self._engine.connect() as conn:
            return [_run_info(row._mapping) for row in conn.execute(stmt)]

    def run(self, run_id: str) -> RunInfo:
        """One run, or `RunNotFound`."""
        with self._reading(), self._engine.connect() as conn:
            row = conn.execute(_runs_select().where(runs_table.c.id == run_id)).first()
        if row is None:
            raise RunNotFound(run_id)
        return _run_info(row._mapping)

    def delete_run(self, run_id: str) -> int:
        """Delete a run and its events (children are kept, orphaned); the events deleted."""
        self._writable()
        with self._writer.begin() as conn:
            self._require_run(conn, run_id)
            conn.execute(
                update(runs_table).where(runs_table.c.parent == run_id).values(parent=None)
            )
            deleted = conn.execute(delete(events_table).where(events_of(self._engine, run_id)))
            if has_rollups(self._engine):
                key = select(runs_table.c.key).where(runs_table.c.id == run_id).scalar_subquery()
                conn.execute(delete(rollups_table).where(rollups_table.c.run == key))
            conn.execute(delete(runs_table).where(runs_table.c.id == run_id))
        return int(deleted.rowcount)

    def put_rollup(self, run_id: str, parts: Mapping[str, Mapping[str, Any]]) -> int:
        """Keep `parts` (part name -> plain JSON: what the dashboard shows of the whole run,
        see `schema.RollupRow`) as the run's rollup, replacing all of any earlier one, stamped
        with the run's event count now (read in the same transaction); that count."""
        self._writable()
        body = {name: dict(data) for name, data in parts.items()}
        try:
            json.dumps(body, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"a rollup must be plain JSON (no NaN): {exc}") from None
        with self._writer.begin() as conn:
            found = conn.execute(select(runs_table.c.key).where(runs_table.c.id == run_id)
                                 .with_for_update(key_share=True)).first()
            if found is None:
                raise RunNotFound(run_id)
            key = found[0]
            last = conn.execute(
                select(func.max(events_table.c.seq)).where(events_table.c.run == key)
            ).scalar()
            count = 0 if last is None else int(last) + 1
            conn.execute(delete(rollups_table).where(rollups_table.c.run == key))
            now = datetime.now(UTC)
            if body:
                conn.execute(insert(rollups_table), [
                    {"run": key, "part": name, "events": count, "made": now, "data": data}
                    for name, data in body.items()])
        return count

    def rollups(self, run_ids: Iterable[str], part: str) -> dict[str, dict[str, Any]]:
        """The rollups' `part` of those of the runs that have a current one
        (`migrate.fresh_rollups`)."""
        with self._reading():
            return fresh_rollups(self._engine, run_ids, part)

    # --- events ---

    def append(self, run_id: str, events: Sequence[Event]) -> range:
        """Check, number and write one batch in one transaction; the seqs it was given."""
        return self.append_encoded(run_id, encode_batch(events))

    def append_encoded(self, run_id: str, rows: Sequence[EncodedEvent] | FlatRows) -> range:
        """`append` for rows already checked by `encoding.encode_event` (recorders use it), as
        tuples or flat (`encoding.FlatRows`)."""
        self._writable()
        with self._writer.begin() as conn:
            # Lock the run's row first, so concurrent appenders to one run queue here
            # (PostgreSQL; on SQLite BEGIN IMMEDIATE already made this the only writer). The
            # last seq is read by a second statement on purpose: under READ COMMITTED only a
            # statement begun after the lock was granted sees the other appender's rows.
            found = conn.execute(
                select(runs_table.c.key)
                .where(runs_table.c.id == run_id)
                .with_for_update(key_share=True)
            ).first()
            if found is None:
                raise RunNotFound(run_id)
            key = found[0]  # what `events.run` holds (a writer's store is at the head)
            last = conn.execute(
                select(func.max(events_table.c.seq)).where(events_table.c.run == key)
            ).scalar()
            first = 0 if last is None else int(last) + 1
            if rows:
                bulk_insert(conn, key, first, rows)
        return range(first, first + (rows.rows if isinstance(rows, FlatRows) else len(rows)))

    def events(
        self,
        run_id: str,
        types: EventTypes | None = None,
        request: str | None = None,
        *,
        on_gap: OnGap | None = None,
    ) -> Iterator[Event]:
        """The run's events in seq order, optionally only some types and/or one request.

        `RunNotFound` and `RunTooNew` are raised here, at the call; the events themselves
        stream lazily. Reading the whole run (no filter), seqs missing between two events are
        a `SequenceGap`: raised where it is met, or, given `on_gap`, handed to it and read on.
        """
        # lists packed apart (revision 0003 on; a NULL where the payload holds them)
        lists = events_table.c.lists if has_packed_lists(self._engine) else null()
        stmt = self._filtered(
            select(
                events_table.c.seq,
                events_table.c.time,
                events_table.c.type,
                events_table.c.request,
                events_table.c.instance,
                # as text: a payload that is not JSON is reported by us, naming the event
                type_coerce(events_table.c.payload, Text),
                lists,
            ),
            run_id,
            types,
            request,
        ).order_by(events_table.c.seq)
        version = self.run(run_id).schema_version
        if version > SCHEMA_VERSION:
            raise RunTooNew(run_id, version, SCHEMA_VERSION)
        whole = types is None and request is None
        return self._stream(run_id, stmt, whole=whole, on_gap=on_gap)

    def count(self, run_id: str, types: EventTypes | None = None) -> int:
        """How many events the run holds (of the given types, if any)."""
        stmt = self._filtered(select(func.count()).select_from(events_table), run_id, types)
        with self._reading(), self._engine.connect() as conn:
            self._require_run(conn, run_id)
            return int(conn.execute(stmt).scalar_one())

    # --- lifecycle ---

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EventStore({self.url!r})"

    # --- helpers ---

    def _writable(self) -> None:
        if self.read_only:
            raise StoreReadOnly(f"the store at {self._where} was opened read-only")

    def _reading(self) -> AbstractContextManager[None]:
        return reading(self._where, self._file)

    def _stream(
        self, run_id: str, stmt: Select[Any], *, whole: bool, on_gap: OnGap | None
    ) -> Iterator[Event]:
        expected = 0
        with self._reading(), self._engine.connect() as conn:
            result = conn.execution_options(yield_per=_STREAM_CHUNK).execute(stmt)
            for seq, time, type_name, request, instance, raw, lists in result:
                if whole and seq != expected:
                    gap = SequenceGap(run_id, expected, seq - 1)
                    if on_gap is None:
                        raise gap
                    on_gap(gap)
                expected = seq + 1
                yield _decode_row(run_id, seq, time, type_name, request, instance, raw, lists)

    def _filtered(
        self, stmt: Select[Any], run_id: str, types: EventTypes | None,
        request: str | None = None,
    ) -> Select[Any]:
        stmt = stmt.where(events_of(self._engine, run_id))
        if types is not None:
            stmt = stmt.where(events_table.c.type.in_(_type_names(types)))
        if request is not None:  # through the (run, type, request) index, a probe per type
            if types is None:
                stmt = stmt.where(events_table.c.type.in_(all_types()))
            stmt = by_type(stmt.where(events_table.c.request == request), self._engine)
        return stmt

    @staticmethod
    def _require_run(conn: Connection, run_id: str) -> None:
        if conn.execute(select(runs_table.c.id).where(runs_table.c.id == run_id)).first() is None:
            raise RunNotFound(run_id)


def open_store(
    url: str | URL | None = None,
    *,
    echo: bool = False,
    read_only: bool = False,
    create_missing: bool = False,
) -> EventStore:
    """Open (creating and migrating as needed) the store at `url`, `$KVPLANE_DB` or the default.

    `read_only=True`: open an existing store for reading only, creating and migrating nothing
    (an older revision is read as it is: `EventStore.upgrade_note`); `StoreMissing`,
    `StoreUnreadable`, `NotAStore` or `StoreTooNew` say what is wrong otherwise. `create_missing=True` with it: a missing store is first created empty
    (for a reader that fills it through a writer of its own, such as the dashboard's what-if).
    """
    resolved = resolve_url(url)
    file = sqlite_file(resolved)
    where = file if file is not None else resolved.render_as_string(hide_password=True)
    if read_only:
        if create_missing and (file is None or not Path(file).exists()):
            open_store(resolved).close()
        if file is not None:
            require_file(file)
        elif resolved.get_backend_name() == "sqlite":
            raise StoreMissing(where, "an in-memory database holds no store to read")
    engine = make_engine(resolved, echo=echo, read_only=read_only)
    try:
        with reading(where, file):
            if read_only:
                with engine.connect() as conn:
                    revision: str | None = check_schema(conn, where)
            else:
                _say_when_migrating(engine, where)
                upgrade(engine)
                revision = head_revision()
    except BaseException:
        engine.dispose()
        raise
    return EventStore(engine, read_only=read_only, revision=revision)


def _say_when_migrating(engine: Engine, where: str) -> None:
    """A store written by an older kvplane is migrated by the first writer that opens it:
    on a store of millions of events that takes minutes, so say so on stderr first."""
    with engine.connect() as conn:
        old = revision_of(conn)
    if old is not None and old != head_revision() and old in known_revisions():
        print(f"kvplane: upgrading the store {where} from revision {old} to "
              f"{head_revision()} (once; minutes for a store of millions of events)",
              file=sys.stderr, flush=True)


def _runs_select() -> Select[Any]:
    # meta as text: a damaged meta is reported by us, naming the run; not the internal key
    # (a store before revision 0004, read as it is, has none)
    columns = [type_coerce(c, Text).label(c.name) if c.name == "meta" else c
               for c in runs_table.c if c.name != "key"]
    return select(*columns)


def _decode_row(
    run_id: str, seq: int, time: float, type_name: str, request: str | None, instance: str,
    raw: Any, lists: bytes | None,
) -> Event:  # fmt: skip
    try:
        payload = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError as exc:
        reason = f"its payload is not JSON ({exc})"
        raise StoredEventUnreadable(run_id, seq, type_name, reason) from exc
    if lists is not None:
        if not isinstance(payload, dict):
            raise StoredEventUnreadable(run_id, seq, type_name, "payload must be an object")
        try:
            payload = merge_lists(payload, lists)
        except ValueError as exc:
            raise StoredEventUnreadable(run_id, seq, type_name, str(exc)) from exc
    try:
        return decode(type_name, payload, at=time, instance=instance, request=request)
    except SchemaError as exc:
        raise StoredEventUnreadable(run_id, seq, type_name, str(exc)) from exc


def _type_names(types: EventTypes) -> list[str]:
    items: Iterable[str | type[Event]] = [types] if isinstance(types, (str, type)) else types
    names = []
    for item in items:
        name = item if isinstance(item, str) else item.__name__
        if EVENT_TYPES.get(name) is None:
            raise SchemaError(f"unknown event type {name!r}")
        names.append(name)
    return names


def _run_info(row: RowMapping) -> RunInfo:
    started: datetime = row["started"]
    raw_meta = row["meta"]
    try:
        meta = json.loads(raw_meta) if isinstance(raw_meta, str) else raw_meta
    except ValueError as exc:
        raise StoreUnreadable(f"run {row['id']}: its meta is not JSON ({exc})") from None
    # SQLite hands back naive datetimes (we only ever store UTC); PostgreSQL, session time.
    started = started.replace(tzinfo=UTC) if started.tzinfo is None else started.astimezone(UTC)
    return RunInfo(
        id=row["id"],
        kind=cast(RunKind, row["kind"]),
        scenario=row["scenario"],
        started=started,
        parent=row["parent"],
        meta=meta,
        schema_version=row["schema_version"],
    )
