"""TrainEngine.fingerprint (the resume check's hash) reads every parameter and optimizer state exactly, in any
dtype: bf16 weights (mixed precision on GPUs) have no numpy dtype, so they are hashed as raw bytes."""

import numpy as np
import torch
from engine_util import nll_loss, tiny_model, token_batch

from hybridflow.runtime.engines.train.base import exact_bytes
from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine


def test_exact_bytes_of_bf16_and_scalar_tensors():
    t = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    assert exact_bytes(t) == t.view(torch.int16).numpy().tobytes()
    assert exact_bytes(torch.tensor(3.0)) == np.float32(3.0).tobytes()
    assert exact_bytes(torch.arange(6.0).reshape(2, 3).t()) == np.arange(6.0, dtype=np.float32).reshape(2, 3).T.copy().tobytes()


def test_fingerprint_of_a_bf16_engine_after_a_step():
    torch.manual_seed(0)
    engine = FsdpEngine(tiny_model(num_hidden_layers=1))
    engine.train_step(token_batch(n=2, seq=6), nll_loss)
    fp32 = engine.fingerprint()
    assert fp32 == engine.fingerprint()  # exact and repeatable
    engine.model.to(torch.bfloat16)
    bf16 = engine.fingerprint()  # numpy has no bfloat16: raw bytes
    assert len(bf16) == 64 and bf16 != fp32
