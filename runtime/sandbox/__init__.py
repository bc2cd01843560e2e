"""Running untrusted tool code: each call in its own process with CPU-time, wall-time, memory, output
and process limits, no network, and a scratch directory removed afterwards (run.py; the child's side in
child.py). docs/agents.md says what it contains and what it does not."""

from hybridflow.runtime.sandbox.limits import SandboxLimits
from hybridflow.runtime.sandbox.run import SandboxResult, run_code, run_function

__all__ = ["SandboxLimits", "SandboxResult", "run_code", "run_function"]
