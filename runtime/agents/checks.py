"""An agent run's settings checked before torch or Ray load: every tool imports and has a schema that
parses, the environment is a class with reset and step, and the model's chat template can show tools
(when there are tools). Each failure is one line (HflowError, exit 2)."""

from __future__ import annotations

from pathlib import Path

from hybridflow.runtime.agents.chat_format import check_template
from hybridflow.runtime.agents.environments import load_environment
from hybridflow.runtime.agents.loading import load_tools
from hybridflow.runtime.agents.settings import AgentSettings
from hybridflow.simulator.errors import HflowError


def check_agent(settings: AgentSettings, model_folder: str | Path | None = None) -> None:
    if not settings.tools and not settings.environment:
        raise HflowError("an agent rollout needs agent.tools (e.g. [calculator]) or agent.environment")
    load_tools(settings.tools)
    if settings.environment:
        load_environment(settings.environment)
    if model_folder is not None:
        check_template(model_folder, needs_tools=bool(settings.tools))
