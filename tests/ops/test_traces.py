"""Trace import (strict and lenient), capture files (flush, rotation, torn lines) and the traffic profile."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.serving.capture import CURRENT, CaptureWriter, capture_files, read_capture_dir
from engine.serving.trace_record import TraceRecord
from ops.traffic.traces import ImportStats, TraceError, load_trace, profile

SHARED = Path(__file__).resolve().parents[2] / "traces"


def test_shared_traces_import_whole():
    azure = load_trace(SHARED / "AzureLLMInferenceTrace_conv.csv")
    moon = load_trace(SHARED / "mooncake_conversation_trace.jsonl")
    assert len(azure) == 19366 and len(moon) == 12031
    assert azure[0].arrival_s == 0.0 and azure[0].input_tokens == 374 and azure[0].output_tokens == 44
    assert moon[0].block_tokens == 512 and len(moon[0].prefix_block_hashes) == 14
    assert all(len(r.prefix_block_hashes) == -(-r.input_tokens // 512) for r in moon[:500])
    p = profile(moon)
    assert abs(p.prefix_reuse - 0.374) < 0.001  # the README's figure for an unbounded cache
    # the last recorded timestamp is 3,536.999 s; its requests are spread over the 3 s tick after it
    assert 3536.999 <= p.window_s < 3536.999 + 3.0 and p.requests == 12031
    assert profile(azure).prefix_reuse == 0.0


def test_a_coarse_clock_is_spread_within_its_tick(tmp_path):
    # 3 requests at 0 s, 2 at 3 s, 1 at 6 s, 1 at 7 s: the tick is 3 s (the most common step)
    rows = [(0, 10), (0, 11), (0, 12), (3000, 13), (3000, 14), (6000, 15), (7000, 16)]
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": 2, "hash_ids": [i]}) + "\n"
                         for t, i in rows))
    recs = load_trace(m)
    assert [r.input_tokens for r in recs] == [10, 11, 12, 13, 14, 15, 16]  # the recorded order is kept
    t = [r.arrival_s for r in recs]
    assert t[0] == 0.0 and 0.0 < t[1] <= t[2] < 3.0 and t[3] == 3.0 and 3.0 < t[4] < 6.0 and t[5:] == [6.0, 7.0]
    assert len(set(t)) == 7 and [r.arrival_s for r in load_trace(m)] == t  # the same times on every load
    # a clock without ties, and an Azure trace, are left as recorded
    m.write_text("".join(json.dumps({"timestamp": t, "input_length": 5, "output_length": 2, "hash_ids": [1]}) + "\n"
                         for t in (0, 1500, 4000)))
    assert [r.arrival_s for r in load_trace(m)] == [0.0, 1.5, 4.0]


def test_profile_on_a_known_trace():
    recs = [TraceRecord(arrival_s=t, input_tokens=i, output_tokens=o, prefix_block_hashes=h, block_tokens=4,
                        e2e_s=1.0)
            for t, i, o, h in [(0.0, 8, 2, (1, 2)), (1.0, 8, 4, (1, 3)), (2.0, 4, 6, (1,)), (4.0, 2, 8, ())]]
    p = profile(recs)
    assert p.requests == 4 and p.window_s == 4.0 and p.arrival_rate == 1.0
    gaps = [1.0, 1.0, 2.0]
    mean = sum(gaps) / 3
    cv = (sum((g - mean) ** 2 for g in gaps) / 3) ** 0.5 / mean
    assert abs(p.interarrival_cv - cv) < 1e-12
    assert p.input_max == 8 and p.output_p50 == 5.0 and p.peak_second_rate == 1.0
    # hashed blocks seen before: block 1 in the 2nd and 3rd requests, 4 tokens each, of 22 input tokens
    assert abs(p.prefix_reuse - 8 / 22) < 1e-12
    assert p.estimated_concurrency == 1.0


def test_malformed_rows_name_file_and_line(tmp_path):
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
                   '{"timestamp": 5, "input_length": "many", "output_length": 2, "hash_ids": [2]}\n'
                   'not json at all\n'
                   '{"timestamp": 9, "input_length": 3, "output_length": 1, "hash_ids": [3]}\n')
    with pytest.raises(TraceError, match=r"m.jsonl:2: bad Mooncake row"):
        load_trace(bad)
    stats = ImportStats()
    recs = load_trace(bad, lenient=True, stats=stats)
    assert [r.input_tokens for r in recs] == [10, 3] and stats.skipped == 2 and "m.jsonl:2" in stats.first_error
    az = tmp_path / "a.csv"
    az.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                  "2023-11-16 18:15:47.0,-3,1\n")
    with pytest.raises(TraceError, match=r"a.csv:3"):
        load_trace(az)
    (tmp_path / "h.csv").write_text("time,in,out\n1,2,3\n")
    with pytest.raises(TraceError, match="header"):
        load_trace(tmp_path / "h.csv")
    with pytest.raises(TraceError, match="not found"):
        load_trace(tmp_path / "missing.jsonl")


def test_broken_first_line_unsorted_and_zoned_timestamps(tmp_path):
    """A broken first row does not hide the format (the rows after it say Mooncake); Azure arrivals count from
    the earliest row, whatever the order, with zoned and unzoned times on one clock; empty traces are empty."""
    m = tmp_path / "m.jsonl"
    m.write_text('{"timestamp": 0, "input_le\n'
                 '{"timestamp": 1000, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match=r"m.jsonl:1: bad Mooncake row"):
        load_trace(m)
    stats = ImportStats()
    assert [(r.arrival_s, r.source) for r in load_trace(m, lenient=True, stats=stats)] == [(1.0, "mooncake")]
    assert stats.skipped == 1
    az = tmp_path / "a.csv"
    az.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:50,10,1\n"
                  "2023-11-16 18:15:40,20,2\n2023-11-16T19:15:45+01:00,30,3\n")
    assert [(r.arrival_s, r.input_tokens) for r in load_trace(az)] == [(0.0, 20), (5.0, 30), (10.0, 10)]
    (tmp_path / "e.jsonl").write_text("")
    (tmp_path / "e.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    assert load_trace(tmp_path / "e.jsonl") == [] and load_trace(tmp_path / "e.csv") == []


def test_capture_rotation_torn_lines_and_restart(tmp_path):
    w = CaptureWriter(tmp_path, max_bytes=600)
    recs = [TraceRecord(arrival_s=float(i), input_tokens=i + 1, output_tokens=2, source="capture", ttft_s=0.1,
                        prompt_text="secret") for i in range(20)]
    for r in recs:
        w.write(r)
    w.close()
    assert len(capture_files(tmp_path)) > 2  # rotated
    back = read_capture_dir(tmp_path)
    assert [r.input_tokens for r in back] == [r.input_tokens for r in recs]
    assert all(r.prompt_text is None for r in back)  # no prompt text unless opted in
    # a crash mid-write leaves a torn last line: skipped on read, and a restarted writer starts a fresh line
    with open(tmp_path / CURRENT, "ab") as f:
        f.write(b'{"arrival_s": 99, "input_tok')
    assert len(read_capture_dir(tmp_path)) == 20
    w2 = CaptureWriter(tmp_path, max_bytes=10**6, keep_prompt_text=True)
    w2.write(TraceRecord(arrival_s=100.0, input_tokens=7, output_tokens=1, prompt_text="kept"))
    w2.close()
    back = read_capture_dir(tmp_path)
    assert len(back) == 21 and back[-1].input_tokens == 7 and back[-1].prompt_text == "kept"
    assert load_trace(tmp_path / CURRENT, lenient=True)  # the importer reads capture files too


def test_profile_cli(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pipelines.cli", "profile", "--trace",
                        str(SHARED / "AzureLLMInferenceTrace_conv.csv")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["requests"] == 19366 and out["input_p50"] == 1020.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    r = subprocess.run([sys.executable, "-m", "pipelines.cli", "profile", "--trace", str(bad), "--format", "mooncake"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "bad.jsonl:1" in r.stderr and "Traceback" not in r.stderr
