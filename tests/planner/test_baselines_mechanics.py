"""The generation loops of the baseline systems (simulator/pricing/baseline_mechanics.py) and DS-Chat's timers
(planner/published_systems.py), each term on hand-computed values."""

import pytest

from hybridflow.planner.baselines import SystemSettings, ds_chat
from hybridflow.planner.published_systems import deepspeed_chat_timers
from hybridflow.planner.request import SearchRequest
from hybridflow.simulator import ClusterSpec, Workload, hardware_preset, model_preset
from hybridflow.simulator.pricing.baseline_mechanics import (
    EAGER_LAYER_SECONDS,
    HYBRID_ENGINE_LLAMA_LAYER_SECONDS,
    HYBRID_ENGINE_OPT_LAYER_SECONDS,
    eager_decode_step,
    eager_generate_extra,
)
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.generation import decode_step
from hybridflow.simulator.schedule.schedule import simulate
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.timeline import Event, Timeline

CLUSTER = ClusterSpec(hardware=hardware_preset("a100-80g"), nodes=1, devices_per_node=8)
M7 = model_preset("llama2-7b")  # 32 layers, 32 KV heads of 128: 2·32·4096·2 = 524,288 KV bytes per token
KV_TOKEN = 524_288


def test_the_layer_costs_are_the_sources_figures():
    assert EAGER_LAYER_SECONDS == pytest.approx(0.039215686 / 32)  # 25.5 tok/s over 32 layers
    assert HYBRID_ENGINE_OPT_LAYER_SECONDS == pytest.approx(2.54 / 6144)  # 2.54 s over 256 steps of 24 layers
    assert HYBRID_ENGINE_LLAMA_LAYER_SECONDS == pytest.approx(7.0422535 / 8192)  # 50 s / 7.1 over 256 steps of 32
    assert M7.kv_bytes_per_token() == KV_TOKEN


def test_hf_generate_step_is_the_host_plus_the_gpu_with_the_cache_copied():
    cm = CostModel(CLUSTER)
    gen = ParallelConfig(tp=1, dp=8)
    s = eager_decode_step(cm, M7, gen, batch=8, context=1000.0)
    assert s["cpu_launch"] == pytest.approx(32 * 0.476e-3)  # 15.2 ms: every layer issued from Python
    assert s["kv_copy"] == pytest.approx(2 * 8 * 1000 * KV_TOKEN / cm.hbm)  # torch.cat reads + writes the cache
    assert s["gpu"] == decode_step(cm, M7, gen, 8, 1000.0)["step_seconds"]
    # the host waits for the GPU within the step: neither hides the other, at any batch
    assert s["step_seconds"] == pytest.approx(s["cpu_launch"] + s["gpu"] + s["kv_copy"])
    big = eager_decode_step(cm, M7, gen, batch=256, context=4000.0)
    assert big["step_seconds"] == pytest.approx(big["cpu_launch"] + big["gpu"] + big["kv_copy"])


def test_hybrid_engine_and_megatron_loops():
    cm = CostModel(CLUSTER)
    tp2 = ParallelConfig(tp=2, dp=4)
    he = eager_decode_step(cm, M7, tp2, batch=4, context=600.0, loop="hybrid-engine")
    assert he["kv_copy"] == 0.0  # the containers' cache is preallocated
    assert he["cpu_launch"] == pytest.approx(0.0275088)  # Llama's container: 50 s / 7.1 / 256 steps, all 32 layers
    assert he["step_seconds"] == he["cpu_launch"] > he["gpu"]  # 4 sequences of a 7B: the CPU sets the step
    opt = ModelSpec(name="opt-1.3b", layers=24, hidden=2048, heads=32, kv_heads=32, ffn=5461, vocab=50272)
    he_opt = eager_decode_step(cm, opt, tp2, batch=4, context=600.0, loop="hybrid-engine")
    assert he_opt["cpu_launch"] == pytest.approx(0.00992188)  # OPT's container: 2.54 s / 256 steps, all 24 layers
    pp4 = ParallelConfig(tp=2, pp=4, dp=1)
    mg = eager_decode_step(cm, M7, pp4, batch=8, context=600.0, loop="megatron")
    assert mg["cpu_launch"] == pytest.approx(32 / 25.5 / 32)  # all 32 layers, stage after stage
    assert mg["step_seconds"] == max(mg["cpu_launch"], mg["gpu"] + mg["kv_copy"])  # its CPU runs ahead of the GPU
    hf = eager_decode_step(cm, M7, pp4, batch=8, context=600.0, loop="hf-eager")
    assert hf["cpu_launch"] == pytest.approx(8 * 0.476e-3)  # one stage's 8 layers


def test_extra_seconds_of_a_call_over_the_serving_engine():
    cm = CostModel(CLUSTER)
    gen = ParallelConfig(tp=1, dp=8)
    # two tokens: one decode step after the prefill, priced at its midpoint context P + 1.5
    w = Workload(prompts=64, prompt_len=100, response_len=2)
    s = eager_decode_step(cm, M7, gen, 8, 101.5)
    one = s["cpu_launch"] + s["kv_copy"]  # HF generate: the host's time and the copies, over the serving step
    assert eager_generate_extra(cm, M7, gen, w, calls=3, batch=8) == pytest.approx(3 * one)
    # 33 tokens: 32 steps in 16 spans of 2, each at its span's midpoint context
    w = Workload(prompts=64, prompt_len=100, response_len=33)
    want = 0.0
    for i in range(16):
        s = eager_decode_step(cm, M7, gen, 8, 100 + 1 + (i + 0.5) * 2)
        want += 2 * (s["cpu_launch"] + s["kv_copy"])
    assert eager_generate_extra(cm, M7, gen, w, calls=1, batch=8) == pytest.approx(want)
    assert eager_generate_extra(cm, M7, gen, Workload(prompts=64, response_len=1), calls=5, batch=8) == 0.0


def test_deepspeed_chat_timers_leave_the_scoring_forwards_out():
    tl = Timeline(source="simulated", events=[
        Event(op="generate", role="actor", group="all", start=0.0, end=10.0),
        Event(op="actor_logprob", role="actor", group="all", start=10.0, end=12.0),
        Event(op="ref_logprob", role="ref", group="all", start=12.0, end=13.0),
        Event(op="actor_update", role="actor", group="all", start=13.0, end=17.0),
        Event(op="critic_update", role="critic", group="all", start=17.0, end=20.0),
    ])
    assert deepspeed_chat_timers(tl) == (10.0, 7.0)  # generate; the two updates; not the 3 s of forwards


def test_timers_on_a_ds_chat_plan():
    c = ClusterSpec(hardware=hardware_preset("a800-80g"), nodes=1, devices_per_node=8)
    req = SearchRequest.for_algorithm("ppo", M7, c, Workload(prompts=64, prompt_len=256, response_len=256))
    b = ds_chat(req, CostModel(c), SystemSettings(hybrid_engine=False, actor_zero_stage=2, generation_batch=8))
    tl = simulate(b.plan, CostModel(c))
    ops = tl.op_seconds()
    gen, train = deepspeed_chat_timers(tl)
    assert gen == ops["generate"] and train == ops["actor_update"] + ops["critic_update"]
    assert gen + train < tl.iteration_seconds()  # the forwards between them are in neither timer
