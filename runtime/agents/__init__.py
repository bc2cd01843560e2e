"""Multi-turn agentic rollouts (docs/agents.md): a conversation of model turns, tool calls parsed in the
chat template's format and run (the code tool in runtime/sandbox/), their results appended as turns; or
an interactive environment stepped by the model's turns. Torch-free except conversation.py,
trainer_rollout.py and train.py.

- `tool_calls.py` — `<tool_call>{json}</tool_call>` (Hermes / Qwen) parsed from a model turn;
- `tools.py` — a tool and its JSON schema; `loading.py` — tools a user brings (`module:function`,
  `file.py:function`);
  `builtin_tools.py` — the calculator and the sandboxed Python tool;
- `environments.py` — `reset` → observation, `step(action)` → observation, reward, done; a shipped
  number-guessing game;
- `chat_format.py` — the chat template: tools rendered into the prompt, the tokens appended after a
  model turn for tool results or observations;
- `settings.py` — the `agent` section of the run config;
- `conversation.py` — the loop over many conversations at once and the batch it gives the trainer
  (tokens the model did not generate masked out);
- `trainer_rollout.py` — those conversations as the Ray trainer's rollouts (`hflow-plan run` with an
  `agent` section; runtime/rl/rollout.py calls the workers), what a reward reads of them, their metrics;
- `checks.py` — an agent run's settings checked before torch or Ray load;
- `train.py` — a GRPO update on those batches in one process (the example's trainer).
"""
