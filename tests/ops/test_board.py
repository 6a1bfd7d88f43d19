"""The message board and experiment queue: claims, leases, re-queue of a dead worker's experiment, no double counting;
every test on both stores, a SQLite file and a real Postgres server (tests/conftest.py starts one)."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.config.variant import VariantSpec
from ops.search.board import DONE, QUEUED, RUNNING, Board, BoardUnavailable
from ops.search.board_store import masked

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "traces" / "AzureLLMInferenceTrace_conv.csv"


@pytest.fixture(params=["sqlite", "postgres"])
def board_at(request, tmp_path):
    """Where a test's board lives: a fresh SQLite file, or a fresh database on the session's Postgres."""
    if request.param == "sqlite":
        return str(tmp_path / "board.db")
    return request.getfixturevalue("postgres_url")


def _variants(n: int) -> list[VariantSpec]:
    return [VariantSpec(name=f"v{i}", max_num_seqs=i + 1) for i in range(n)]


def test_enqueue_once_claim_in_order_and_complete(board_at):
    board = Board(board_at)
    ids = [board.enqueue("s", v, "fast", "test", f"because {v.name}")[0] for v in _variants(3)]
    again, fresh = board.enqueue("s", _variants(1)[0], "fast", "test", "dup")
    assert again == ids[0] and not fresh  # the same variant on the same tier is queued once per search
    assert board.enqueue("s", _variants(1)[0], "slow", "test", "other tier")[1]
    exp = board.claim("w1", "s", "fast")
    assert exp.id == ids[0] and exp.variant == _variants(1)[0] and exp.attempts == 1
    rid = board.complete(exp, "w1", {"output_tok_s": 1.5})
    assert rid is not None
    assert board.complete(exp, "w1", {"output_tok_s": 9.9}) is None  # a second completion writes nothing
    res = board.results("s")
    assert [(r.experiment_id, r.bench["output_tok_s"]) for r, _ in res] == [(ids[0], 1.5)]
    kinds = [m["kind"] for m in board.messages()]
    assert kinds.count("proposal") == 4 and kinds.count("result") == 1
    assert board.counts("s") == {DONE: 1, QUEUED: 3}


def test_expired_lease_is_taken_over_and_the_late_result_is_refused(board_at):
    path = board_at
    slow_worker = Board(path, lease_s=0.3)
    other = Board(path, lease_s=30)
    (eid, _) = slow_worker.enqueue("s", _variants(1)[0], "fast", "test", "r")
    first = slow_worker.claim("dead", "s")
    assert other.claim("w2", "s") is None  # the lease still holds
    time.sleep(0.5)
    second = other.claim("w2", "s")
    assert second.id == eid and second.attempts == 2
    assert slow_worker.renew(first) is False  # the first worker learns it lost the claim
    assert slow_worker.complete(first, "dead", {"output_tok_s": 1.0}) is None
    assert other.complete(second, "w2", {"output_tok_s": 2.0}) is not None
    res = other.results("s")
    assert len(res) == 1 and res[0][0].worker == "w2"
    notes = [m["body"].get("note", "") for m in other.messages("note")]
    assert any("re-queued" in n and "dead" in n for n in notes)


def test_concurrent_workers_claim_each_experiment_exactly_once(board_at):
    path = board_at
    board = Board(path)
    for v in _variants(40):
        board.enqueue("s", v, "fast", "test", "r")
    done: list[tuple[str, int]] = []
    lock = threading.Lock()

    def worker(name):
        b = Board(path)
        while (exp := b.claim(name, "s")) is not None:
            assert b.complete(exp, name, {"output_tok_s": float(exp.id)}) is not None
            with lock:
                done.append((name, exp.id))
        b.close()

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(e for _, e in done) == sorted({e for _, e in done}) and len(done) == 40
    assert len(board.results("s")) == 40


def test_a_board_outlives_a_database_restart_and_names_it_while_down(postgres_server, postgres_url):
    """Postgres restarts under a worker: while it is down each call fails naming the database (its password
    masked); once it is back the same Board carries on (pooled connections are pinged and replaced)."""
    board = Board(postgres_url.replace("polyinf@", f"polyinf:{postgres_server.password}@"))
    (eid, _) = board.enqueue("s", _variants(1)[0], "fast", "test", "r")
    postgres_server.stop()
    try:
        with pytest.raises(BoardUnavailable) as err:
            board.claim("w", "s")
        assert "cannot reach the board's database at postgresql://polyinf:***@127.0.0.1" in str(err.value)
        assert postgres_server.password not in str(err.value)
    finally:
        postgres_server.start()
    exp = board.claim("w", "s")
    assert exp.id == eid and board.complete(exp, "w", {"output_tok_s": 1.0}) is not None


_CLAIMER = """
import json, sys
from ops.search.board import Board
board = Board(sys.argv[1])
got = []
while (exp := board.claim(sys.argv[2], "s")) is not None:
    if board.complete(exp, sys.argv[2], {"output_tok_s": 1.0}) is not None:
        got.append(exp.id)
print(json.dumps(got))
"""


def test_worker_processes_claim_each_experiment_exactly_once(board_at):
    """Separate processes (the shape of pods on a shared board) drain one queue: no experiment twice."""
    board = Board(board_at)
    ids = [board.enqueue("s", v, "fast", "test", "r")[0] for v in _variants(60)]
    procs = [subprocess.Popen([sys.executable, "-c", _CLAIMER, board_at, f"p{i}"], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}) for i in range(3)]
    claimed = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        claimed += json.loads(out)
    assert sorted(claimed) == sorted(ids)
    assert sorted(r.experiment_id for r, _ in board.results("s")) == sorted(ids)


def test_bad_locations_are_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="unsupported scheme 'mysql'.*postgresql://"):
        Board("mysql://user:hunter22@db/board")
    with pytest.raises(ValueError, match="no host"):
        Board("postgresql:///board")
    with pytest.raises(ValueError, match="no location"):
        Board("")
    (tmp_path / "file").write_text("")
    with pytest.raises(BoardUnavailable, match="cannot open the board's SQLite file"):
        Board(tmp_path / "file" / "board.db")
    assert masked("postgresql://u:hunter22@db:5432/b") == "postgresql://u:***@db:5432/b"


def test_an_unreachable_database_is_named_without_its_password():
    from ops.release.deploy import free_port

    url = f"postgresql://polyinf:hunter22@127.0.0.1:{free_port()}/board"
    with pytest.raises(BoardUnavailable) as err:
        Board(url)
    text = str(err.value)
    assert "hunter22" not in text and f"postgresql://polyinf:***@127.0.0.1:{url.split(':')[3]}" in text, text
    assert "cannot reach the board's database" in text and err.value.__cause__ is None


def test_the_wrong_password_is_refused_without_echoing_it(postgres_url, monkeypatch):
    monkeypatch.delenv("PGPASSWORD")
    url = postgres_url.replace("postgresql://polyinf@", "postgresql://polyinf:wrong-secret@")
    with pytest.raises(BoardUnavailable, match="password authentication failed") as err:
        Board(url)
    assert "wrong-secret" not in str(err.value)


@pytest.mark.slow
def test_killed_worker_process_experiment_is_requeued_and_counted_once(board_at):
    """A real `polyinf worker` is SIGKILLed mid-experiment; a second worker finishes the queue."""
    from ops.measure.hardware import probe
    from ops.search.config import SearchConfig
    from ops.search.worker import Workbench, work

    path = board_at
    cfg = SearchConfig(trace=str(TRACE), requests=4, max_input=32, max_output=4, fast_layers=1, fast_repeats=2)
    board = Board(path, lease_s=2.0)
    board.create_search("s", cfg.to_json())
    base = VariantSpec(name="base")
    variants = [base, dataclasses.replace(base, name="seqs 4", max_num_seqs=4),
                dataclasses.replace(base, name="budget 256", max_num_batched_tokens=256)]
    for v in variants:
        board.enqueue("s", v, "fast", "test", "r")
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "worker", "--board", str(path), "--search", "s",
                             "--lease-s", "2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            if any(e["status"] == RUNNING for e in board.experiments("s")):
                break
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.05)
        else:
            pytest.fail("the worker never claimed an experiment")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed = [e for e in board.experiments("s") if e["status"] == RUNNING]
    assert len(killed) == 1
    time.sleep(2.5)  # its lease runs out
    stats = work(board, "s", Workbench(cfg, probe("cpu", size_mb=16)), name="survivor")
    exps = board.experiments("s")
    assert all(e["status"] == DONE for e in exps), [(e["id"], e["status"], e["error"]) for e in exps]
    results = board.results("s")
    assert sorted(r.experiment_id for r, _ in results) == sorted(e["id"] for e in exps)  # each exactly once
    again = next(e for e in exps if e["id"] == killed[0]["id"])
    assert again["attempts"] == 2 and again["worker"] == "survivor"
    assert stats.evaluated == len(exps) - sum(1 for r, _ in results if r.worker != "survivor")
    for r, v in results:
        assert r.bench["variant_id"] == v.variant_id and r.bench["output_tok_s"] > 0
        assert json.loads(json.dumps(r.bench))["tier"] == "fast"
