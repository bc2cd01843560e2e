import pytest
from sim_util import make_plan

from hybridflow.simulator import ClusterSpec, ParallelConfig, Plan, Workload, hardware_preset, model_preset
from hybridflow.simulator.pricing.activations import activation_bytes_per_token_layer
from hybridflow.simulator.pricing.cost import CostModel, price_op
from hybridflow.simulator.pricing.memory import (
    InfeasibleError,
    fits_on,
    forward_transient,
    kv_bytes_per_sequence,
    min_devices,
    role_memory,
    train_transient,
)
from hybridflow.simulator.pricing.plan_memory import check_plan_memory, kv_free_bytes, plan_memory

A100 = hardware_preset("a100-80g")
GiB = 2**30
L7, L70 = model_preset("llama2-7b"), model_preset("llama2-70b")
W = Workload(prompts=256, prompt_len=512, response_len=512, micro_batch_size=4)


def test_llama2_70b_actor_with_adam_does_not_fit_one_a100():
    mem = role_memory(L70, "lm", ParallelConfig(), W, trainable=True, hardware=A100)
    n = L70.num_params()
    assert mem.weights == pytest.approx(2 * n) and mem.gradients == pytest.approx(2 * n)
    assert mem.optimizer == pytest.approx(12 * n)  # fp32 master + Adam m, v
    assert mem.weights + mem.gradients + mem.optimizer == pytest.approx(16 * n)  # ~1.03 TiB
    with pytest.raises(InfeasibleError) as err:
        mem.require_fits(A100, "actor llama2-70b on 1 device")
    msg = str(err.value)
    assert "\n" not in msg
    for part in ("weights 128.5", "gradients 128.5", "optimizer 770.9", "activations", "a100-80g", "76.0 GiB"):
        assert part in msg


def test_states_shard_over_all_devices():
    one = role_memory(L7, "lm", ParallelConfig(), W, trainable=True, hardware=A100)
    eight = role_memory(L7, "lm", ParallelConfig(pp=2, tp=2, dp=2), W, trainable=True, hardware=A100)
    for part in ("weights", "gradients", "optimizer"):
        assert getattr(eight, part) == pytest.approx(getattr(one, part) / 8)
    frozen = role_memory(L7, "scalar", ParallelConfig(dp=4), W, trainable=False, hardware=A100)
    assert frozen.weights == pytest.approx(2 * L7.num_params("scalar") / 4)
    assert frozen.optimizer == frozen.gradients == 0.0


def test_activations_by_hand_and_recompute():
    # Llama-2-7B, bf16, per token and layer. Fused (megatron: Korthikanti's count): the norms' inputs and the
    # matmuls' inputs (4·h), q, k, v and the attention output, the SwiGLU's gate, up, act and product (4·ffn)
    fused = 8 * 4096 + 4 * 4096 + 4 * 4096 + 8 * 11008
    assert activation_bytes_per_token_layer(L7, 1, "megatron") == fused
    assert activation_bytes_per_token_layer(L7, 4, "megatron") == 8 * 4096 + (4 * 4096 + 4 * 4096 + 8 * 11008) / 4
    # eager (this runtime's FSDP decoder): each norm keeps an fp32 copy of its input, its normalised output and
    # that times the weight; the output projection its own copy of the attention output
    eager = 2 * (4 + 2 * 2) * 4096 + 2 * (3 * 4096 + 2 * 4096) + 8 * 11008
    assert activation_bytes_per_token_layer(L7, 1) == eager
    assert activation_bytes_per_token_layer(L7, 1, element_bytes=4) == 2 * 3 * 4 * 4096 + 4 * (5 * 4096) + 16 * 11008
    tokens = 4 * 1024
    final_norm, first_gradients, logits = 8 * 4096, 2 * (11008 + 4096), 32000 * (2 + 4 + 2)
    full = train_transient(L7, "lm", ParallelConfig(), W)
    assert full.activations == pytest.approx(tokens * (32 * eager + final_norm + first_gradients + logits))
    megatron = train_transient(L7, "lm", ParallelConfig(backend="megatron"), W)
    assert megatron.activations == pytest.approx(tokens * (32 * fused + 4 * 4096 + first_gradients + logits))
    # a forward without gradients: one layer's working set (3·ffn + 3·h) and the logits with their log-softmax
    fwd = forward_transient(L7, "lm", ParallelConfig(), W)
    assert fwd.activations == pytest.approx(tokens * (2 * (3 * 11008 + 3 * 4096) + 32000 * 6))
    rec = train_transient(L7, "lm", ParallelConfig(), W, recompute=True)
    assert rec.activations < full.activations / 5
    # 1F1B: the first stage keeps pp micro-batches in flight over layers/pp layers → same total as pp=1
    pp4 = train_transient(L7, "scalar", ParallelConfig(pp=4), W)
    assert pp4.activations == pytest.approx(train_transient(L7, "scalar", ParallelConfig(), W).activations, rel=1e-6)


def test_kv_cache_per_sequence_and_gqa():
    assert kv_bytes_per_sequence(L7, ParallelConfig(), 1024) == 1024 * 2 * 32 * 4096 * 2
    assert kv_bytes_per_sequence(L7, ParallelConfig(tp=4, pp=2), 1024) == 1024 * 2 * 32 * 4096 * 2 / 8
    # Llama-2-70B has 8 kv heads: tp=8 leaves one per device
    assert kv_bytes_per_sequence(L70, ParallelConfig(tp=8), 100) == 100 * 2 * 80 * 1 * 128 * 2


def test_fits_on_and_min_devices():
    cl = ClusterSpec(hardware=A100, nodes=16, devices_per_node=8)
    assert not fits_on([(L70, "actor")], 1, W, cl)
    n = min_devices([(L70, "actor")], W, cl)
    # 16 B/param of a 69B model is 1.03 TiB: at least 14 devices of 76 GiB usable
    assert n is not None and 14 <= n <= 20 and fits_on([(L70, "actor")], n, W, cl)
    four = [(L70, "actor"), (L70, "critic"), (L70, "ref"), (L70, "reward")]
    colocated = min_devices(four, W, cl)
    assert colocated > n
    assert min_devices(four, W, cl, offload=True) < colocated  # idle states go to host memory
    assert min_devices([(L7, "ref")], W, cl) == 1
    assert min_devices([(L70, "actor")] * 20, W, ClusterSpec(hardware=A100, nodes=1)) is None


def test_plan_memory_colocated_sum_and_offload():
    plan = make_plan()
    mem = plan_memory(plan)
    assert set(mem) == {"actor", "critic", "ref", "reward"}
    peaks = {m.bytes_per_device for m in mem.values()}
    assert len(peaks) == 1  # one group: one peak per device
    peak = peaks.pop()
    n = L7.num_params()
    states = (16 * n + 16 * L7.num_params("scalar") + 2 * n + 2 * L7.num_params("scalar")) / 8
    # without offload every model's states stay resident, plus the running op's transient
    assert peak > states
    assert all(m.fits for m in mem.values())
    assert mem["actor"].breakdown.total == pytest.approx(peak)
    off = plan_memory(make_plan(offload=True))
    assert off["actor"].bytes_per_device < peak
    # the peak with offload holds one model's states
    assert off["actor"].breakdown.optimizer <= 12 * n / 8 + 1


def test_generation_batch_grows_with_offload():
    plain, off = make_plan(), make_plan(offload=True)
    assert kv_free_bytes(off) > kv_free_bytes(plain) > 0
    assert plan_memory(off)["actor"].decode_batch >= plan_memory(plain)["actor"].decode_batch
    cm = CostModel(plain.cluster)
    assert price_op(cm, off, "generate", "actor").seconds <= price_op(cm, plain, "generate", "actor").seconds


def test_check_plan_memory_names_the_group_and_breakdown():
    plan = make_plan(model="llama2-70b")
    with pytest.raises(InfeasibleError, match=r"group 'all' \(actor, critic, ref, reward\).*optimizer"):
        check_plan_memory(plan)
    assert not plan_memory(plan)["critic"].fits


def test_actor_generation_fills_free_memory_with_kv_cache():
    gen = ParallelConfig(tp=2, dp=4)
    mem = role_memory(L7, "lm", ParallelConfig(tp=2, dp=4), Workload(prompts=4096, micro_batch_size=2), trainable=True,
                      hardware=A100, gen=gen)
    assert mem.kv_cache > 0
    assert mem.kv_cache % kv_bytes_per_sequence(L7, gen, 2048) == 0  # whole sequences
    assert mem.total <= 80 * GiB * 0.95


def test_rollout_memory_fraction_caps_the_kv_cache():
    plan = make_plan()  # llama2-7b generating with tp 1 beside the four models' states
    gen, room = ParallelConfig(tp=1, dp=8), kv_free_bytes(plan)

    def with_fraction(f):
        actor = plan.roles["actor"].model_copy(update={"rollout_memory_fraction": f})
        return plan.model_copy(update={"roles": {**plan.roles, "actor": actor}})

    # vLLM's gpu_memory_utilization holds the engine's bf16 weights and its KV cache: 0.3 · 80 GiB less 2 bytes a
    # parameter leaves 22 sequences of 1,024 tokens (512 MiB each), and their fp32 logits come off the room
    cap = 0.3 * 80 * GiB - 2 * L7.num_params("lm")
    assert kv_bytes_per_sequence(L7, gen, 1024) == 512 * 2**20 and int(cap // (512 * 2**20)) == 22 < room / 2**29
    assert kv_free_bytes(with_fraction(0.3)) == pytest.approx(cap - 22 * L7.vocab * 4)
    assert plan_memory(with_fraction(0.3))["actor"].decode_batch == 22
    assert kv_free_bytes(with_fraction(1.0)) == room  # a share above what the states leave changes nothing


def test_separate_generation_devices():
    groups = {"all": [(0, i) for i in range(8)], "rollout": [(1, i) for i in range(8)]}
    plan = make_plan(nodes=2, groups=groups)
    plan.roles["actor"].generate_group = "rollout"
    mem = plan_memory(plan)
    a = mem["actor"]
    assert a.generate_bytes_per_device is not None and a.generate_bytes_per_device < a.bytes_per_device
    assert a.fits and a.decode_batch > 0
    # the rollout devices hold only generation weights and KV: more room than beside the training states
    assert kv_free_bytes(plan) > kv_free_bytes(make_plan())
    cm = CostModel(plan.cluster)
    broadcast = price_op(cm, plan, "reshard", "actor")
    assert broadcast.bytes == pytest.approx(2 * L7.num_params())  # the whole model every iteration
    assert broadcast.seconds > price_op(cm, make_plan(), "reshard", "actor").seconds


def _plan_on(n, configs, offload=False):
    """All four 7B models colocated on the first n devices of one node with the given train configs
    (generation in the training layout)."""
    data = make_plan(offload=offload).model_dump()
    data["groups"] = [{"name": "all", "devices": [{"node": 0, "index": i} for i in range(n)]}]
    for role, cfg in configs.items():
        data["roles"][role]["train"] = cfg.model_dump()
    data["roles"]["actor"]["generate"] = None
    return Plan.model_validate(data)


def test_min_devices_agrees_with_plan_memory():
    from hybridflow.simulator.pricing.memory import _configs

    cl = ClusterSpec(hardware=A100, nodes=1, devices_per_node=8)
    roles = ("actor", "critic", "ref", "reward")
    for offload in (False, True):
        n = min_devices([(L7, r) for r in roles], W, cl, offload=offload)
        assert n is not None and 1 < n <= 8
        # on n devices some layout fits; on n - 1 no uniform layout does
        fitting = [c for c in _configs(L7, n, 8)
                   if all(m.fits for m in plan_memory(_plan_on(n, dict.fromkeys(roles, c), offload)).values())]
        assert fitting
        for c in _configs(L7, n - 1, 8):
            assert not all(m.fits for m in plan_memory(_plan_on(n - 1, dict.fromkeys(roles, c), offload)).values())
