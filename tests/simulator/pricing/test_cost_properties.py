"""Properties the cost model must keep for any valid input (hypothesis, seeded and bounded)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.simulator import ClusterSpec, ParallelConfig, Workload, hardware_preset, model_preset
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.memory import InfeasibleError

CM = CostModel(ClusterSpec(hardware=hardware_preset("a100-80g"), nodes=4, devices_per_node=8))
MODELS = [model_preset(n) for n in ("llama2-7b", "llama3-8b", "llama2-13b")]

workloads = st.builds(
    Workload,
    prompts=st.integers(1, 2048), prompt_len=st.integers(16, 2048), response_len=st.integers(1, 2048),
    samples_per_prompt=st.sampled_from([1, 4]), ppo_epochs=st.integers(1, 2), mini_batches=st.sampled_from([1, 2, 4]),
    micro_batch_size=st.sampled_from([1, 2, 8]),
)
configs = st.builds(ParallelConfig, pp=st.sampled_from([1, 2, 4]), tp=st.sampled_from([1, 2, 4, 8]),
                    dp=st.sampled_from([1, 2, 4]))


def well_formed(c):
    assert c.seconds > 0 and c.flops >= 0 and c.bytes >= 0
    assert all(v > 0 for v in c.breakdown.values())
    assert c.seconds == pytest.approx(sum(c.breakdown.values()))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(model=st.sampled_from(MODELS), par=configs, w=workloads)
def test_every_op_is_well_formed_and_grows_with_work(model, par, w):
    more = w.model_copy(update={"prompts": w.prompts * 2})
    for head in ("lm", "scalar"):
        t, t2 = CM.train(model, head, par, w), CM.train(model, head, par, more)
        f, f2 = CM.forward(model, head, par, w), CM.forward(model, head, par, more)
        for c in (t, t2, f, f2):
            well_formed(c)
        assert t2.seconds >= t.seconds and f2.seconds >= f.seconds
        assert CM.train(model, head, par, w, recompute=True).seconds > t.seconds
    try:
        g, g2 = CM.generate(model, par, w), CM.generate(model, par, more)
    except InfeasibleError:
        return  # not one full-length sequence fits beside the weights
    well_formed(g)
    assert g2.seconds >= g.seconds * (1 - 1e-9)
