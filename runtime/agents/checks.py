"""An agent run's settings checked before torch or Ray load: every tool imports and has a schema that
parses, the environment is a class with reset and step, and the model's chat template can show tools
(when there are tools). Each failure is one line (HflowError, exit 2)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hybridflow.runtime.agents.chat_format import check_template
from hybridflow.runtime.agents.environments import load_environment
from hybridflow.runtime.agents.loading import load_tools
from hybridflow.runtime.agents.settings import AgentSettings
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.plan import Plan


def check_agent(settings: AgentSettings, model_folder: str | Path | None = None) -> None:
    if not settings.tools and not settings.environment:
        raise HflowError("an agent rollout needs agent.tools (e.g. [calculator]) or agent.environment")
    load_tools(settings.tools)
    if settings.environment:
        load_environment(settings.environment)
    if model_folder is not None:
        check_template(model_folder, needs_tools=bool(settings.tools))


def check_agent_plan(settings: AgentSettings, plan: Plan, stop: Sequence[str] = ()) -> None:
    """What `run` needs to train on conversations (rl/plan_support.check_runnable): the actor's own HF
    folder with a chat template, the native engine, no stop strings, a response budget that holds a
    conversation; then `check_agent`."""
    actor = plan.roles.get("actor")
    if actor is None or not actor.path:
        raise HflowError("an agent run needs the actor's HF folder (its `path`, with a chat template that renders "
                         "tools); the built-in policy has no chat template")
    if actor.rollout != "native":
        raise HflowError(f"agent rollouts run on the native engine on this runtime (the actor's rollout is "
                         f"'{actor.rollout}'); use --rollout native")
    if stop:
        raise HflowError("sampling.stop would cut a conversation's response at its first model turn; a model turn "
                         "ends at the chat template's end-of-turn token: drop sampling.stop for an agent run")
    if settings.max_tokens > plan.workload.response_len:
        raise HflowError(f"agent.max_tokens {settings.max_tokens} is more than the plan's response_len "
                         f"{plan.workload.response_len}: a conversation's tokens after its prompt are its response; "
                         f"lower agent.max_tokens or plan with --response-len {settings.max_tokens}")
    check_agent(settings, actor.path)
