"""The store survives kill -9, concurrent writers, and refuses files it must not touch."""

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from store import SCHEMA_VERSION, Store, StoreError

ROOT = Path(__file__).resolve().parents[1]


def obs(i: int, request_class: str = "code", arm: str = "small:4") -> dict:
    return dict(request_class=request_class, arm=arm, prompt_tokens=i, new_tokens=32, goodput=100.0 + i % 10,
                acceptance=0.5, reward=1.1)


def run_python(code: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_kill_9_mid_stream_loses_nothing_committed(store_url):
    url = store_url
    child = run_python(f"""
        from store import Store
        s = Store({url!r})
        i = 0
        while True:
            for _ in range(50):
                s.record(request_class="code", arm="off", prompt_tokens=i, new_tokens=1, goodput=1.0)
                i += 1
            s.flush()
            print("committed", i - 1, flush=True)
    """)
    last = -1
    for line in child.stdout:
        last = int(line.split()[1])
        if last >= 2000:
            break
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert last >= 2000
    with Store(url) as s:
        assert s.integrity_check() == "ok"
        seen = {row["prompt_tokens"] for row in s.observations()}
    assert set(range(last + 1)) <= seen


def test_four_processes_write_concurrently_without_losing_rows(store_url):
    url = store_url
    children = [run_python(f"""
        from store import Store
        with Store({url!r}, label="writer{n}") as s:
            for i in range(400):
                s.record(request_class="w{n}", arm="off", prompt_tokens=i, new_tokens=1, goodput=1.0)
                if i % 100 == 0:
                    s.flush()
                    s.save_policy_state("ucb", "shared", {{"writer": {n}, "i": i}})
    """) for n in range(4)]
    for child in children:
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
    with Store(url) as s:
        stats = {st.request_class: st.count for st in s.arm_stats()}
        versions = [row["version"] for row in s.policy_history("ucb")]
    assert stats == {f"w{n}": 400 for n in range(4)}
    assert sorted(versions) == list(range(1, 17))


class FlakyCursor:
    """Answers "database is locked" to the first `locked` calls, as SQLite does when several
    processes switch a new file to WAL at once (the busy handler is not called there)."""

    def __init__(self, locked: int, error: str = "database is locked") -> None:
        self.locked, self.error, self.calls = locked, error, 0

    def execute(self, sql: str) -> None:
        self.calls += 1
        if self.calls <= self.locked:
            raise sqlite3.OperationalError(self.error)


def test_a_row_the_database_refuses_costs_only_itself_and_is_reported_once(tmp_path):
    """A NaN goodput (NOT NULL: SQLite stores NaN as NULL) used to fail its whole batch, lose the
    good rows queued beside it, and stop the writer, so that every later record raised."""
    with Store(f"sqlite:///{tmp_path / 'r.db'}") as s:
        for i in range(3):
            s.record(**obs(i))
        s.record(**{**obs(3), "goodput": float("nan")})
        for i in range(4, 6):
            s.record(**obs(i))
        with pytest.raises(StoreError, match=r"1 observation\(s\) could not be written and were dropped; the last"
                                             r" error: .*NOT NULL constraint failed: autotune_observations.goodput"):
            s.flush()
        s.record(**obs(6))
        s.flush()  # told once
        assert sorted(row["prompt_tokens"] for row in s.observations()) == [0, 1, 2, 4, 5, 6] and s.dropped == 1


def test_switching_to_wal_waits_out_a_concurrent_switch_but_not_other_errors():
    from store.store import _enter_wal

    cursor = FlakyCursor(locked=3)
    _enter_wal(cursor)
    assert cursor.calls == 4
    with pytest.raises(sqlite3.OperationalError, match="disk I/O"):
        _enter_wal(FlakyCursor(locked=1, error="disk I/O error"))


def test_policy_state_round_trip_resumes_newest_version(store_url):
    url = store_url
    with Store(url) as s:
        s.save_policy_state("thompson", "code", {"arms": {"small:4": [3, 1.5]}})
        s.save_policy_state("thompson", "code", {"arms": {"small:4": [4, 1.6]}})
        s.save_policy_state("thompson", "docs", {"arms": {}})
        for i in range(10):
            s.record(**obs(i))
    with Store(url) as s:
        assert s.load_policy_states("thompson") == {"code": {"arms": {"small:4": [4, 1.6]}}, "docs": {"arms": {}}}
        assert s.load_policy_states("ucb") == {}
        assert s.count() == 10


def test_a_save_of_several_policies_and_classes_is_one_transaction(tmp_path):
    """What a controller saves at once (its policy's classes, their OFF baselines, its costs)
    lands whole or not at all, each class a version past its last, the newest `keep` kept."""
    with Store(f"sqlite:///{tmp_path / 'p.db'}") as s:
        s.save_policy_state("ucb", "code", {"v": 1})
        assert s.save_policy_states({"ucb": {"code": {"v": 2}, "docs": {"v": 1}}, "off": {"code": {"n": 3}}},
                                    keep=1) == {"ucb": {"code": 2, "docs": 1}, "off": {"code": 1}}
        with pytest.raises(Exception, match="not JSON serializable"):  # the first policy is not saved either
            s.save_policy_states({"ucb": {"code": {"v": 3}}, "off": {"code": {"n": object()}}})
        assert s.load_policy_states("ucb") == {"code": {"v": 2}, "docs": {"v": 1}}
        assert s.load_policy_states("off") == {"code": {"n": 3}}
        with sqlite3.connect(tmp_path / "p.db") as conn:  # keep=1: ucb's first version of code is gone
            rows = conn.execute("SELECT policy, version FROM autotune_policy_states WHERE request_class = 'code'")
            assert sorted(rows.fetchall()) == [("off", 1), ("ucb", 2)]


def test_aggregates_and_windows(tmp_path):
    with Store(f"sqlite:///{tmp_path / 'a.db'}") as s:
        for i in range(10):
            s.record(**obs(i, arm="off"))
            s.record(**obs(i, request_class="docs", arm="ngram:3"))
        s.flush()
        stats = {(st.request_class, st.arm): st for st in s.arm_stats()}
        assert stats[("code", "off")].count == 10
        assert stats[("code", "off")].goodput_mean == pytest.approx(104.5)
        assert stats[("code", "off")].goodput_var == pytest.approx(9.1666666, rel=1e-5)
        assert [st.count for st in s.arm_stats(request_class="docs", last=3)] == [3]
        assert len(s.observations(last=4)) == 4
        assert s.export_csv(tmp_path / "o.csv", request_class="code") == 10


def test_refuses_a_file_that_is_not_a_database(tmp_path):
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are my notes, not a database\n" * 10)
    with pytest.raises(StoreError, match="not a SQLite database"):
        Store(f"sqlite:///{path}")
    assert path.read_bytes().startswith(b"these are my notes")


def test_refuses_a_corrupt_database(tmp_path):
    path = tmp_path / "corrupt.db"
    with Store(f"sqlite:///{path}") as s:
        for i in range(100):
            s.record(**obs(i))
    data = bytearray(path.read_bytes())
    data[100:4096] = os.urandom(4096 - 100)  # header intact, schema page destroyed
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="cannot open store"):
        Store(f"sqlite:///{path}")


def test_refuses_a_newer_schema_and_leaves_it_untouched(tmp_path):
    path = tmp_path / "future.db"
    Store(f"sqlite:///{path}").close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE autotune_meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    before = path.read_bytes()
    with pytest.raises(StoreError, match="newer than this autotune supports"):
        Store(f"sqlite:///{path}")
    assert path.read_bytes() == before


def older_store(path: Path, version: int) -> None:
    """A store as schema `version` left it, with one observation and a saved policy state:
    version 4 did not record OFF rounds among an arm's, version 3 had no journal of policy updates
    either, version 2 no finish_reason, version 1 neither queue_s nor stream_error."""
    with Store(f"sqlite:///{path}") as s:
        s.record(**obs(7))
        s.save_policy_state("ucb", "code@load1", {"pulls": 3})
    dropped = ["probe_rounds", "probe_s", *{4: [], 3: [], 2: ["finish_reason"],
                                            1: ["finish_reason", "queue_s", "stream_error"]}[version]]
    with sqlite3.connect(path) as conn:
        if version < 4:
            conn.execute("DROP TABLE autotune_policy_updates")
            conn.execute("DROP TABLE autotune_policy_checkpoints")
        for column in dropped:
            conn.execute(f"ALTER TABLE autotune_observations DROP COLUMN {column}")
        conn.execute(f"UPDATE autotune_meta SET value = '{version}' WHERE key = 'schema_version'")


def test_an_older_schema_is_migrated_in_one_transaction(tmp_path, monkeypatch):
    import store.schema

    path = tmp_path / "v1.db"
    older_store(path, 1)
    migrate = store.schema.MIGRATIONS[1]

    def crash_midway(conn):
        migrate(conn)
        raise OSError("disk gone")

    monkeypatch.setitem(store.schema.MIGRATIONS, 1, crash_midway)
    with pytest.raises(OSError, match="disk gone"):
        Store(f"sqlite:///{path}")
    with sqlite3.connect(path) as conn:  # the columns added before the crash were rolled back
        assert conn.execute("SELECT value FROM autotune_meta WHERE key = 'schema_version'").fetchone() == ("1",)
        columns = {row[1] for row in conn.execute("PRAGMA table_info(autotune_observations)")}
        assert "queue_s" not in columns and "stream_error" not in columns

    monkeypatch.setitem(store.schema.MIGRATIONS, 1, migrate)
    with Store(f"sqlite:///{path}") as s:  # 1 -> 2 -> 3 -> 4 -> 5
        s.record(**obs(8), queue_s=0.25, stream_error="client went away", finish_reason="abort")
        s.flush()
        old, new = sorted(s.observations(), key=lambda o: o["prompt_tokens"])
    assert (old["prompt_tokens"], old["queue_s"], old["stream_error"], old["finish_reason"]) == (7, 0.0, None, None)
    assert (new["queue_s"], new["stream_error"], new["finish_reason"]) == (0.25, "client went away", "abort")
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT value FROM autotune_meta WHERE key = 'schema_version'").fetchone() == ("5",)
    path = tmp_path / "v2.db"
    older_store(path, 2)
    with Store(f"sqlite:///{path}") as s:  # 2 -> 3 -> 4 -> 5
        s.record(**obs(8), finish_reason="stop")
        s.flush()
        assert [o["finish_reason"] for o in sorted(s.observations(), key=lambda o: o["id"])] == [None, "stop"]
    path = tmp_path / "v3.db"
    older_store(path, 3)
    with Store(f"sqlite:///{path}") as s:  # 3 -> 4: states saved before the journal resume as a checkpoint through 0
        assert s.load_checkpoint("ucb") == ({"code@load1": {"pulls": 3}}, 0)
        s.record_update(policy="ucb", seq=1, request_class="code", load=1, arm="off", goodput=9.0, reward=1.0)
        s.flush()
        assert [u["arm"] for u in s.policy_updates("ucb")] == ["off"]
    path = tmp_path / "v4.db"
    older_store(path, 4)
    with Store(f"sqlite:///{path}") as s:  # 4 -> 5: older rows served no OFF rounds among the arm's
        s.record(**obs(8), probe_rounds=3, probe_s=0.02)
        s.flush()
        rows = sorted(s.observations(), key=lambda o: o["id"])
        assert [(o["probe_rounds"], o["probe_s"]) for o in rows] == [(0, 0.0), (3, 0.02)]


def _store_error(url: str) -> str:
    """The StoreError opening `url` raises (any other exception fails the test)."""
    with pytest.raises(StoreError) as raised:
        Store(url).close()
    return str(raised.value)


def test_store_failures_are_store_errors_that_name_the_problem(tmp_path):
    """A directory, a read-only file, a schema version that is not a number and corrupt policy
    state each raise a StoreError saying what is wrong, never a raw OSError or ValueError."""
    assert "is a directory" in _store_error(f"sqlite:///{tmp_path}")

    readonly = tmp_path / "ro.db"
    Store(f"sqlite:///{readonly}").close()
    assert "read-only" in _store_error(f"sqlite:///file:{readonly}?mode=ro&uri=true")  # as a file it cannot write

    garbled = tmp_path / "garbled.db"
    Store(f"sqlite:///{garbled}").close()
    with sqlite3.connect(garbled) as db:
        db.execute("UPDATE autotune_meta SET value = 'three' WHERE key = 'schema_version'")
    assert "schema version 'three'" in _store_error(f"sqlite:///{garbled}")

    corrupt = tmp_path / "corrupt.db"
    with Store(f"sqlite:///{corrupt}") as store:
        store.save_policy_states({"ucb": {"code@load1": {"n": 1}}})
    with sqlite3.connect(corrupt) as db:
        db.execute("UPDATE autotune_policy_states SET state = '{not json'")
    with Store(f"sqlite:///{corrupt}") as store, pytest.raises(StoreError, match="ucb.*code@load1.*not valid JSON"):
        store.load_policy_states("ucb")


def test_another_applications_database_is_refused_untouched(tmp_path):
    foreign = tmp_path / "app.db"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    before = foreign.read_bytes()
    assert "customers" in _store_error(f"sqlite:///{foreign}")
    assert foreign.read_bytes() == before
    with sqlite3.connect(foreign) as db:
        assert [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["customers"]


def test_a_store_opened_read_only_reads_and_changes_nothing(tmp_path):
    """`autotune inspect` opens its store read-only (SQLite's mode=ro, no WAL switch, no run row),
    so it reads a file it could not write, and leaves the file as it was."""
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with Store(url) as store:
        store.save_policy_states({"ucb": {"code@load1": {"n": 3}}})
        store.record(request_class="code", arm="off", prompt_tokens=4, new_tokens=8, goodput=100.0)
    before = (tmp_path / "r.db").read_bytes()
    with Store(url, read_only=True) as reader:
        assert reader.load_policy_states("ucb") == {"code@load1": {"n": 3}} and reader.count() == 1
        with pytest.raises(StoreError, match="read-only"):
            reader.save_policy_states({"ucb": {"code@load1": {"n": 4}}})
        with pytest.raises(StoreError, match="read-only"):
            reader.record(request_class="code", arm="off", prompt_tokens=1, new_tokens=1, goodput=1.0)
    assert (tmp_path / "r.db").read_bytes() == before
    result = subprocess.run([sys.executable, "-m", "autotune.cli", "inspect", "--db", url], capture_output=True,
                            text=True)
    assert result.returncode == 0 and "policy: ucb   observations: 1" in result.stdout, result.stderr
    assert (tmp_path / "r.db").read_bytes() == before


def test_a_full_disk_is_a_store_error_and_loses_nothing_written_before(tmp_path):
    """SQLite answers a full disk with SQLITE_FULL, as it does past `max_page_count`, which lets the
    test fill the database without filling a disk."""
    from sqlalchemy import event

    url = f"sqlite:///{tmp_path / 'full.db'}"
    with Store(url) as s:
        s.save_policy_state("ucb", "code", {"v": 1})
        s.record(**obs(1))
        s.flush()
        with s.engine.connect() as conn:
            pages = conn.exec_driver_sql("PRAGMA page_count").scalar()
        s.engine.dispose()
        event.listen(s.engine, "connect", lambda conn, _: conn.execute(f"PRAGMA max_page_count = {pages}"))
        with pytest.raises(StoreError, match=r"full\.db: the disk \(or the database's size limit\) is full .*"
                                             r"while saving policy states"):
            s.save_policy_state("ucb", "code", {"v": "x" * 100_000})
        for i in range(2, 400):
            s.record(**obs(i), features={"pad": "x" * 1000})
        with pytest.raises(StoreError, match=r"could not be written and were dropped; the last error: .*full"):
            s.flush()
        assert s.load_policy_states("ucb") == {"code": {"v": 1}} and 1 in {o["prompt_tokens"] for o in s.observations()}


@pytest.mark.slow
@pytest.mark.serial  # under other load the two studies' first trials race (Optuna: "Cannot tell a COMPLETE trial")
def test_two_tune_processes_add_their_trials_to_one_study(store_url, tmp_path):
    """`autotune tune` twice at once on one store: both finish, and the class's study holds both
    processes' trials (Optuna's RDB storage in the store's database)."""
    import optuna

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "autotune.cli", "tune", "--classes", "code", "--budget", "3", "--prompts", "1",
               "--no-progress", "--db", store_url]
    tuners = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    for tuner in tuners:
        _, err = tuner.communicate(timeout=300)
        assert tuner.returncode == 0, err
    study = optuna.load_study(study_name="autotune:code", storage=store_url)
    finished = [t for t in study.trials if t.state.is_finished()]
    assert len(finished) == len(study.trials) == 6
    assert {"off"} <= {t.params["arm"] for t in finished}


def test_a_version_3_store_is_upgraded_where_it_stands(store_url):
    """On either database: a store from before the journal keeps its observations and policy
    states (resumed as a checkpoint through 0) and gains the journal; two processes opening it at
    once upgrade it once."""
    from sqlalchemy import create_engine, text

    with Store(store_url) as s:
        s.record(**obs(7))
        s.save_policy_state("ucb", "code@load1", {"pulls": 3})
    engine = create_engine(store_url)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE autotune_policy_updates"))
        conn.execute(text("DROP TABLE autotune_policy_checkpoints"))
        for column in ("probe_rounds", "probe_s"):
            conn.execute(text(f"ALTER TABLE autotune_observations DROP COLUMN {column}"))
        conn.execute(text("UPDATE autotune_meta SET value = '3' WHERE key = 'schema_version'"))
    engine.dispose()
    openers = [run_python(f"""
        from store import Store
        with Store({store_url!r}) as s:
            s.record_update(policy="ucb", seq=1, request_class="code", load=1, arm="off", goodput=9.0, reward=1.0)
    """) for _ in range(2)]
    for opener in openers:
        _, err = opener.communicate(timeout=120)
        assert opener.returncode == 0, err
    with Store(store_url) as s:
        assert s.load_checkpoint("ucb") == ({"code@load1": {"pulls": 3}}, 0)
        assert [u["arm"] for u in s.policy_updates("ucb")] == ["off", "off"] and s.count() == 1
        with s.engine.connect() as conn:
            assert conn.execute(text("SELECT value FROM autotune_meta WHERE key = 'schema_version'")).scalar() == "5"
