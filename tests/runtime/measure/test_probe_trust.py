"""The hardware probe's cache is not trusted forever (issue #39): a cache that a quick matmul now disagrees with (a
probe taken while the machine was busy), or one without a date, is measured again; a probe taken on a busy machine
says so. Every test works in its own $HFLOW_CACHE."""

import json
import time

import pytest

from hybridflow.runtime.measure import hardware_probe as hp

pytestmark = pytest.mark.slow


def _cache_file():
    world = hp.default_devices()
    hp.probe_hardware(world)  # measured once into this test's cache
    (path,) = hp.cache_dir().glob("hardware-*.json")
    return world, path


def test_a_poisoned_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("HFLOW_CACHE", str(tmp_path))
    world, path = _cache_file()
    data = json.loads(path.read_text())
    good = data["spec"]["peak_flops"]
    data["spec"]["peak_flops"] = good / 6  # what a probe on a busy machine read (16.8 vs 97.3 GFLOP/s in the issue)
    path.write_text(json.dumps(data))
    notes: list[str] = []
    hw = hp.probe_hardware(world, notes=notes)
    assert any("disagrees with a quick check now" in n and "measuring again" in n for n in notes), notes
    assert hw.peak_flops > 2 * good / 6  # measured again, not the poisoned figure
    assert json.loads(path.read_text())["spec"]["peak_flops"] == hw.peak_flops  # and cached


def test_an_undated_cache_is_measured_again_and_a_busy_probe_warns(tmp_path, monkeypatch):
    monkeypatch.setenv("HFLOW_CACHE", str(tmp_path))
    world, path = _cache_file()
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data["spec"]))  # the format of earlier versions: no date, no load
    notes: list[str] = []
    hp.probe_hardware(world, notes=notes)
    assert any("days old (or undated): measuring again" in n for n in notes), notes
    data = json.loads(path.read_text())
    assert time.time() - data["measured_at"] < 600
    data["load_average"] = 64.0  # far above this machine's cores
    path.write_text(json.dumps(data))
    notes = []
    hp.probe_hardware(world, notes=notes)
    assert any("the machine was busy while it was measured" in n and "--reprobe" in n for n in notes), notes


def test_reprobe_measures_again(tmp_path, monkeypatch):
    monkeypatch.setenv("HFLOW_CACHE", str(tmp_path))
    world, path = _cache_file()
    stamp = json.loads(path.read_text())["measured_at"]
    time.sleep(0.01)
    hp.probe_hardware(world, refresh=True)
    assert json.loads(path.read_text())["measured_at"] > stamp
