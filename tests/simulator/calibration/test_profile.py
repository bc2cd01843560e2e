"""The Profile schema: validation of points, versioning, files, the shipped profile."""

import json

import pytest

from hybridflow.simulator import HflowError, ParallelConfig, model_preset
from hybridflow.simulator.calibration.profile import (
    Fingerprint,
    Profile,
    ProfilePoint,
    resolve_profile,
    shipped_profile_path,
)
from hybridflow.simulator.vocabulary.hardware import HardwareSpec

HW = HardwareSpec(name="cpu-test", peak_flops=1e10, hbm_bandwidth=1e9, hbm_bytes=8e9, intra_node_bandwidth=1e8,
                  inter_node_bandwidth=1e8)
TINY = model_preset("tiny")


def profile(points=None) -> Profile:
    points = points if points is not None else [
        ProfilePoint(op="forward", model=TINY, batch=8, prompt_len=16, response_len=16, seconds=0.02, std=0.001,
                     repeats=3),
        ProfilePoint(op="generate", model=TINY, parallel=ParallelConfig(tp=2), batch=4, prompt_len=8, response_len=8,
                     seconds=0.3, repeats=3),
        ProfilePoint(op="allreduce", size_bytes=2**20, group_size=2, seconds=0.004),
    ]
    return Profile(name="t", fingerprint=Fingerprint(devices=2, device_name="test cpu", cpu_count=2), hardware=HW,
                   points=points)


def test_round_trip_through_a_file(tmp_path):
    p = profile()
    path = p.save(tmp_path / "p.json")
    back = Profile.load(path)
    assert back == p
    assert back.by_op()["generate"][0].parallel.tp == 2
    assert back.cluster().devices_per_node == 2
    assert back.summary()["forward"]["points"] == 1
    assert back.summary()["forward"]["median_rel_std"] == pytest.approx(0.05)


def test_model_by_preset_name():
    pt = ProfilePoint.model_validate({"op": "train", "model": "tiny", "batch": 4, "prompt_len": 4, "response_len": 4,
                                      "seconds": 0.1})
    assert pt.model == TINY
    assert pt.label() == "train tiny 1-1-1 b4 4+4"


@pytest.mark.parametrize("fields, why", [
    ({"op": "forward", "batch": 4, "prompt_len": 4}, "needs its model shape"),
    ({"op": "train", "model": "tiny", "seconds": 1}, "sequence length"),
    ({"op": "generate", "model": "tiny", "prompt_len": 4, "response_len": 0}, "response_len >= 1"),
    ({"op": "reshard", "model": "tiny"}, "generation layout"),
    ({"op": "allgather", "group_size": 2}, "size_bytes > 0"),
    ({"op": "forward", "model": "tiny", "prompt_len": 4, "seconds": 0}, "greater than 0"),
    ({"op": "broadcast", "size_bytes": 4}, "Input should be"),
])
def test_incomplete_points_are_rejected(fields, why):
    data = {"seconds": 0.5, **fields}
    with pytest.raises(ValueError, match=why):
        ProfilePoint.model_validate(data)


def test_bad_files_end_in_one_line(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(HflowError, match="no such file"):
        Profile.load(missing)
    plan_like = tmp_path / "plan.json"
    plan_like.write_text(json.dumps({"version": 1, "groups": []}))
    with pytest.raises(HflowError, match="not a profile"):
        Profile.load(plan_like)
    future = tmp_path / "v9.json"
    future.write_text(json.dumps({**json.loads(profile().model_dump_json()), "version": 9}))
    with pytest.raises(HflowError, match="version 9 is not supported"):
        Profile.load(future)
    broken = tmp_path / "broken.json"
    broken.write_text(profile().model_dump_json().replace('"op":"forward"', '"op":"fwd"'))
    with pytest.raises(HflowError, match="points.0.op"):
        Profile.load(broken)


def test_unknown_shipped_profile_lists_the_known_ones():
    with pytest.raises(HflowError, match="unknown shipped profile .gpu-9000."):
        resolve_profile("gpu-9000")


def test_the_shipped_cpu_profile_loads_and_covers_every_op_kind():
    path = shipped_profile_path("cpu-2core")
    p = resolve_profile("cpu-2core")
    assert p == Profile.load(path)
    assert p.fingerprint.device_kind == "cpu" and p.fingerprint.dtype == "float32"
    ops = p.by_op()
    for kind in ("train", "forward", "generate", "reshard", "allreduce", "allgather", "dispatch", "matmul", "memory"):
        assert ops.get(kind), f"shipped profile has no '{kind}' points"
    # the engines' switch from an FSDP (dp-sharded) training layout: the dp gather the runtime runs
    assert {pt.parallel.dp for pt in ops["reshard"]} >= {1, 2}
    assert {pt.parallel.tp for pt in ops["generate"]} >= {1, 2}
    assert {pt.parallel.dp for pt in ops["train"]} >= {1, 2}
    assert len({pt.model.hidden for pt in ops["forward"]}) >= 3
    assert all(pt.repeats >= 3 for pt in ops["train"])


def test_megatron_points_name_their_engine():
    shape = dict(model="tiny", batch=8, prompt_len=16, response_len=16, seconds=0.1)
    point = ProfilePoint(op="megatron_train", parallel=ParallelConfig(tp=2, backend="megatron"), **shape)
    assert point.label().startswith("megatron_train tiny 1-2-1")
    with pytest.raises(ValueError, match="megatron_train / megatron_forward with backend megatron"):
        ProfilePoint(op="megatron_forward", parallel=ParallelConfig(tp=2), **shape)
    with pytest.raises(ValueError, match="megatron_train / megatron_forward with backend megatron"):
        ProfilePoint(op="train", parallel=ParallelConfig(tp=2, backend="megatron"), **shape)


def test_the_shipped_cpu_profile_has_the_megatron_engines_points():
    ops = resolve_profile("cpu-2core").by_op()
    for kind in ("megatron_train", "megatron_forward"):
        layouts = {(pt.parallel.pp, pt.parallel.tp, pt.parallel.dp) for pt in ops[kind]}
        assert layouts == {(1, 1, 2), (1, 2, 1), (2, 1, 1)}, kind
        assert all(pt.parallel.backend == "megatron" and pt.repeats >= 3 for pt in ops[kind])
