"""The memory model's activation count (simulator/pricing/activations.py) against what this runtime's decoder really
holds on a packed micro-batch: the tensors autograd saves for the backward (saved_tensors_hooks), and the peak of
live tensors of a forward without gradients and of a forward + backward (every op's outputs tracked until their
storage is freed). Per token: the difference between two packed lengths, so what does not grow with the tokens
(RoPE tables, masks' bookkeeping) drops out. On CPU in fp32 and bf16; on a CUDA device (gpu-marked, for
tools/gpu_check.sh) in bf16, through flash-attn's varlen kernel where it is installed."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hybridflow.runtime.engines.train.segment_attention import install_segment_attention
from hybridflow.runtime.models.decoder import CausalLM
from hybridflow.simulator.pricing.activations import (
    activation_bytes_per_token_layer,
    backward_working_bytes_per_token,
    layer_working_bytes_per_token,
    norm_saved_bytes,
)
from hybridflow.simulator.vocabulary.model import model_preset

SPEC = model_preset("tiny")
ELEMENT_BYTES = {torch.float32: 4, torch.bfloat16: 2}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CASES = [("cpu", torch.float32), ("cpu", torch.bfloat16),
         pytest.param("cuda", torch.bfloat16, marks=[pytest.mark.gpu, CUDA], id="cuda-bf16")]
LENGTHS = {1: [40, 120, 20, 230], 2: [80, 240, 40, 460]}  # the same sequences, twice as long


class LiveTensors(TorchDispatchMode):
    """Bytes of live tensor storages, op by op, and their peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.live and storage.nbytes():
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    weakref.finalize(storage, self._freed, key)
        self.peak = max(self.peak, self.now)
        return out


def _packed(device, dtype, scale: int):
    torch.manual_seed(0)
    model = CausalLM(SPEC.decoder_config()).to(device=device, dtype=dtype)
    core = install_segment_attention(model)
    lengths = LENGTHS[scale]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    ids = torch.randint(4, SPEC.vocab, (1, cu[-1])).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    return model, core, cu, ids, positions


def _saved_bytes(device, dtype, scale: int) -> int:
    model, core, cu, ids, positions = _packed(device, dtype, scale)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params:
            seen.setdefault(key, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), core.segments(cu):
        model(ids, None, positions)
    return sum(seen.values())


def _peak_bytes(device, dtype, scale: int, backward: bool) -> int:
    model, core, cu, ids, positions = _packed(device, dtype, scale)
    tracker = LiveTensors()
    with torch.set_grad_enabled(backward), core.segments(cu), tracker:
        logits = model(ids, None, positions)
        if backward:
            logits.float().log_softmax(-1).mean().backward()
    return tracker.peak


def _per_token(measure, device, dtype, *args) -> float:
    tokens = sum(LENGTHS[1])
    return (measure(device, dtype, 2, *args) - measure(device, dtype, 1, *args)) / tokens


@pytest.mark.parametrize("device,dtype", CASES)
def test_the_eager_decoder_saves_what_the_fsdp_count_says(device, dtype):
    e = ELEMENT_BYTES[dtype]
    layers = SPEC.layers * activation_bytes_per_token_layer(SPEC, 1, "fsdp", e)
    final = norm_saved_bytes(SPEC, "fsdp", e)
    head = SPEC.hidden * e  # the LM head's input (the final norm's output is counted there)
    measured = _per_token(_saved_bytes, device, dtype)
    assert measured == pytest.approx(layers + final, rel=0.03)
    assert measured > layers + final - head  # nothing the count names is missing
    # Korthikanti's fused count (megatron) leaves out the eager norms' fp32 copies and the output projection's copy
    fused = SPEC.layers * activation_bytes_per_token_layer(SPEC, 1, "megatron", e)
    assert fused < 0.93 * measured


@pytest.mark.parametrize("device,dtype", CASES)
def test_a_forward_without_gradients_holds_one_layer_s_working_set(device, dtype):
    e = ELEMENT_BYTES[dtype]
    logits = SPEC.vocab * e
    measured = _per_token(_peak_bytes, device, dtype, False)
    assert measured == pytest.approx(layer_working_bytes_per_token(SPEC, 1, e) + logits, rel=0.1)


@pytest.mark.parametrize("device,dtype", CASES)
def test_a_backward_holds_the_saved_activations_and_its_first_gradients(device, dtype):
    e = ELEMENT_BYTES[dtype]
    saved = SPEC.layers * activation_bytes_per_token_layer(SPEC, 1, "fsdp", e) + norm_saved_bytes(SPEC, "fsdp", e)
    logits = SPEC.vocab * (2 * e + 4) + (SPEC.vocab * 4 if e < 4 else 0)  # + the test's own fp32 copy of them
    priced = saved + backward_working_bytes_per_token(SPEC, 1, e) + logits
    measured = _per_token(_peak_bytes, device, dtype, True)
    assert measured == pytest.approx(priced, rel=0.03)
    assert measured > saved  # the backward's gradients come on top of what was saved
