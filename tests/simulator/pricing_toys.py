"""The toy device and model the pricing tests compute their figures on by hand (on the tests' pythonpath)."""

from hybridflow.simulator import ClusterSpec, ParallelConfig, Plan, Workload
from hybridflow.simulator.vocabulary.hardware import HardwareSpec
from hybridflow.simulator.vocabulary.mechanics import Mechanics
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.units import GiB

# A toy device of round figures: 1 TFLOP/s, 100 GB/s HBM, 10 GB/s NVLink (10 us), an 8 GB/s NIC per node (20 us);
# a test that prices the host link sets its own `host_bandwidth` (HW.model_copy).
HW = HardwareSpec(name="toy-gpu", peak_flops=1e12, hbm_bandwidth=1e11, hbm_bytes=64 * GiB,
                  intra_node_bandwidth=1e10, inter_node_bandwidth=8e9, intra_node_latency=1e-5,
                  inter_node_latency=2e-5)
# A llama-like toy: 2 layers, hidden 64, 4 heads of 16, MHA, SwiGLU 128 wide, vocabulary 100, untied head.
TOY = ModelSpec(name="toy", layers=2, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=100)
LAYER = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64  # q, k, v, o; gate, up, down; two norms
PARAMS = 100 * 64 + 2 * LAYER + 64 + 100 * 64  # embedding, layers, final norm, head
M_BYTES = 2 * PARAMS  # the bf16 weights
# NVLink at half its line rate (5 GB/s), the NIC likewise (4 GB/s): round collective times
LINKS = dict(intra_link_efficiency=0.5, inter_link_efficiency=0.5)


def cluster(nodes=1, per_node=8, hw=HW):
    return ClusterSpec(hardware=hw, nodes=nodes, devices_per_node=per_node)


def mech_plan(mechanics: Mechanics = Mechanics(), mini_batches: int = 4, **fields) -> Plan:
    """PPO on the tiny preset: actor and ref on 2 devices (training tp 2, generation dp 2), the critic on 1."""
    from rl_util import tiny_plan

    w = Workload(prompts=16, prompt_len=16, response_len=8, micro_batch_size=2, mini_batches=mini_batches)
    plan = tiny_plan("ppo", devices=[2, 1], train={"actor": ParallelConfig(tp=2), "ref": ParallelConfig(tp=2)},
                     generate=ParallelConfig(dp=2), workload=w)
    return Plan.model_validate({**plan.model_dump(), "mechanics": mechanics.model_dump(), **fields})
