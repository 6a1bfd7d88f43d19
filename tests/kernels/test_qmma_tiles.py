"""The tensor-core kernel's tile tables per device (kernels/linear/tile_table.py): file names, a round trip through
disk, lookups that autotune nothing, clear errors for a corrupt table, and the file a benchmark keeps
(bench/lib/tiles.py). All of it without a GPU: the device's name is the caller's."""
from __future__ import annotations

import json
import re

import pytest

from kernels.linear import qmma_triton
from kernels.linear.tile_table import (ENV, FOLDER, TileChoices, TileEntry, TileKey, TileTableError, device_slug,
                                       parse_table, read_table, table_json, table_name, triton_minor, write_table)

H100 = "NVIDIA H100 80GB HBM3"
TILES = {"block_n": 64, "block_k": 256, "split_k": 2, "num_warps": 4, "num_stages": 4, "fused": 1}
KEY = TileKey(16, 6144, 4096, "fp8", 2)


def _entry(key: TileKey = KEY, **tiles) -> TileEntry:
    return TileEntry(key, {**TILES, **tiles}, 0.0143, pdl=1)


def _no_autotune() -> TileEntry:
    raise AssertionError("autotuned a shape the table holds")


def _json(**over) -> dict:
    entry = {**_entry().to_json(), **over.pop("entry", {})}
    return {"device": H100, "triton": "3.6", "entries": [entry], **over}


def test_slug_and_file_name():
    assert device_slug(H100) == "nvidia-h100-80gb-hbm3"
    assert device_slug("NVIDIA H200") == "nvidia-h200"
    assert device_slug("  NVIDIA GeForce RTX 4090 (rev. A)") == "nvidia-geforce-rtx-4090-rev-a"
    assert triton_minor("3.6.0") == "3.6" and triton_minor("3.10.1+git1234") == "3.10"
    assert table_name(H100, "3.6") == "nvidia-h100-80gb-hbm3.triton-3.6.json"


def test_round_trip_through_disk(tmp_path):
    tuned = TileChoices(tmp_path / "tiles", triton="3.6")
    keys = [KEY, TileKey(32, 28672, 4096, "int8", 0), TileKey(64, 4096, 14336, "fp8", 1)]
    for i, key in enumerate(keys):
        got = tuned.choose(H100, key, lambda i=i: _entry(block_n=64 << (i % 2), fused=i % 2))
        assert got.autotuned and got.key == key
    assert tuned.autotuned_devices() == [H100]
    path = tuned.save(tmp_path / "out" / "tile-table.json", H100)
    assert not list(path.parent.glob(".*tmp"))  # the temporary file replaced the table
    back = read_table(path, H100, "3.6")
    assert back == {e.key: TileEntry(e.key, e.tiles, e.ms, e.pdl) for e in tuned.entries(H100)}
    obj = json.loads(path.read_text())
    assert obj["device"] == H100 and obj["triton"] == "3.6" and len(obj["entries"]) == 3
    assert tuned.to_json(H100)["entries"] == obj["entries"]

    # the file in the package's folder, under its device's name: a fresh process takes its tiles, timing nothing
    (tmp_path / "tiles").mkdir()
    path.rename(tmp_path / "tiles" / table_name(H100, "3.6"))
    fresh = TileChoices(tmp_path / "tiles", triton="3.6")
    for key in keys:
        assert fresh.choose(H100, key, _no_autotune).tiles == back[key].tiles
    assert fresh.autotuned_devices() == []
    assert [e.key for e in fresh.entries(H100)] == keys  # loaded entries are what this process chose too


def test_lookup_uses_the_extra_table_first_and_autotunes_only_what_it_lacks(tmp_path, monkeypatch):
    folder = tmp_path / "tiles"
    write_table(folder / table_name(H100, "3.6"), table_json(H100, "3.6", [_entry(block_n=128)]))
    extra = tmp_path / "mine.json"
    write_table(extra, table_json(H100, "3.6", [_entry(split_k=4)]))
    monkeypatch.setenv(ENV, str(extra))
    tuned = TileChoices(folder, triton="3.6")
    assert tuned.choose(H100, KEY, _no_autotune).tiles == {**TILES, "split_k": 4}  # the extra file's wins
    other = TileKey(16, 4096, 4096, "fp8", 0)
    assert tuned.choose(H100, other, lambda: _entry(other, fused=0)).autotuned
    assert tuned.choose(H100, other, _no_autotune).tiles == {**TILES, "fused": 0}  # once per process
    # autotuning extends the extra file, keeping what it held
    assert set(read_table(extra, H100, "3.6")) == {KEY, other}
    assert read_table(folder / table_name(H100, "3.6"), H100, "3.6")[KEY].tiles["block_n"] == 128  # untouched


def test_a_device_without_its_own_table_takes_its_siblings_until_it_has_one(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    folder = tmp_path / "tiles"
    write_table(folder / table_name("NVIDIA H200", "3.6"), table_json("NVIDIA H200", "3.6", [_entry(block_n=128)]))
    got = TileChoices(folder, triton="3.6").choose(H100, KEY, _no_autotune)  # the H200's, not autotuned
    assert got.tiles["block_n"] == 128 and not got.autotuned
    other = TileKey(16, 4096, 4096, "fp8", 0)  # a shape the sibling lacks is autotuned as before
    assert TileChoices(folder, triton="3.6").choose(H100, other, lambda: _entry(other)).autotuned
    write_table(folder / table_name(H100, "3.6"), table_json(H100, "3.6", [_entry(block_n=32)]))
    assert TileChoices(folder, triton="3.6").choose(H100, KEY, _no_autotune).tiles["block_n"] == 32  # its own
    assert TileChoices(folder, triton="3.6").choose("NVIDIA A100-SXM4-80GB", KEY, _entry).autotuned  # no sibling


def test_a_missing_table_autotunes(tmp_path):
    tuned = TileChoices(tmp_path / "nothing here", triton="3.6")
    assert tuned.choose(H100, KEY, _entry).autotuned


def test_a_corrupt_table_is_an_error_naming_the_file(tmp_path):
    folder = tmp_path / "tiles"
    folder.mkdir()
    path = folder / table_name(H100, "3.6")
    for text in ('{"device": "NVIDIA H100 80GB HBM3", "triton": "3.6", "entries": [', "[]",
                 json.dumps({"device": H100, "entries": []}), json.dumps(_json(more=1))):
        path.write_text(text)
        with pytest.raises(TileTableError, match=re.escape(str(path))):
            TileChoices(folder, triton="3.6").choose(H100, KEY, _entry)


@pytest.mark.parametrize("bad", [{"blockn": 64}, {"block_n": "64"}, {"block_n": 0}, {"split_k": -2},
                                 {"num_warps": 4.0}, {"num_stages": True}, {"fused": 2}, {"block_k": 96}])
def test_invalid_tiles_are_an_error(tmp_path, bad):
    path = tmp_path / table_name(H100, "3.6")
    obj = _json()
    obj["entries"][0]["tiles"].update(bad)
    path.write_text(json.dumps(obj))
    with pytest.raises(TileTableError, match=re.escape(str(path)) + ": entry 0"):
        TileChoices(tmp_path, triton="3.6").choose(H100, KEY, _entry)
    with pytest.raises(TileTableError):  # nor is such a table written
        write_table(tmp_path / "out.json", obj)


@pytest.mark.parametrize("bad", [{"kind": "fp4"}, {"prologue": 3}, {"block_m": 24}, {"n": 0}, {"ms": "fast"},
                                 {"pdl": -1}, {"extra": 1}])
def test_invalid_entries_are_an_error(bad):
    with pytest.raises(TileTableError, match="t.json: entry 0"):
        parse_table(_json(entry=bad), "t.json")


def test_another_devices_or_tritons_table_or_a_second_entry_is_an_error():
    with pytest.raises(TileTableError, match="not of this device"):
        parse_table(_json(), "t.json", device_name="NVIDIA H200")
    with pytest.raises(TileTableError, match="Triton 3.6, not of this one"):
        parse_table(_json(), "t.json", device_name=H100, triton="3.5")
    obj = _json()
    obj["entries"].append(dict(obj["entries"][0]))
    with pytest.raises(TileTableError, match="entry 1: a second entry"):
        parse_table(obj, "t.json")


def test_the_committed_tables_parse_under_their_own_names():
    for path in FOLDER.glob("*.json"):
        obj = json.loads(path.read_text())
        assert path.name == table_name(obj["device"], obj["triton"]), path
        assert read_table(path, obj["device"], obj["triton"])


def test_a_benchmark_keeps_what_it_autotuned(tmp_path, monkeypatch):
    from bench.lib.tiles import keep_tiles, tiles_kept

    tuned = TileChoices(tmp_path / "tiles", triton="3.6")
    monkeypatch.setattr(qmma_triton, "_TUNED", tuned)
    with tiles_kept(tmp_path / "a"):
        pass
    assert not (tmp_path / "a").exists()  # nothing autotuned: nothing written, no GPU asked
    tuned.choose(H100, KEY, _entry)
    with pytest.raises(KeyboardInterrupt), tiles_kept(tmp_path / "b"):
        raise KeyboardInterrupt  # an interrupted run keeps its tiles too
    assert read_table(tmp_path / "b" / "tile-table.json", H100, "3.6")[KEY].tiles == TILES
    assert qmma_triton.tuned_entries(H100) == tuned.to_json(H100)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "tile-table.json").write_text(json.dumps({**_json(), "device": "NVIDIA H200"}))
    assert keep_tiles(tmp_path / "c") == []  # another device's file there: said, not raised
