"""The dispatch probe: the single controller's gap between dependent calls on a real WorkerGroup."""

import pytest

from hybridflow.simulator.calibration.profile import ProfilePoint


def test_dispatch_gaps_between_dependent_and_queued_calls(ray_local):
    from hybridflow.runtime.measure.dispatch_probe import measure_dispatch

    dependent, queued = measure_dispatch(devices=2, batch=8, seq_len=12, calls=6)
    for point, mode in ((dependent, "dependent"), (queued, "queued")):
        assert isinstance(point, ProfilePoint) and point.op == "dispatch" and point.mode == mode
        assert point.group_size == 2 and point.batch == 8 and point.prompt_len == 12
        assert point.repeats == 6  # one gap of each kind per timed pair
        # a Ray round trip with a small batch: more than nothing, far less than a second
        assert 1e-5 < point.seconds < 0.5
    assert dependent.label() == "dispatch dependent b8×12 ×2"
    ray = pytest.importorskip("ray")
    assert ray.is_initialized()  # the session's cluster is left running for the other tests
