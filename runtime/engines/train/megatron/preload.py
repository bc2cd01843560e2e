"""Imported once by the forkserver where megatron-core is installed (launch.PRELOAD, profiling's
Megatron jobs): megatron.core, with the notices it prints on a CPU machine silenced first
(megatron_cpu_shim.quiet_cpu_notices; the filters pass to every rank forked after it)."""

import torch

from hybridflow.runtime.engines.train.megatron.cpu_shim import quiet_cpu_notices

if not torch.cuda.is_available():
    quiet_cpu_notices()
import megatron.core  # noqa: E402, F401
