"""A deployment's live verification when its load generator fell behind: the round is void, the serving form is
swapped back and both windows replayed on fresh traffic; a real server on loopback, real swaps."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine.config.variant import VariantSpec
from engine.serving.trace_record import TraceRecord
from ops.measure.tiers import SLO
from ops.release import deploy as deploy_mod
from ops.release.deploy import LiveWindows, ServerProcess, deploy

TINY = Path(__file__).resolve().parents[1] / "engine" / "tiny_moe"
SLO_ = SLO(ttft_s=1.0, tpot_s=0.05)


def window(k: int):
    recs = [TraceRecord(arrival_s=0.25 * i, input_tokens=12, output_tokens=8, source="t") for i in range(8)]
    return recs, [[1 + (i + k + j) % 200 for j in range(12)] for i in range(8)]


def lagging(real, rounds_late: int, calls: list):
    """``_live_window`` whose client reports ``rounds_late`` rounds (two windows each) 5 s behind schedule."""
    def replay(*args, **kwargs):
        met, lag, failed = real(*args, **kwargs)
        calls.append(lag)
        return met, lag + (5.0 if len(calls) <= 2 * rounds_late else 0.0), failed
    return replay


@pytest.mark.slow
def test_a_void_round_is_replayed_on_fresh_windows_and_every_void_round_says_unverified(monkeypatch):
    server = ServerProcess(["--model", str(TINY), "--synthetic", "--num-kv-blocks", "256"], "tiny")
    try:
        auth = {"Authorization": f"Bearer {server.token}"}
        base = httpx.get(server.url + "/admin/variant", headers=auth).json()["active"]
        keep = {k: base[k] for k in ("max_num_seqs", "block_size", "enable_prefix_caching")}
        real = deploy_mod._live_window

        calls: list = []
        monkeypatch.setattr(deploy_mod, "_live_window", lagging(real, 1, calls))
        first = VariantSpec(**keep, max_num_batched_tokens=256)
        dep = deploy(server.url, server.token, "tiny", first,
                     LiveWindows(window(0), window(1), rate=4.0, slo=SLO_, max_output=8, max_lag_s=1.0,
                                 spare=[(window(2), window(3))]))
        assert len(calls) == 4, calls  # two rounds of two windows
        assert dep.status == "deployed", dep.reason
        assert dep.reason.startswith("round 1 void (the load generator lagged") and "round 2: " in dep.reason
        assert "not significantly worse" in dep.reason and dep.live_after["round"] == 2
        assert dep.live_before["lag_s"] <= 1.0 and dep.live_after["requests"] == 8
        active = httpx.get(server.url + "/admin/variant", headers=auth).json()["active"]["variant_id"]
        assert active == first.variant_id and dep.previous_build == base["variant_id"]

        # every round void: the swap stays, and the reason says it is unverified
        calls.clear()
        monkeypatch.setattr(deploy_mod, "_live_window", lagging(real, 2, calls))
        second = VariantSpec(**keep, max_num_batched_tokens=128)
        dep = deploy(server.url, server.token, "tiny", second,
                     LiveWindows(window(4), window(5), rate=4.0, slo=SLO_, max_output=8, max_lag_s=1.0,
                                 spare=[(window(6), window(7))]))
        assert len(calls) == 4 and dep.status == "deployed", (calls, dep.reason)
        assert "round 1 void" in dep.reason and "round 2 void" in dep.reason and "unverified" in dep.reason
        assert dep.live_after["round"] == 2 and dep.live_after["lag_s"] > 1.0
        active = httpx.get(server.url + "/admin/variant", headers=auth).json()["active"]["variant_id"]
        assert active == second.variant_id and dep.previous_build == first.variant_id
    finally:
        server.stop()


def test_the_child_client_reports_each_failed_request_and_a_broken_child_clearly():
    """Against a port nothing listens on: every request comes back failed with its error, none lost, each sent
    on its schedule; a child that cannot run says so in one error."""
    from ops.release.deploy import free_port
    from ops.traffic.replay import replay_in_child

    recs, prompts = window(0)
    results = replay_in_child(recs[:4], prompts[:4], f"http://127.0.0.1:{free_port()}/v1", "tiny", time_scale=0.4)
    assert len(results) == 4 and not any(r.ok for r in results) and all(r.error for r in results)
    assert all(0.0 <= r.lag < 0.5 for r in results) and [r.input_tokens for r in results] == [12] * 4
    with pytest.raises(RuntimeError, match="the replay's client failed"):
        replay_in_child(recs[:1], prompts[:1], "http://127.0.0.1:1/v1", "tiny", max_output="eight")  # type: ignore
