"""The `agent` section of a run's settings: what a multi-turn rollout may call and how long it may go."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, PositiveInt, model_validator

from hybridflow.runtime.sandbox import SandboxLimits


class AgentSettings(BaseModel):
    """tools: built-in names (`calculator`, `python`) or the user's `module:function` /
    `file.py:function` (sandboxed; `@inprocess` to call in the rollout's process); environment: instead of
    tools, `guess-number` or the user's `module:Class`; max_turns: model turns per conversation;
    max_tokens: the budget of every token after the prompt (generated, tool results, scaffolding);
    turn_tokens: at most this many generated per turn; tool_workers: tool calls running at once;
    overlap: decode the conversations that are not waiting while tools run (False: every turn in lockstep,
    the same tokens whatever the tools' timing); sandbox: each sandboxed call's limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tools: tuple[str, ...] = ()
    environment: str | None = None
    max_turns: PositiveInt = 4
    max_tokens: PositiveInt = 256
    turn_tokens: PositiveInt = 64
    tool_workers: PositiveInt = 4
    overlap: bool = True
    sandbox: SandboxLimits = SandboxLimits()

    @property
    def enabled(self) -> bool:
        return bool(self.tools or self.environment)

    @model_validator(mode="after")
    def _one_kind(self):
        if self.tools and self.environment:
            raise ValueError("give either agent.tools or agent.environment, not both")
        return self
