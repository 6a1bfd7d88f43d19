"""Load and faults, small: a live server answers and captures every request exactly once, survives SIGKILL
with its capture whole, swaps and rolls back under load without failing a request; the board survives its
processes being killed mid-write. bench/load_faults.py runs the full-size versions."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from ops.release.loadtest import board_faults, check_capture, closed_loop, kill_and_restart, start_server, swap_under_load

TINY = Path(__file__).resolve().parents[1] / "engine" / "tiny_moe"
MODEL_ARGS = ["--model", str(TINY), "--synthetic", "--num-kv-blocks", "256", "--max-num-seqs", "32"]


def test_every_request_is_answered_and_captured_exactly_once(tmp_path):
    server = start_server(MODEL_ARGS, tmp_path / "capture")
    try:
        r = closed_loop(server.url, "load", 300, 16)
    finally:
        server.stop()
    assert (r.sent, r.ok, r.failed, r.duplicated_answers) == (300, 300, 0, 0), r.errors
    assert check_capture(tmp_path / "capture", r.ids) == {"captured": 300, "missing": 0, "duplicated": 0,
                                                          "unanswered": 0, "without_id": 0}


@pytest.mark.slow  # two server processes, the first killed mid-load
def test_sigkill_mid_load_loses_no_finished_request(tmp_path):
    res = kill_and_restart(MODEL_ARGS, tmp_path / "capture", n=600, concurrency=16, kill_after=100)
    before, after = res["before_kill"], res["after_restart"]
    assert before.ok >= 100 and before.failed >= 1  # the kill cut requests in flight
    assert after.failed == 0 and after.ok == 150
    assert res["missing"] == 0 and res["duplicated"] == 0 and res["without_id"] == 0
    assert res["captured"] == before.ok + after.ok + res["unanswered"]


def test_hot_swap_and_rollback_under_load_fail_no_request(tmp_path):
    server = start_server(MODEL_ARGS, tmp_path / "capture")
    try:
        auth = {"Authorization": f"Bearer {server.token}"}
        active = httpx.get(server.url + "/admin/variant", headers=auth).json()["active"]
        base = {k: v for k, v in active.items() if k != "variant_id"}
        variants = [{**base, "block_size": 8},  # kv_layout: the pool rebuilt, running requests recomputed
                    {**base, "block_size": 8, "kernels": {"rms_norm": "triton"}, "max_num_seqs": 8}]  # forward
        res = swap_under_load(server, variants, 300, 16)
        final = httpx.get(server.url + "/admin/variant", headers=auth).json()["active"]["variant_id"]
    finally:
        server.stop()
    assert [s["status"] for s in res["swaps"]] == [200, 200, 200], res["swaps"]
    assert res["swaps"][0]["scopes"] == ["kv_layout"] and "forward" in res["swaps"][1]["scopes"]
    assert res["load"].failed == 0 and res["load"].ok == 300, res["load"].errors
    assert final != active["variant_id"]  # rolled back to the first swap's variant, the one before the last
    assert check_capture(tmp_path / "capture", res["load"].ids)["missing"] == 0


def test_the_board_survives_its_processes_killed_mid_write(tmp_path):
    res = board_faults(tmp_path / "board.sqlite", experiments=40, kills=8, lease_s=0.5)
    assert res["integrity"] == "ok"
    assert (res["lost"], res["duplicated"], res["double_results"]) == (0, 0, 0), res
    assert res["experiments"] == res["done"] == res["results"] == 40, res
    assert res["worker_kills"] >= 1 and res["leases_expired"] >= 1  # killed mid-experiment, then resumed
