"""`TensorDict`, imported without importing torch's compiler (torch._dynamo).

As it is imported, tensordict registers a few of its functions with torch.compile
(`torch.compiler.allow_in_graph`, `assume_constant_result`), and either call imports torch._dynamo,
which takes about as long as importing torch. A process that never trains (the `hflow-plan` driver,
a reference, reward or rollout worker) would pay it for nothing; one that trains imports it later
anyway (torch's optimizers and FSDP load it at their first call). Nothing of ours runs under
torch.compile, where those registrations alone matter, so they are skipped for the length of the
import. Every module of ours takes `TensorDict` from here, so whichever imports it first does so.
"""

from __future__ import annotations

import torch.compiler

_compiler = torch.compiler
_registrations = {name: getattr(_compiler, name) for name in ("allow_in_graph", "assume_constant_result")}
for _name in _registrations:
    setattr(_compiler, _name, lambda fn: fn)
try:
    from tensordict import TensorDict
finally:
    for _name, _fn in _registrations.items():
        setattr(_compiler, _name, _fn)

__all__ = ["TensorDict"]
