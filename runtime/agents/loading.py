"""Tools named in a run's settings loaded: a built-in name, or the user's `module:function` /
`path/to/file.py:function` (sandboxed; `@inprocess` to call it in the rollout's own process). Torch-free."""

from __future__ import annotations

import json
from collections.abc import Sequence

from hybridflow.runtime.agents.builtin_tools import BUILTIN_TOOLS
from hybridflow.runtime.agents.tools import Tool, check_schema, schema_from_signature
from hybridflow.runtime.sandbox import SandboxLimits, run_function
from hybridflow.runtime.tasks.user_functions import function_file, load_function
from hybridflow.simulator.errors import HflowError


def load_tool(spec: str) -> Tool:
    """A tool from `calculator`, `python`, `module:function` or `file.py:function` (+ `@inprocess`)."""
    if spec.lower() in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec.lower()]()
    ref, _, mode = spec.partition("@")
    if mode not in ("", "inprocess"):
        raise HflowError(f"tool '{spec}': unknown mode '@{mode}'; write 'module:function' (sandboxed) or "
                         "'module:function@inprocess'")
    if ":" not in ref:
        raise HflowError(f"tool '{spec}' is not a built-in tool ({', '.join(BUILTIN_TOOLS)}) nor "
                         "'module:function' / 'path/to/file.py:function'")
    fn = load_function(ref, what="tool")
    where = f"tool '{ref}'"
    raw = getattr(fn, "tool_schema", None)
    schema = check_schema(raw, where) if raw is not None else schema_from_signature(fn, where)
    if mode == "inprocess":
        def call(arguments: dict, limits: SandboxLimits) -> str:
            out = fn(**arguments)
            return out if isinstance(out, str) else json.dumps(out, default=str)
    else:
        file = function_file(ref)
        target = f"{file.resolve()}:{ref.split(':')[1]}" if file else ref

        def call(arguments: dict, limits: SandboxLimits) -> str:
            return run_function(target, arguments, limits).observation()
    return Tool(schema["function"]["name"], schema, call, spec)


def load_tools(specs: Sequence[str]) -> dict[str, Tool]:
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec)
        if tool.name in tools:
            raise HflowError(f"two tools are named '{tool.name}' ({tools[tool.name].spec} and {spec}); "
                             "give each tool its own name")
        tools[tool.name] = tool
    return tools
