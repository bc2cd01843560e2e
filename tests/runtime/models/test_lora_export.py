"""A LoRA actor's weights out (models/lora_files.py, hf_export.py): the merged HF folder loads in transformers,
the peft adapter folder in peft on the base folder, both computing the LoRA engine's logits; the checkpoint's
`export` (one process, no Ray) writes the same folders, tensor for tensor."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from vllm_util import needs_vllm

from hybridflow.runtime.controller.locations import Location
from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine, OptimConfig
from hybridflow.runtime.models.hf_export import copy_model_files, export_checkpoint, export_engine
from hybridflow.runtime.models.lora_files import ADAPTER_FOLDER, write_peft_adapter
from hybridflow.runtime.workers.common import load_causal_lm
from hybridflow.simulator.vocabulary.lora import LoraConfig

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LORA = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))


def _nll(outputs, micro):
    mask = micro["attention_mask"][:, 1:].float()
    return -(outputs["log_probs"][:, 1:] * mask).sum() / mask.sum()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from rl_util import policy_folder

    root = tmp_path_factory.mktemp("lora-export")
    base = policy_folder(root / "base")
    engine = FsdpEngine(load_causal_lm(base), optim=OptimConfig(lr=1e-2, grad_clip=0.0), lora=LORA, lora_seed=1)
    ids = torch.randint(3, 40, (4, 12), generator=torch.Generator().manual_seed(0))
    batch = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, batch_size=[4])
    for _ in range(3):
        engine.train_step(batch, _nll)
    export_engine(engine, "actor", root / "out" / "actor", source=base, rank=0)
    # a checkpoint as the worker writes it (workers/common.py EngineState.save on one rank)
    ckpt = root / "ckpt" / "actor"
    engine.save(ckpt)
    copy_model_files(base, ckpt)
    write_peft_adapter(ckpt / ADAPTER_FOLDER, engine.adapter_tensors(), LORA, LORA.target_modules, str(base))
    with torch.no_grad():
        logits = engine.model(ids)
    return dict(root=root, base=base, ids=ids, logits=logits)


def test_merged_folder_loads_in_transformers(trained):
    hf = transformers.AutoModelForCausalLM.from_pretrained(trained["root"] / "out" / "actor", dtype=torch.float32)
    with torch.no_grad():
        got = hf(trained["ids"]).logits
    torch.testing.assert_close(got, trained["logits"], rtol=0, atol=1e-4)


def test_adapter_folder_loads_in_peft_on_the_base(trained):
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(trained["base"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, trained["root"] / "out" / "actor" / ADAPTER_FOLDER)
    with torch.no_grad():
        got = model(trained["ids"]).logits
        torch.testing.assert_close(got, trained["logits"], rtol=0, atol=1e-4)
        with model.disable_adapter():  # and without them: the base, not the trained policy
            assert not torch.allclose(model(trained["ids"]).logits, trained["logits"], atol=1e-3)


def test_checkpoint_export_equals_the_live_export(trained):
    from safetensors.torch import load_file

    root = trained["root"]
    export_checkpoint({"actor": Location(root / "ckpt" / "actor")}, root / "from-ckpt")
    live = load_file(root / "out" / "actor" / "model.safetensors")
    again = load_file(root / "from-ckpt" / "actor" / "model.safetensors")
    assert live.keys() == again.keys() and all(torch.equal(live[k], again[k]) for k in live)
    assert not any("lora" in k or "base_layer" in k for k in live)
    adapter = root / "from-ckpt" / "actor" / ADAPTER_FOLDER
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_export_loads_in_vllm_merged_and_as_an_adapter(trained):
    """The merged folder as a vLLM model, and the base folder with the peft adapter folder as a LoRARequest:
    both decode greedily what transformers decodes from the merged folder."""
    from hybridflow.runtime.engines.rollout.vllm_rollout import import_vllm, vllm_lora_rank

    vllm = import_vllm()
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    out = trained["root"] / "out" / "actor"
    prompt = trained["ids"][0, :6]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    want = hf.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=6,
                       do_sample=False)[0, len(prompt):].tolist()
    params = vllm.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    dtype = "auto" if torch.cuda.is_available() else "float32"
    common = dict(skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, seed=0)
    merged = vllm.LLM(model=str(out), **common)
    got = merged.generate([TokensPrompt(prompt_token_ids=prompt.tolist())], params)[0].outputs[0].token_ids
    assert list(got) == want
    del merged
    base = vllm.LLM(model=str(trained["base"]), enable_lora=True, max_lora_rank=vllm_lora_rank(LORA.rank), max_loras=1, **common)
    request = LoRARequest("exported", 1, str(out / ADAPTER_FOLDER))
    got = base.generate([TokensPrompt(prompt_token_ids=prompt.tolist())], params, lora_request=request)
    assert list(got[0].outputs[0].token_ids) == want
