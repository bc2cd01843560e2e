"""What of a Plan this runtime does not run, checked before anything starts (torch-free): the
trainer checks it, and so does `hflow-plan run` before it imports torch or starts Ray."""

from __future__ import annotations

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.plan import Plan


def check_runnable(plan: Plan) -> None:
    """One-line HflowError for a plan the runtime cannot execute as written."""
    if any(rp.generate_group for rp in plan.roles.values()):
        raise HflowError("the plan puts generation on separate devices (generate_group); the runtime runs the "
                         "actor's rollout on its own devices through the hybrid engine: drop generate_group")
    if plan.reshard == "broadcast":
        raise HflowError("reshard 'broadcast' is for generation on separate devices, which the runtime does not "
                         "run; use hybridflow, hybridflow-v or ds-chat")
