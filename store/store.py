"""The store: observations, policy state, model registry and tuning studies in one database.

SQLite by default (WAL, busy timeout, BEGIN IMMEDIATE so concurrent writers queue instead
of failing), any SQLAlchemy URL otherwise. Observations and the journal of policy updates are
written by a background thread in batches, so `record()` and `record_update()` only enqueue;
`flush()` and `close()` write everything.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import queue
import random
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Text, create_engine, event, func, insert, inspect, select, text, type_coerce
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DatabaseError, OperationalError

from store.schema import (
    MIGRATIONS,
    OUR_TABLES,
    SCHEMA_VERSION,
    Base,
    Meta,
    ModelRecord,
    Observation,
    PolicyCheckpoint,
    PolicyState,
    PolicyUpdate,
    Run,
)

SQLITE_MAGIC = b"SQLite format 3\x00"


class StoreError(Exception):
    """The store cannot be opened or used; the message says why and what to do."""


def default_url() -> str:
    """sqlite file in the user data directory ($AUTOTUNE_HOME or $XDG_DATA_HOME/spec-autotune)."""
    home = os.environ.get("AUTOTUNE_HOME")
    if home is None:
        base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
        home = Path(base) / "spec-autotune"
    Path(home).mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{Path(home) / 'autotune.db'}"


def _sqlite_path(url: str) -> Path | None:
    if not url.startswith("sqlite"):
        return None
    path = url.split(":///", 1)[1] if ":///" in url else ""
    path = path.split("?", 1)[0].removeprefix("file:")  # a URI filename (sqlite:///file:x.db?mode=ro&uri=true)
    return Path(path) if path and path != ":memory:" else None


def _check_sqlite_file(path: Path) -> None:
    if path.is_dir():
        raise StoreError(f"{path} is a directory, not a database file: pass a file in it, e.g."
                         f" sqlite:///{path / 'autotune.db'}")
    if path.exists() and path.stat().st_size > 0:
        with open(path, "rb") as f:
            header = f.read(16)
        if header != SQLITE_MAGIC:
            raise StoreError(f"{path} is not a SQLite database (bad header); refusing to open or overwrite it")
        # Before any connection of ours switches it to WAL: another application's file stays as it was.
        try:
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
                tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.DatabaseError:
            return  # unreadable here: opening it says why
        _refuse_foreign(str(path), tables)


# Optuna's tables: its studies live in the same database (autotune tune), and may be there first.
OPTUNA_TABLES = {"studies", "study_directions", "study_user_attributes", "study_system_attributes", "trials",
                 "trial_user_attributes", "trial_system_attributes", "trial_params", "trial_values",
                 "trial_intermediate_values", "trial_heartbeats", "version_info", "alembic_version"}


def _cannot_open(url: str, exc: DatabaseError) -> str:
    reason = str(getattr(exc, "orig", exc))
    if "readonly" in reason or "read-only" in reason:
        return (f"{url} is read-only ({reason}): the store writes a run record and its observations;"
                " give it a writable file (copy it) or directory")
    return f"cannot open store {url}: {reason}"


def _cannot_write(url: str, doing: str, exc: DatabaseError) -> str:
    reason = str(getattr(exc, "orig", exc))
    if "full" in reason.lower() or "no space left" in reason.lower():  # SQLite's SQLITE_FULL; PostgreSQL's ENOSPC
        return (f"{url}: the disk (or the database's size limit) is full ({reason}) while {doing}; nothing of it"
                " was written: free space and save again")
    return f"{url}: {doing} failed: {reason}"


def _refuse_foreign(where: str, tables: set[str]) -> None:
    """Refuse a database that holds another application's tables and none of autotune's."""
    foreign = sorted(t for t in tables - OPTUNA_TABLES if not t.startswith("sqlite_"))
    if foreign and not tables & OUR_TABLES:
        raise StoreError(f"{where} holds another application's tables ({', '.join(foreign[:5])}) and none of"
                         " autotune's: refusing to add to it; pass a database of its own")


def _is_json(value: str | None) -> bool:
    try:
        json.loads(value)
    except (TypeError, ValueError):
        return False
    return True


BUSY_TIMEOUT_S = 60.0
# SQLite's BEGIN IMMEDIATE serializes writers; on PostgreSQL, writers of the journal and of policy
# states each take a transaction-scoped advisory lock of their own. The journal's: PostgreSQL hands
# out ids when rows are inserted, not when they commit, so a reader could see id 7 before id 6
# commits and fold past 6 for good. The states': versions are read, then written one past
# (4 writers on PostgreSQL collided on a version without it).
# Creating or upgrading the schema takes a third: several processes opening a new database at once
# collided creating its tables.
JOURNAL_LOCK, STATES_LOCK, SCHEMA_LOCK = 0x6A6F75, 0x636B70, 0x736368


def _enter_wal(cursor: sqlite3.Cursor) -> None:
    """Switch the file to WAL, waiting for other processes doing the same.

    Switching needs an exclusive lock, and when several processes open a new file at once
    SQLite answers "database is locked" here at once, without calling the busy handler
    (2 in 400 concurrent opens in a probe), so we wait and retry ourselves.
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(random.uniform(0.005, 0.05))


def _configure_sqlite(engine: Engine, read_only: bool = False) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves, below
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        if not read_only:
            _enter_wal(cur)
            cur.execute("PRAGMA synchronous = NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        # take the write lock up front: no upgrade deadlock (a reader takes none)
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")


@dataclass(frozen=True)
class ArmStats:
    request_class: str
    arm: str
    count: int
    goodput_mean: float
    goodput_var: float
    acceptance_mean: float | None
    reward_mean: float | None


class Store:
    """Open (or create) the database at `url`; use as a context manager or call close()."""

    def __init__(self, url: str | None = None, label: str = "", queue_size: int = 10_000,
                 read_only: bool = False) -> None:
        self.url = url or default_url()
        self.read_only = read_only  # reads only (`autotune inspect`): a file it cannot write opens too
        path = _sqlite_path(self.url)
        if path is not None:
            _check_sqlite_file(path)
            if not read_only:
                path.parent.mkdir(parents=True, exist_ok=True)
        engine_url = f"sqlite:///file:{path}?mode=ro&uri=true" if read_only and path is not None else self.url
        try:
            self.engine = create_engine(engine_url)
        except Exception as exc:  # bad URL, missing driver
            raise StoreError(f"cannot open store {self.url!r}: {exc}") from exc
        if self.engine.dialect.name == "sqlite":
            _configure_sqlite(self.engine, read_only)
        self.run_id = uuid.uuid4().hex
        try:
            self._init_schema()
            if not read_only:
                with self.engine.begin() as conn:
                    conn.execute(insert(Run).values(id=self.run_id, started_at=time.time(), label=label))
        except (DatabaseError, OperationalError) as exc:
            raise StoreError(_cannot_open(self.url, exc)) from exc
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.dropped = 0  # observations the database refused, even alone
        self._unreported: tuple[int, BaseException] | None = None  # (dropped, last error) since `flush` told
        self._unreported_lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="autotune-store-writer", daemon=True)
        self._writer.start()
        self._closed = False

    # ----- schema -------------------------------------------------------------------------
    def _init_schema(self) -> None:
        with self.engine.begin() as conn:
            if not self.read_only:
                self._advisory_lock(conn, SCHEMA_LOCK)
            tables = set(inspect(conn).get_table_names())
            present = tables & OUR_TABLES
            _refuse_foreign(self.url, tables)
            if not present and self.read_only:
                raise StoreError(f"{self.url} holds no autotune store")
            if not present:
                Base.metadata.create_all(conn)
                conn.execute(insert(Meta).values(key="schema_version", value=str(SCHEMA_VERSION)))
                return
            if Meta.__tablename__ not in present:
                raise StoreError(f"{self.url}: autotune tables without a schema version; refusing to use it")
            stored = conn.execute(select(Meta.value).where(Meta.key == "schema_version")).scalar_one()
            try:
                version = int(stored)
            except ValueError:
                raise StoreError(f"{self.url}: schema version {stored!r} is not a number; the database was"
                                 " left untouched") from None
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.url} has schema version {version}, newer than this autotune supports"
                    f" ({SCHEMA_VERSION}); upgrade autotune. The database was left untouched."
                )
            if version < SCHEMA_VERSION and self.read_only:
                raise StoreError(f"{self.url} has schema version {version}, older than this autotune's"
                                 f" ({SCHEMA_VERSION}): open it writable once (any command but inspect) to upgrade")
            if self.read_only:
                return
            while version < SCHEMA_VERSION:
                if version not in MIGRATIONS:
                    raise StoreError(f"{self.url}: no migration from schema version {version}")
                MIGRATIONS[version](conn)
                version += 1
                conn.execute(Meta.__table__.update().where(Meta.key == "schema_version").values(value=str(version)))
            Base.metadata.create_all(conn)  # tables added without a version change

    # ----- writes -------------------------------------------------------------------------
    def _writable(self) -> None:
        if self.read_only:
            raise StoreError(f"{self.url} was opened read-only: it writes nothing")

    def record(self, **observation) -> None:
        """Queue one observation for the background writer (blocks only if the queue is full)."""
        self._enqueue(Observation, observation)

    def record_update(self, **update) -> None:
        """Queue one policy update for the journal, written in order with the observations."""
        self._enqueue(PolicyUpdate, update)

    def _enqueue(self, table, row: dict) -> None:
        self._writable()
        row.setdefault("created_at", time.time())
        row.setdefault("run_id", self.run_id)
        self._queue.put((table, row))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            batch, stop = ([] if item is None else [item]), item is None
            done = 1
            while not stop and len(batch) < 512:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                done += 1
                if item is None:
                    stop = True
                else:
                    batch.append(item)
            try:
                self._insert(batch)
            finally:
                for _ in range(done):
                    self._queue.task_done()
            if stop:
                return

    def _insert(self, batch: list[tuple]) -> None:
        """One transaction for the batch of (table, row); if the database refuses it, one per row,
        so that a row it cannot take (a value out of its column's range, a column it lacks) costs
        only itself, not the rows queued beside it, and the writer lives on to write the next ones."""
        if not batch:
            return
        try:
            with self.engine.begin() as conn:
                for table in (Observation, PolicyUpdate):
                    rows = [row for t, row in batch if t is table]
                    if rows:
                        self._lock_journal(conn, table)
                        conn.execute(insert(table), rows)
        except Exception:  # some row it cannot take: write the others
            for table, row in batch:
                try:
                    with self.engine.begin() as conn:
                        self._lock_journal(conn, table)
                        conn.execute(insert(table), [row])
                except Exception as exc:
                    with self._unreported_lock:
                        self.dropped += 1
                        self._unreported = ((self._unreported[0] if self._unreported else 0) + 1, exc)

    @contextlib.contextmanager
    def _writing(self, doing: str):
        """A database error while `doing` becomes a StoreError that names it (a full disk, say)."""
        try:
            yield
        except (DatabaseError, OperationalError) as exc:
            raise StoreError(_cannot_write(self.url, doing, exc)) from exc

    def _lock_journal(self, conn, table) -> None:
        if table is PolicyUpdate:
            self._advisory_lock(conn, JOURNAL_LOCK)

    def _advisory_lock(self, conn, key: int) -> None:
        if self.engine.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})

    def flush(self) -> None:
        """Block until every recorded observation is written; raise once for the observations
        the database refused since the last time this told of them."""
        self._queue.join()
        self._report()

    def _report(self) -> None:
        with self._unreported_lock:
            unreported, self._unreported = self._unreported, None
        if unreported is not None:
            count, exc = unreported
            raise StoreError(f"{count} observation(s) could not be written and were dropped; the last"
                             f" error: {exc}") from exc

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join()
        self.engine.dispose()
        self._report()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----- policy state --------------------------------------------------------------------
    def save_policy_state(self, policy: str, request_class: str, state: dict, keep: int = 200) -> int:
        """Append a new version of a policy's state for a class (keeping the newest `keep`)."""
        return self.save_policy_states({policy: {request_class: state}}, keep)[policy][request_class]

    def save_policy_states(self, states: dict[str, dict[str, dict]], keep: int = 200) -> dict[str, dict[str, int]]:
        """`save_policy_state` for {policy: {class: state}}, in one transaction: a reader (a
        restarted controller) sees all of a save or none of it, and one transaction per class
        would hold the controller's policy lock for each. Returns the version saved, {policy: {class: version}}."""
        self._writable()
        with self._writing("saving policy states"), self.engine.begin() as conn:
            self._advisory_lock(conn, STATES_LOCK)
            return self._save_states(conn, states, keep)

    @staticmethod
    def _save_states(conn, states: dict[str, dict[str, dict]], keep: int) -> dict[str, dict[str, int]]:
        saved: dict[str, dict[str, int]] = {}
        for policy, by_class in states.items():
            if not by_class:
                continue
            last = dict(conn.execute(
                select(PolicyState.request_class, func.max(PolicyState.version))
                .where(PolicyState.policy == policy, PolicyState.request_class.in_(list(by_class)))
                .group_by(PolicyState.request_class)
            ).all())
            versions = saved[policy] = {key: last.get(key, 0) + 1 for key in by_class}
            now = time.time()
            conn.execute(insert(PolicyState), [
                {"policy": policy, "request_class": key, "version": versions[key], "saved_at": now, "state": state}
                for key, state in by_class.items()])
            for key, version in versions.items():
                conn.execute(PolicyState.__table__.delete().where(
                    PolicyState.policy == policy, PolicyState.request_class == key,
                    PolicyState.version <= version - keep,
                ))
        return saved

    def load_policy_states(self, policy: str) -> dict[str, dict]:
        """Newest saved state of `policy` for every class: {class: state}."""
        with self._reading_states(policy), self.engine.connect() as conn:
            return self._newest_states(conn, policy)

    @staticmethod
    def _newest_states(conn, policy: str) -> dict[str, dict]:
        newest = (
            select(PolicyState.request_class, func.max(PolicyState.version).label("v"))
            .where(PolicyState.policy == policy)
            .group_by(PolicyState.request_class)
            .subquery()
        )
        query = select(PolicyState.request_class, PolicyState.state).join(
            newest,
            (PolicyState.request_class == newest.c.request_class) & (PolicyState.version == newest.c.v),
        ).where(PolicyState.policy == policy)
        return {row.request_class: row.state for row in conn.execute(query)}

    @contextlib.contextmanager
    def _reading_states(self, policy: str):
        """A state that is not JSON (edited or damaged by hand) becomes a StoreError naming its keys."""
        try:
            yield
        except ValueError as exc:
            raw = select(PolicyState.request_class, type_coerce(PolicyState.state, Text).label("text")).where(
                PolicyState.policy == policy)
            with self.engine.connect() as conn:
                bad = sorted({row.request_class for row in conn.execute(raw) if not _is_json(row.text)})
            raise StoreError(f"{self.url}: the saved state of policy {policy!r} for {', '.join(bad[:5])} is not"
                             f" valid JSON ({exc}); delete those rows to start them afresh") from exc

    # ----- the journal of policy updates and its checkpoints ---------------------------------
    def policy_updates(self, policy: str, after: int = 0) -> list[dict]:
        """Journaled updates of `policy` with id > `after`, oldest first."""
        query = select(*PolicyUpdate.__table__.c).where(PolicyUpdate.policy == policy, PolicyUpdate.id > after)
        query = query.order_by(PolicyUpdate.id)
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(query)]

    def load_checkpoint(self, policy: str) -> tuple[dict[str, dict], int]:
        """The newest saved state of `policy` per key and the journal id it reaches (0: none, or
        states saved before the journal: resumed as they are, the journal folded on top)."""
        with self._reading_states(policy), self.engine.connect() as conn:
            # Both reads in one transaction that no checkpoint commits into (SQLite: BEGIN IMMEDIATE
            # or a WAL snapshot; PostgreSQL: the writers' lock): states newer than the `through`
            # read beside them would have their updates folded twice.
            self._advisory_lock(conn, STATES_LOCK)
            through = conn.execute(select(PolicyCheckpoint.through).where(PolicyCheckpoint.policy == policy)).scalar()
            return self._newest_states(conn, policy), through or 0

    def save_checkpoint(self, policy: str, states: dict[str, dict], through: int, keep: int = 200) -> bool:
        """Save `states` (the keys that changed) as the fold of the journal through id `through`,
        in one transaction, unless a checkpoint reaching as far or further was saved meanwhile
        (by another controller): then nothing is written and this returns False. Checkpoints
        only move forward, so a resume never folds an update twice."""
        self._writable()
        with self._writing("saving a checkpoint"), self.engine.begin() as conn:
            self._advisory_lock(conn, STATES_LOCK)
            saved = conn.execute(select(PolicyCheckpoint.through).where(PolicyCheckpoint.policy == policy)).scalar()
            if saved is not None and saved >= through:
                return False
            self._save_states(conn, {policy: states}, keep)
            values = {"through": through, "saved_at": time.time()}
            if saved is None:
                conn.execute(insert(PolicyCheckpoint).values(policy=policy, **values))
            else:
                conn.execute(PolicyCheckpoint.__table__.update()
                             .where(PolicyCheckpoint.policy == policy).values(**values))
        return True

    def policy_history(self, policy: str | None = None, keys: list[str] | None = None) -> list[dict]:
        """Every saved version, oldest first; of one policy, and of some of its keys."""
        query = select(*PolicyState.__table__.c).order_by(PolicyState.saved_at)
        if policy is not None:
            query = query.where(PolicyState.policy == policy)
        if keys is not None:
            query = query.where(PolicyState.request_class.in_(keys))
        with self.engine.connect() as conn:
            return [dict(row._mapping) for row in conn.execute(query)]

    # ----- registry ------------------------------------------------------------------------
    def register_model(self, name: str, role: str, content_hash: str, path: str = "", params: int = 0,
                       size_bytes: int = 0) -> None:
        self._writable()
        with self._writing("registering a model"), self.engine.begin() as conn:
            exists = conn.execute(
                select(ModelRecord.id).where(ModelRecord.name == name, ModelRecord.content_hash == content_hash)
            ).first()
            if exists is None:
                conn.execute(insert(ModelRecord).values(
                    name=name, role=role, path=path, content_hash=content_hash, params=params, size_bytes=size_bytes
                ))

    def models(self) -> list[dict]:
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(select(*ModelRecord.__table__.c))]

    # ----- queries -------------------------------------------------------------------------
    def _window(self, query, request_class: str | None, since: float | None, last: int | None):
        if request_class is not None:
            query = query.where(Observation.request_class == request_class)
        if since is not None:
            query = query.where(Observation.created_at >= since)
        if last is not None:
            newest = select(Observation.id).order_by(Observation.id.desc()).limit(last)
            if request_class is not None:
                newest = newest.where(Observation.request_class == request_class)
            query = query.where(Observation.id.in_(newest.scalar_subquery()))
        return query

    def observations(self, request_class: str | None = None, since: float | None = None,
                     last: int | None = None) -> list[dict]:
        query = self._window(select(*Observation.__table__.c), request_class, since, last).order_by(Observation.id)
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(query)]

    def count(self) -> int:
        with self.engine.connect() as conn:
            return conn.execute(select(func.count(Observation.id))).scalar_one()

    def arm_stats(self, request_class: str | None = None, since: float | None = None,
                  last: int | None = None) -> list[ArmStats]:
        """Per class and arm: count, mean and variance of goodput, mean acceptance and reward."""
        g = Observation.goodput
        query = select(
            Observation.request_class, Observation.arm, func.count(), func.avg(g), func.avg(g * g),
            func.avg(Observation.acceptance), func.avg(Observation.reward),
        ).group_by(Observation.request_class, Observation.arm).order_by(Observation.request_class, Observation.arm)
        with self.engine.connect() as conn:
            rows = conn.execute(self._window(query, request_class, since, last)).all()
        return [
            ArmStats(c, a, n, mean, max(0.0, sq - mean * mean) * n / (n - 1) if n > 1 else 0.0, acc, rew)
            for c, a, n, mean, sq, acc, rew in rows
        ]

    def export_csv(self, path: str | Path, **window) -> int:
        rows = self.observations(**window)
        columns = [c.name for c in Observation.__table__.c]
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
        return len(rows)

    def to_pandas(self, **window):
        try:
            import pandas as pd
        except ImportError as exc:
            raise StoreError("to_pandas needs pandas: pip install pandas") from exc
        return pd.DataFrame(self.observations(**window))

    def integrity_check(self) -> str:
        if self.engine.dialect.name != "sqlite":
            return "ok"
        with self.engine.connect() as conn:
            return conn.execute(text("PRAGMA integrity_check")).scalar_one()
