"""DeepSpeed-Chat's --offload as its code runs it (dschat/rlhf/rlhf_engine.py, early 2024): offload_param with
offload_optimizer for actor, critic and reward, which DeepSpeed honours on a ZeRO-3 model only; OpenRLHF's
--adam_offload offloads the optimizer alone."""

from hybridflow.planner.baselines import SystemSettings, ds_chat, openrlhf_colocated
from hybridflow.planner.request import SearchRequest
from hybridflow.simulator import ClusterSpec, Workload, hardware_preset, model_preset
from hybridflow.simulator.pricing.cost import CostModel

CLUSTER = ClusterSpec(hardware=hardware_preset("a800-80g"), nodes=1, devices_per_node=8)
REQ = SearchRequest.for_algorithm("ppo", model_preset("llama2-7b"), CLUSTER,
                                  Workload(prompts=64, prompt_len=128, response_len=128, micro_batch_size=4,
                                           mini_batches=2), top_k=1)


def test_ds_chat_offload_keeps_its_zero3_models_parameters_in_host_memory():
    cm = CostModel(CLUSTER)
    stage2 = SystemSettings(hybrid_engine=False, actor_zero_stage=2, generation_batch=4, optimizer_offload=True)
    b2 = ds_chat(REQ, cm, stage2)
    assert b2.plan.mechanics.param_offload == ("critic", "reward")  # the actor at ZeRO-2 keeps its weights
    b3 = ds_chat(REQ, cm, stage2.model_copy(update={"actor_zero_stage": 3}))
    assert set(b3.plan.mechanics.param_offload) == {"actor", "critic", "reward"}
    assert ds_chat(REQ, cm, stage2.model_copy(update={"optimizer_offload": False})).plan.mechanics.param_offload == ()
    # OpenRLHF's DeepSpeed trainer: --adam_offload moves Adam's states only
    assert openrlhf_colocated(REQ, cm, stage2).plan.mechanics.param_offload == ()
