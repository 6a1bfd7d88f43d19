"""The message board and experiment queue agents and benchmark workers share.

A SQLite file in WAL mode (the embedded default), or a Postgres database every worker on every machine shares
(a ``postgresql://`` URL: ops/search/board_store.py), safe across threads and processes:
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
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from engine.config.variant import VariantSpec
from ops.search.board_store import BoardUnavailable, connect

QUEUED, RUNNING, DONE, FAILED = "queued", "running", "done", "failed"
KINDS = ("proposal", "result", "note", "invalid_reply", "decision")
__all__ = ["Board", "BoardUnavailable", "Experiment", "Result", "worker_name", "QUEUED", "RUNNING", "DONE", "FAILED"]


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
    """A handle on the board: a SQLite file path or a ``postgresql://`` URL (ops/search/board_store.py); open one per
    thread or process. ``path`` is what it was opened with, to open another handle on the same board (it may
    hold a password: show ``where``)."""

    def __init__(self, path: str | Path, lease_s: float = 60.0):
        self.path = str(path)
        self.lease_s = lease_s
        self._store = connect(self.path)
        self.where = self._store.where

    @property
    def shared(self) -> bool:
        """Whether other machines can reach this board (a database service, not a file on local disk)."""
        return not self._store.embedded

    @property
    def _db(self):
        """The SQLite connection (integrity checks of the embedded file)."""
        return self._store._db

    def close(self) -> None:
        self._store.close()

    # ---- searches -------------------------------------------------------------------------------
    def create_search(self, search: str, config: dict) -> None:
        """Records what a search measures (model, trace slice, tiers), so any worker can evaluate its experiments."""
        with self._store.tx() as db:
            db.run("INSERT INTO searches (id, config, created) VALUES (?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                   "config = excluded.config, created = excluded.created", (search, json.dumps(config), time.time()))

    def search_config(self, search: str) -> dict:
        with self._store.read() as db:
            row = db.one("SELECT config FROM searches WHERE id = ?", (search,))
        if row is None:
            raise KeyError(f"no search {search!r} on the board {self.where}")
        return json.loads(row["config"])

    # ---- messages -------------------------------------------------------------------------------
    def post(self, agent: str, kind: str, body: dict, refs: list[int] = ()) -> int:
        if kind not in KINDS:
            raise ValueError(f"unknown message kind {kind!r}; known: {', '.join(KINDS)}")
        with self._store.tx() as db:
            return db.one("INSERT INTO messages (ts, agent, kind, body, refs) VALUES (?, ?, ?, ?, ?) RETURNING id",
                          (time.time(), agent, kind, json.dumps(body, default=str), json.dumps(list(refs))))["id"]

    def messages(self, kind: str | None = None, since_id: int = 0) -> list[dict]:
        q = "SELECT * FROM messages WHERE id > ?" + (" AND kind = ?" if kind else "") + " ORDER BY id"
        with self._store.read() as db:
            rows = db.all(q, (since_id, kind) if kind else (since_id,))
        return [{"id": r["id"], "ts": r["ts"], "agent": r["agent"], "kind": r["kind"],
                 "body": json.loads(r["body"]), "refs": json.loads(r["refs"])} for r in rows]

    # ---- the queue ------------------------------------------------------------------------------
    def enqueue(self, search: str, variant: VariantSpec, tier: str, proposer: str, rationale: str,
                refs: list[int] = ()) -> tuple[int, bool]:
        """Queues the variant for a tier once per search; returns (experiment id, newly queued). Two proposers
        racing to queue the same variant get one experiment: the insert yields to the unique key."""
        with self._store.tx() as db:
            row = db.one(
                "INSERT INTO experiments (search, variant_id, variant, tier, proposer, rationale, status, created)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (search, variant_id, tier) DO NOTHING RETURNING id",
                (search, variant.variant_id, json.dumps(variant.to_json()), tier, proposer, rationale, QUEUED,
                 time.time()))
            if row is None:
                return db.one("SELECT id FROM experiments WHERE search = ? AND variant_id = ? AND tier = ?",
                              (search, variant.variant_id, tier))["id"], False
            eid = row["id"]
            db.run("INSERT INTO messages (ts, agent, kind, body, refs) VALUES (?, ?, 'proposal', ?, ?)",
                   (time.time(), proposer, json.dumps({"experiment_id": eid, "variant_id": variant.variant_id,
                                                       "name": variant.name, "tier": tier,
                                                       "rationale": rationale}), json.dumps(list(refs))))
            return eid, True

    def claim(self, worker: str, search: str | None = None, tier: str | None = None) -> Experiment | None:
        """The oldest queued experiment (or one whose lease ran out), leased to ``worker``."""
        where = "(status = ? OR (status = ? AND lease_until < ?))"
        with self._store.tx() as db:
            now = self._store.now(db)
            args: list = [QUEUED, RUNNING, now]
            if search:
                where += " AND search = ?"
                args.append(search)
            if tier:
                where += " AND tier = ?"
                args.append(tier)
            row = db.one(f"SELECT * FROM experiments WHERE {where} ORDER BY id LIMIT 1{self._store.lock_rows}", args)
            if row is None:
                return None
            token = uuid.uuid4().hex
            db.run("UPDATE experiments SET status = ?, claim = ?, worker = ?, lease_until = ?, "
                   "attempts = attempts + 1 WHERE id = ?", (RUNNING, token, worker, now + self.lease_s, row["id"]))
            if row["status"] == RUNNING:  # a worker died holding it
                db.run("INSERT INTO messages (ts, agent, kind, body) VALUES (?, ?, 'note', ?)",
                       (time.time(), worker, json.dumps({"experiment_id": row["id"], "note":
                                                         f"re-queued: worker {row['worker']} let its lease expire"})))
        return Experiment(row["id"], row["search"], VariantSpec.from_json(json.loads(row["variant"])), row["tier"],
                          row["proposer"], row["rationale"], RUNNING, token, row["attempts"] + 1)

    def renew(self, exp: Experiment) -> bool:
        """Extends the lease; False if the experiment is no longer this claim's."""
        with self._store.tx() as db:
            return db.run("UPDATE experiments SET lease_until = ? WHERE id = ? AND claim = ? AND status = ?",
                          (self._store.now(db) + self.lease_s, exp.id, exp.claim, RUNNING)) == 1

    def complete(self, exp: Experiment, worker: str, bench: dict) -> int | None:
        """Records the result; None (nothing written) if the claim was lost to another worker."""
        with self._store.tx() as db:
            if db.run("UPDATE experiments SET status = ?, finished = ? WHERE id = ? AND claim = ? AND status = ?",
                      (DONE, time.time(), exp.id, exp.claim, RUNNING)) != 1:
                return None
            rid = db.one("INSERT INTO results (experiment_id, variant_id, tier, bench, worker, ts) "
                         "VALUES (?, ?, ?, ?, ?, ?) RETURNING id", (exp.id, exp.variant.variant_id, exp.tier,
                                                                  json.dumps(bench), worker, time.time()))["id"]
            db.run("INSERT INTO messages (ts, agent, kind, body, refs) VALUES (?, ?, 'result', ?, ?)",
                   (time.time(), worker, json.dumps({"experiment_id": exp.id, "result_id": rid,
                                                     "variant_id": exp.variant.variant_id, "tier": exp.tier,
                                                     "output_tok_s": bench.get("output_tok_s"),
                                                     "goodput": bench.get("goodput")}), json.dumps([rid])))
            return rid

    def fail(self, exp: Experiment, worker: str, error: str) -> bool:
        with self._store.tx() as db:
            failed = db.run("UPDATE experiments SET status = ?, error = ?, finished = ? WHERE id = ? AND claim = ? "
                            "AND status = ?", (FAILED, error[:2000], time.time(), exp.id, exp.claim, RUNNING)) == 1
            if failed:
                db.run("INSERT INTO messages (ts, agent, kind, body) VALUES (?, ?, 'note', ?)",
                       (time.time(), worker, json.dumps({"experiment_id": exp.id, "error": error[:2000]})))
            return failed

    # ---- reading --------------------------------------------------------------------------------
    def counts(self, search: str) -> dict[str, int]:
        with self._store.read() as db:
            rows = db.all("SELECT status, COUNT(*) AS n FROM experiments WHERE search = ? GROUP BY status", (search,))
        return {r["status"]: r["n"] for r in rows}

    def pending(self, search: str, tier: str | None = None) -> int:
        q = "SELECT COUNT(*) AS n FROM experiments WHERE search = ? AND status IN (?, ?)"
        args: list = [search, QUEUED, RUNNING]
        if tier:
            q += " AND tier = ?"
            args.append(tier)
        with self._store.read() as db:
            return db.one(q, args)["n"]

    def experiments(self, search: str) -> list[dict]:
        with self._store.read() as db:
            return db.all("SELECT * FROM experiments WHERE search = ? ORDER BY id", (search,))

    def results(self, search: str, tier: str | None = None) -> list[tuple[Result, VariantSpec]]:
        q = ("SELECT r.*, e.variant FROM results r JOIN experiments e ON e.id = r.experiment_id "
             "WHERE e.search = ?" + (" AND r.tier = ?" if tier else "") + " ORDER BY r.id")
        with self._store.read() as db:
            rows = db.all(q, (search, tier) if tier else (search,))
        return [(Result(r["id"], r["experiment_id"], r["variant_id"], r["tier"], json.loads(r["bench"]), r["worker"]),
                 VariantSpec.from_json(json.loads(r["variant"]))) for r in rows]


def worker_name() -> str:
    return f"{os.uname().nodename}:{os.getpid()}"
