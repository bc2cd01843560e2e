"""The native engine's CPU decode path: a decoder's weights fused and packed for C kernels (attention over
a paged KV cache, norms, SiLU·up, panel matmuls, the token pick; their sources in csrc/, built on first
use by cpu_kernels.py), and the memory they keep between calls. The generation engine
(engines/rollout/generation.py) uses it through these names only; nothing outside this folder touches
the C glue."""

from hybridflow.runtime.engines.cpu_decode.fast_decode import FusedDecoder, Picked, supports
from hybridflow.runtime.engines.cpu_decode.kept_memory import KeptMemory
from hybridflow.runtime.engines.cpu_decode.matmul_kernels import (
           MATMUL_KINDS,
           linear,
           matmul_kind,
           matmul_operand,
           packable,
)
from hybridflow.runtime.engines.cpu_decode.token_pick import pick_tokens

__all__ = ["MATMUL_KINDS", "FusedDecoder", "KeptMemory", "Picked", "linear", "matmul_kind", "matmul_operand",
           "packable", "pick_tokens", "supports"]
