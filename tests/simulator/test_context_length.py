"""Each model preset carries its context (its Hugging Face config's max_position_embeddings), a folder its own,
and a workload whose longest sequence does not fit it is refused in one line by the plan and the search."""

import json

import pytest
from pydantic import ValidationError

from hybridflow.planner.request import SearchRequest
from hybridflow.simulator.vocabulary.hardware import ClusterSpec
from hybridflow.simulator.vocabulary.model import MODEL_PRESETS, ModelSpec, model_preset
from hybridflow.simulator.vocabulary.workload import Workload

H100 = ClusterSpec(hardware="h100-80g", nodes=1, devices_per_node=8)


def test_every_preset_states_its_context_and_a_folder_reads_its_own(tmp_path):
    assert all(spec.context_len for spec in MODEL_PRESETS.values())
    assert (model_preset("llama2-7b").context_len, model_preset("qwen2.5-7b").context_len,
            model_preset("tiny").context_len) == (4096, 131072, 2048)
    # the decoder a preset builds says it in its config, and reading that config back gives it again
    assert model_preset("llama2-7b").decoder_config().max_position_embeddings == 4096
    hf = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 128,
          "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
          "max_position_embeddings": 777}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert ModelSpec.from_hf_config(tmp_path).context_len == 777


@pytest.mark.parametrize("workload,fits", [
    (Workload(prompts=8, prompt_len=1024, response_len=3072), True),  # exactly 4,096
    (Workload(prompts=8, prompt_len=1024, response_len=3073), False),
    (Workload(prompts=8, prompt_len=1024, response_lengths={"mean": 2000, "max": 16000}), False),
])
def test_the_search_refuses_lengths_beyond_the_models_context(workload, fits):
    make = lambda: SearchRequest.for_algorithm("grpo", model_preset("llama2-7b"), H100, workload)  # noqa: E731
    if fits:
        make()
        return
    with pytest.raises(ValidationError, match=r"is beyond llama2-7b's context of 4096 \(its max_position_embeddings\)"):
        make()
    # a model of unstated context is not checked; one of a longer context takes it
    SearchRequest.for_algorithm("grpo", model_preset("llama2-7b").model_copy(update={"context_len": None}), H100,
                                workload)
    SearchRequest.for_algorithm("grpo", model_preset("qwen2.5-7b"), H100, workload)


def test_a_plan_beyond_the_context_is_one_plain_sentence(tmp_path):
    # the Plan's whole-object check names its own fields: no "field '(top level)'" and no pydantic "Value error, "
    from pathlib import Path

    from hybridflow.simulator.errors import HflowError
    from hybridflow.simulator.vocabulary.plan import Plan

    data = json.loads((Path(__file__).parents[2] / "examples/plans/tiny-local.json").read_text())
    data["workload"]["response_len"] = 4000  # tiny's context is 2,048
    path = tmp_path / "long.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HflowError) as e:
        Plan.load(path)
    text = str(e.value)
    assert "context" in text and "(top level)" not in text and "Value error" not in text, text
