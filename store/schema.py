"""Tables of the store. Bump SCHEMA_VERSION and add a step to MIGRATIONS on any change."""

from __future__ import annotations

from sqlalchemy import JSON, Boolean, Float, Index, Integer, String, Text, UniqueConstraint, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA_VERSION = 5


class Base(DeclarativeBase):
    pass


class Meta(Base):
    __tablename__ = "autotune_meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))


class Run(Base):
    """One process lifetime of a controller, tuner or benchmark."""

    __tablename__ = "autotune_runs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    started_at: Mapped[float] = mapped_column(Float)
    label: Mapped[str] = mapped_column(String(256), default="")


class ModelRecord(Base):
    __tablename__ = "autotune_models"
    __table_args__ = (UniqueConstraint("name", "content_hash"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))  # target | drafter
    path: Mapped[str] = mapped_column(String(1024), default="")
    content_hash: Mapped[str] = mapped_column(String(64))
    params: Mapped[int] = mapped_column(Integer, default=0)
    size_bytes: Mapped[int] = mapped_column(Integer, default=0)


class Observation(Base):
    """One served request: what was chosen, what it cost, what it achieved."""

    __tablename__ = "autotune_observations"
    __table_args__ = (Index("ix_obs_class_arm", "request_class", "arm"), Index("ix_obs_time", "created_at"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[float] = mapped_column(Float)
    request_class: Mapped[str] = mapped_column(String(128))
    arm: Mapped[str] = mapped_column(String(64))  # "off" or "drafter:K"
    policy: Mapped[str] = mapped_column(String(64), default="")
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    new_tokens: Mapped[int] = mapped_column(Integer)
    rounds: Mapped[int] = mapped_column(Integer, default=0)
    # of them, rounds served OFF among the arm's to measure OFF's step (`probe_off`), and their seconds
    probe_rounds: Mapped[int] = mapped_column(Integer, default=0)
    probe_s: Mapped[float] = mapped_column(Float, default=0.0)
    drafted: Mapped[int] = mapped_column(Integer, default=0)
    accepted: Mapped[int] = mapped_column(Integer, default=0)
    acceptance: Mapped[float | None] = mapped_column(Float, nullable=True)
    acceptance_per_position: Mapped[list] = mapped_column(JSON, default=list)
    prefill_s: Mapped[float] = mapped_column(Float, default=0.0)
    draft_s: Mapped[float] = mapped_column(Float, default=0.0)
    verify_s: Mapped[float] = mapped_column(Float, default=0.0)
    total_s: Mapped[float] = mapped_column(Float, default=0.0)
    # From the call until the engine began on it: waiting for a batch to form, for the engine, and
    # the decision. total_s is the engine's time alone, so latency as the caller saw it is the sum.
    queue_s: Mapped[float] = mapped_column(Float, default=0.0)
    goodput: Mapped[float] = mapped_column(Float)  # output tokens per second of the request
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)  # goodput / class OFF baseline
    gpu_util: Mapped[float | None] = mapped_column(Float, nullable=True)
    gpu_mem_mb: Mapped[float | None] = mapped_column(Float, nullable=True)
    load: Mapped[int] = mapped_column(Integer, default=1)
    temperature: Mapped[float] = mapped_column(Float, default=0.0)
    fell_back: Mapped[bool] = mapped_column(Boolean, default=False)
    stream_error: Mapped[str | None] = mapped_column(Text, nullable=True)  # the streamer raised: cut short
    finish_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)  # stop, length or abort
    classified: Mapped[bool] = mapped_column(Boolean, default=False)  # class predicted, not given
    features: Mapped[dict] = mapped_column(JSON, default=dict)
    engine_identity: Mapped[str] = mapped_column(String(512), default="")


class PolicyState(Base):
    """Every saved version of a policy's state for one class; the newest one is resumed."""

    __tablename__ = "autotune_policy_states"
    __table_args__ = (UniqueConstraint("policy", "request_class", "version"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    policy: Mapped[str] = mapped_column(String(64))
    request_class: Mapped[str] = mapped_column(String(128))
    version: Mapped[int] = mapped_column(Integer)
    saved_at: Mapped[float] = mapped_column(Float)
    state: Mapped[dict] = mapped_column(JSON)


class PolicyUpdate(Base):
    """One update a controller taught its policy, journaled with the observations: what a policy
    learned is the fold of these in id order, so it survives any crash the observations survive,
    and several controllers on one store add up their evidence (autotune/control/learning.py)."""

    __tablename__ = "autotune_policy_updates"
    __table_args__ = (Index("ix_updates_policy", "policy", "id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(32))
    seq: Mapped[int] = mapped_column(Integer)  # the run's own count of its updates, from 1
    created_at: Mapped[float] = mapped_column(Float)
    policy: Mapped[str] = mapped_column(String(64))
    request_class: Mapped[str] = mapped_column(String(128))
    load: Mapped[int] = mapped_column(Integer)
    features: Mapped[dict] = mapped_column(JSON, default=dict)
    arm: Mapped[str] = mapped_column(String(64))
    goodput: Mapped[float] = mapped_column(Float)
    reward: Mapped[float] = mapped_column(Float)
    acceptance: Mapped[float | None] = mapped_column(Float, nullable=True)
    new_tokens: Mapped[int] = mapped_column(Integer, default=0)
    siblings: Mapped[dict] = mapped_column(JSON, default=dict)  # {arm: [estimated reward, weight]}


class PolicyCheckpoint(Base):
    """How far into the journal a policy's saved states reach: they are the fold of its updates
    with id <= `through`, so a resume folds only the updates after it."""

    __tablename__ = "autotune_policy_checkpoints"
    policy: Mapped[str] = mapped_column(String(64), primary_key=True)
    through: Mapped[int] = mapped_column(Integer)
    saved_at: Mapped[float] = mapped_column(Float)


OUR_TABLES = {t.name for t in Base.metadata.sorted_tables}


def _add_queue_and_stream_error(conn) -> None:
    """1 -> 2: observations record the time queued and a streamer's error."""
    table = Observation.__tablename__
    for name in ("queue_s", "stream_error"):
        column = Observation.__table__.c[name]
        default = " DEFAULT 0.0" if name == "queue_s" else ""
        conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {name} {column.type.compile(conn.dialect)}{default}"))


def _add_finish_reason(conn) -> None:
    """2 -> 3: observations record why the output ended (older rows: NULL, not known)."""
    column = Observation.__table__.c["finish_reason"]
    conn.execute(text(f"ALTER TABLE {Observation.__tablename__} ADD COLUMN finish_reason"
                      f" {column.type.compile(conn.dialect)}"))


def _add_policy_journal(conn) -> None:
    """3 -> 4: the journal of policy updates and its checkpoints (states saved before it resume
    as a checkpoint through 0)."""
    PolicyUpdate.__table__.create(conn, checkfirst=True)
    PolicyCheckpoint.__table__.create(conn, checkfirst=True)


def _add_probes(conn) -> None:
    """4 -> 5: observations record the OFF rounds served among the arm's (older rows: none)."""
    for name, default in (("probe_rounds", "0"), ("probe_s", "0.0")):
        column = Observation.__table__.c[name]
        conn.execute(text(f"ALTER TABLE {Observation.__tablename__} ADD COLUMN {name}"
                          f" {column.type.compile(conn.dialect)} DEFAULT {default}"))


# version -> function(connection) that upgrades a database from that version to the next, inside
# the transaction that opens the store: a crash midway leaves the old version intact.
MIGRATIONS: dict = {1: _add_queue_and_stream_error, 2: _add_finish_reason, 3: _add_policy_journal, 4: _add_probes}
