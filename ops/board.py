"""The message board and experiment queue agents and benchmark workers share (design section 7).

One SQLite file in WAL mode, safe across threads and processes:
- ``messages``: append-only posts (proposal, result, note, invalid_reply, decision), each with the
  agent that wrote it, a JSON body and the ids of the results it rests on.
- ``experiments``: the queue. A proposal becomes an experiment (variant + tier); a worker claims it
  under a lease it renews while it runs. A worker that dies stops renewing, its lease runs out and
  the experiment goes back to the queue. Completing checks the claim token, so a worker whose
  lease was taken over cannot record a second result; ``results.experiment_id`` is unique.
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from engine.variant import VariantSpec

QUEUED, RUNNING, DONE, FAILED = "queued", "running", "done", "failed"
KINDS = ("proposal", "result", "note", "invalid_reply", "decision")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    agent TEXT NOT NULL,
    kind TEXT NOT NULL,
    body TEXT NOT NULL,
    refs TEXT NOT NULL DEFAULT '[]'
);
CREATE TABLE IF NOT EXISTS experiments (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    search TEXT NOT NULL,
    variant_id TEXT NOT NULL,
    variant TEXT NOT NULL,
    tier TEXT NOT NULL,
    proposer TEXT NOT NULL,
    rationale TEXT NOT NULL,
    status TEXT NOT NULL,
    claim TEXT,
    worker TEXT,
    lease_until REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    created REAL NOT NULL,
    finished REAL,
    UNIQUE (search, variant_id, tier)
);
CREATE TABLE IF NOT EXISTS results (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    experiment_id INTEGER NOT NULL UNIQUE REFERENCES experiments(id),
    variant_id TEXT NOT NULL,
    tier TEXT NOT NULL,
    bench TEXT NOT NULL,
    worker TEXT NOT NULL,
    ts REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS searches (
    id TEXT PRIMARY KEY,
    config TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS experiments_status ON experiments(status, id);
"""


@dataclass(frozen=True)
class Experiment:
    id: int
    search: str
    variant: VariantSpec
    tier: str
    proposer: str
    rationale: str
    status: str
    claim: str | None
    attempts: int


@dataclass(frozen=True)
class Result:
    id: int
    experiment_id: int
    variant_id: str
    tier: str
    bench: dict
    worker: str


class Board:
    """A handle on the board file; open one per thread or process (SQLite connections are not shared)."""

    def __init__(self, path: str | Path, lease_s: float = 60.0):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.lease_s = lease_s
        self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=30000")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _tx(self):
        """BEGIN IMMEDIATE: takes the write lock up front, so claim and complete never race."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # ---- searches -------------------------------------------------------------------------------
    def create_search(self, search: str, config: dict) -> None:
        """Records what a search measures (model, trace slice, tiers), so any worker can evaluate its experiments."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO searches (id, config, created) VALUES (?, ?, ?)",
                       (search, json.dumps(config), time.time()))

    def search_config(self, search: str) -> dict:
        row = self._db.execute("SELECT config FROM searches WHERE id = ?", (search,)).fetchone()
        if row is None:
            raise KeyError(f"no search {search!r} on the board {self.path}")
        return json.loads(row["config"])

    # ---- messages -------------------------------------------------------------------------------
    def post(self, agent: str, kind: str, body: dict, refs: list[int] = ()) -> int:
        if kind not in KINDS:
            raise ValueError(f"unknown message kind {kind!r}; known: {', '.join(KINDS)}")
        with self._tx() as db:
            cur = db.execute("INSERT INTO messages (ts, agent, kind, body, refs) VALUES (?, ?, ?, ?, ?)",
                             (time.time(), agent, kind, json.dumps(body, default=str), json.dumps(list(refs))))
            return cur.lastrowid

    def messages(self, kind: str | None = None, since_id: int = 0) -> list[dict]:
        q = "SELECT * FROM messages WHERE id > ?" + (" AND kind = ?" if kind else "") + " ORDER BY id"
        rows = self._db.execute(q, (since_id, kind) if kind else (since_id,)).fetchall()
        return [{"id": r["id"], "ts": r["ts"], "agent": r["agent"], "kind": r["kind"],
                 "body": json.loads(r["body"]), "refs": json.loads(r["refs"])} for r in rows]

    # ---- the queue ------------------------------------------------------------------------------
    def enqueue(self, search: str, variant: VariantSpec, tier: str, proposer: str, rationale: str,
                refs: list[int] = ()) -> tuple[int, bool]:
        """Queues the variant for a tier once per search; returns (experiment id, newly queued)."""
        with self._tx() as db:
            row = db.execute("SELECT id FROM experiments WHERE search = ? AND variant_id = ? AND tier = ?",
                             (search, variant.variant_id, tier)).fetchone()
            if row:
                return row["id"], False
            cur = db.execute(
                "INSERT INTO experiments (search, variant_id, variant, tier, proposer, rationale, status, created)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (search, variant.variant_id, json.dumps(variant.to_json()), tier, proposer, rationale, QUEUED,
                 time.time()))
            eid = cur.lastrowid
            db.execute("INSERT INTO messages (ts, agent, kind, body, refs) VALUES (?, ?, 'proposal', ?, ?)",
                       (time.time(), proposer, json.dumps({"experiment_id": eid, "variant_id": variant.variant_id,
                                                           "name": variant.name, "tier": tier,
                                                           "rationale": rationale}), json.dumps(list(refs))))
            return eid, True

    def claim(self, worker: str, search: str | None = None, tier: str | None = None) -> Experiment | None:
        """The oldest queued experiment (or one whose lease ran out), leased to ``worker``."""
        now = time.time()
        where = "(status = ? OR (status = ? AND lease_until < ?))"
        args: list = [QUEUED, RUNNING, now]
        if search:
            where += " AND search = ?"
            args.append(search)
        if tier:
            where += " AND tier = ?"
            args.append(tier)
        with self._tx() as db:
            row = db.execute(f"SELECT * FROM experiments WHERE {where} ORDER BY id LIMIT 1", args).fetchone()
            if row is None:
                return None
            token = uuid.uuid4().hex
            db.execute("UPDATE experiments SET status = ?, claim = ?, worker = ?, lease_until = ?, "
                       "attempts = attempts + 1 WHERE id = ?", (RUNNING, token, worker, now + self.lease_s, row["id"]))
            if row["status"] == RUNNING:  # a worker died holding it
                db.execute("INSERT INTO messages (ts, agent, kind, body) VALUES (?, ?, 'note', ?)",
                           (now, worker, json.dumps({"experiment_id": row["id"], "note":
                                                     f"re-queued: worker {row['worker']} let its lease expire"})))
        return Experiment(row["id"], row["search"], VariantSpec.from_json(json.loads(row["variant"])), row["tier"],
                          row["proposer"], row["rationale"], RUNNING, token, row["attempts"] + 1)

    def renew(self, exp: Experiment) -> bool:
        """Extends the lease; False if the experiment is no longer this claim's."""
        with self._tx() as db:
            cur = db.execute("UPDATE experiments SET lease_until = ? WHERE id = ? AND claim = ? AND status = ?",
                             (time.time() + self.lease_s, exp.id, exp.claim, RUNNING))
            return cur.rowcount == 1

    def complete(self, exp: Experiment, worker: str, bench: dict) -> int | None:
        """Records the result; None (nothing written) if the claim was lost to another worker."""
        with self._tx() as db:
            cur = db.execute("UPDATE experiments SET status = ?, finished = ? WHERE id = ? AND claim = ? "
                             "AND status = ?", (DONE, time.time(), exp.id, exp.claim, RUNNING))
            if cur.rowcount != 1:
                return None
            rid = db.execute("INSERT INTO results (experiment_id, variant_id, tier, bench, worker, ts) "
                             "VALUES (?, ?, ?, ?, ?, ?)", (exp.id, exp.variant.variant_id, exp.tier,
                                                           json.dumps(bench), worker, time.time())).lastrowid
            db.execute("INSERT INTO messages (ts, agent, kind, body, refs) VALUES (?, ?, 'result', ?, ?)",
                       (time.time(), worker, json.dumps({"experiment_id": exp.id, "result_id": rid,
                                                         "variant_id": exp.variant.variant_id, "tier": exp.tier,
                                                         "output_tok_s": bench.get("output_tok_s"),
                                                         "goodput": bench.get("goodput")}), json.dumps([rid])))
            return rid

    def fail(self, exp: Experiment, worker: str, error: str) -> bool:
        with self._tx() as db:
            cur = db.execute("UPDATE experiments SET status = ?, error = ?, finished = ? WHERE id = ? AND claim = ? "
                             "AND status = ?", (FAILED, error[:2000], time.time(), exp.id, exp.claim, RUNNING))
            if cur.rowcount == 1:
                db.execute("INSERT INTO messages (ts, agent, kind, body) VALUES (?, ?, 'note', ?)",
                           (time.time(), worker, json.dumps({"experiment_id": exp.id, "error": error[:2000]})))
            return cur.rowcount == 1

    # ---- reading --------------------------------------------------------------------------------
    def counts(self, search: str) -> dict[str, int]:
        rows = self._db.execute("SELECT status, COUNT(*) AS n FROM experiments WHERE search = ? GROUP BY status",
                                (search,)).fetchall()
        return {r["status"]: r["n"] for r in rows}

    def pending(self, search: str, tier: str | None = None) -> int:
        q = "SELECT COUNT(*) FROM experiments WHERE search = ? AND status IN (?, ?)"
        args: list = [search, QUEUED, RUNNING]
        if tier:
            q += " AND tier = ?"
            args.append(tier)
        return self._db.execute(q, args).fetchone()[0]

    def experiments(self, search: str) -> list[dict]:
        rows = self._db.execute("SELECT * FROM experiments WHERE search = ? ORDER BY id", (search,)).fetchall()
        return [dict(r) for r in rows]

    def results(self, search: str, tier: str | None = None) -> list[tuple[Result, VariantSpec]]:
        q = ("SELECT r.*, e.variant FROM results r JOIN experiments e ON e.id = r.experiment_id "
             "WHERE e.search = ?" + (" AND r.tier = ?" if tier else "") + " ORDER BY r.id")
        rows = self._db.execute(q, (search, tier) if tier else (search,)).fetchall()
        return [(Result(r["id"], r["experiment_id"], r["variant_id"], r["tier"], json.loads(r["bench"]), r["worker"]),
                 VariantSpec.from_json(json.loads(r["variant"]))) for r in rows]


def worker_name() -> str:
    return f"{os.uname().nodename}:{os.getpid()}"
