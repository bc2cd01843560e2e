"""`hflow-plan profile --check`: a profile's own reference points, re-timed on the same profiler."""

import pytest

pytest.importorskip("torch")

from hybridflow.runtime.measure.profile_check import SpeedCheck, check_speed, reference_jobs  # noqa: E402
from hybridflow.simulator.calibration.profile import ProfilePoint, resolve_profile  # noqa: E402
from hybridflow.simulator.errors import HflowError  # noqa: E402
from hybridflow.tools.cli import main  # noqa: E402

VOLATILE = {"seconds": 1.0, "std": 0.0, "repeats": 1, "bytes": 0.0, "flops": 0.0}


def test_reference_jobs_are_the_profiles_one_device_points_of_the_model():
    profile = resolve_profile("cpu-2core")
    jobs, seconds = reference_jobs(profile)
    assert len(jobs) == len(seconds) == 17 and {j["op"] for j in jobs} == {"train", "forward", "generate"}
    for job, recorded in zip(jobs, seconds, strict=True):
        point = ProfilePoint.model_validate({**job, "seconds": 1.0})
        assert point.model.name == "tiny" and point.parallel.world_size == 1
        same = [p.seconds for p in profile.points if p.model_copy(update=VOLATILE) == point.model_copy(update=VOLATILE)]
        assert same == [recorded]
    with pytest.raises(HflowError, match="no one-device"):
        reference_jobs(profile, model="llama-70b")
    # the quick check of `run` / `quickstart`: the cheap ones of the same points
    quick, quick_s = reference_jobs(profile, max_seconds=0.1)
    assert 0 < len(quick) < 17 and all(s <= 0.1 for s in quick_s)
    assert [j for j, s in zip(jobs, seconds, strict=True) if s <= 0.1] == quick


def test_check_speed_re_times_the_points_on_the_profiler():
    profile = resolve_profile("cpu-2core")
    # the smallest grid model: 17 points in a few seconds
    result = check_speed(profile, model="p64")
    jobs, then = reference_jobs(profile, model="p64")
    assert result.jobs == jobs and result.profiled == then and len(result.now) == 17
    assert all(t > 0 for t in result.now)
    assert result.ratios == [n / p for n, p in zip(result.now, then, strict=True)]
    # real timings of the same jobs on the same machine: the same order of magnitude as profiled
    assert 0.2 < result.index < 5.0


def test_speed_index_is_the_median_ratio():
    check = SpeedCheck(jobs=[{}, {}, {}], profiled=[1.0, 2.0, 4.0], now=[1.5, 2.0, 2.0])
    assert check.ratios == [1.5, 1.0, 0.5] and check.index == 1.0


def test_check_refuses_another_machines_profile(tmp_path, capsys):
    profile = resolve_profile("cpu-2core")
    other = profile.model_copy(update={"fingerprint": profile.fingerprint.model_copy(
        update={"device_name": "Some Other CPU", "cpu_count": 96})})
    path = tmp_path / "other.json"
    other.save(path)
    assert main(["profile", "--check", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Some Other CPU" in err[0] and "--out" in err[0]
    assert main(["profile", "--check", str(tmp_path / "missing.json")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.json"]
