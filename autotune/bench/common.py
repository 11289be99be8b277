"""What the benchmarks share: turn order, the device's name, a tail percentile, client
threads, and transformers' own `generate()` timed as the reference."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import torch

from engine import Arm, ModelDrafter, NGramDrafter, SpeculativeEngine


def rotate(items: list, i: int) -> list:
    """items starting at the i-th: compared methods take turns going first, so a slow moment of
    a shared machine does not always land on the same one."""
    i %= len(items)
    return items[i:] + items[:i]


def device_name(engine: SpeculativeEngine) -> str:
    if engine.device.type == "cuda":
        return torch.cuda.get_device_name(engine.device)
    return f"cpu ({torch.get_num_threads()} threads)"


def p99(values) -> float:
    ordered = sorted(values)
    return round(ordered[int(0.99 * (len(ordered) - 1))], 4)


def client_plan(engine: SpeculativeEngine, classes: dict, clients: int, requests_per_client: int) -> list:
    """Per client, its class and the token ids of its requests: client c sends requests of class
    c mod len(classes), each client other prompts of it."""
    names = list(classes)
    plan = []
    for c in range(clients):
        cls = classes[names[c % len(names)]]
        first = (c // len(names)) * requests_per_client
        plan.append((cls, [engine.encode(cls.prompts[(first + j) % len(cls.prompts)]).tolist()
                           for j in range(requests_per_client)]))
    return plan


def run_clients(client: Callable[[int], None], clients: int) -> float:
    """`client(c)` on a thread per client, all at once; the seconds until the last is done. A
    client that raised is raised here, once all are done: a client that stopped early would
    leave figures that only look measured."""
    errors: list[BaseException] = []

    def run(c: int) -> None:
        try:
            client(c)
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {clients} clients failed") from errors[0]
    return time.perf_counter() - start


def hf_generate(engine: SpeculativeEngine, ids: list[int], max_new_tokens: int, arm: Arm | None, **options):
    """transformers' own greedy `generate()` (with assisted generation or prompt lookup for `arm`),
    timed: the reference every engine figure is measured against. `options`: more of generate()'s
    arguments (`repetition_penalty`, `no_repeat_ngram_size`)."""
    inputs = torch.tensor([ids], device=engine.device)
    kwargs = dict(attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=max_new_tokens,
                  pad_token_id=min(engine.eos_token_id, default=0), **options)
    if arm is not None:
        drafter = engine.drafters[arm.drafter]
        if isinstance(drafter, NGramDrafter):
            kwargs.update(prompt_lookup_num_tokens=arm.k)
        elif not isinstance(drafter, ModelDrafter):
            raise ValueError(f"transformers has no counterpart of drafter {arm.drafter!r} to compare with")
        else:
            kwargs.update(assistant_model=drafter.model, num_assistant_tokens=arm.k,
                          num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
    with torch.inference_mode():
        engine._sync()
        start = time.perf_counter()
        out = engine.target.generate(inputs, **kwargs)
        seconds = engine._sync() - start
    return out[0, len(ids):].tolist(), seconds


def compile_total(report: dict[str, dict[str, float]]) -> float:
    """Seconds spent compiling, from `SpeculativeEngine.warm_up`'s report."""
    return round(sum(t for graphs in report.values() for t in graphs.values()), 2)


@contextlib.contextmanager
def fresh_stores(postgres: str | None = None):
    """Yields `fresh(database, name) -> URL` of a new, empty store: database "sqlite", a file in a
    temporary directory; "postgresql", a database created on the server at `postgres` (its URL,
    any database on it), dropped afterwards."""
    import tempfile
    import uuid

    from sqlalchemy import create_engine, text

    created: list[str] = []
    admin = create_engine(postgres, isolation_level="AUTOCOMMIT") if postgres else None

    def fresh(database: str, name: str) -> str:
        if database == "sqlite":
            return f"sqlite:///{tmp}/{name}.db"
        if admin is None:
            raise ValueError("no PostgreSQL server given (--postgres URL)")
        db = f"autotune_bench_{name}_{uuid.uuid4().hex[:8]}"
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {db}"))
        created.append(db)
        return postgres.rsplit("/", 1)[0] + "/" + db

    with tempfile.TemporaryDirectory() as tmp:
        try:
            yield fresh
        finally:
            if admin is not None:
                with admin.connect() as conn:
                    for db in created:
                        conn.execute(text(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
                admin.dispose()
