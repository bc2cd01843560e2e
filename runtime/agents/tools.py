"""Tools the model may call: a name, a JSON schema the chat template shows the model, and how a call runs.

A user brings a tool as a Python function, named `module:function` or `path/to/file.py:function`. Its
schema is the function's `tool_schema` attribute (a dict, or a JSON string), in the OpenAI / Hugging Face
form `{"type": "function", "function": {"name", "description", "parameters": {JSON schema}}}` or just
its inner `function` object; without one it is read from the signature (annotations → JSON types) and
the docstring's first line. A user's function runs in the sandbox (runtime/sandbox/: its own process,
limits, no network) unless the spec ends in `@inprocess`. Built-in names: `calculator`, `python`
(builtin_tools.py). Loading is torch-free, so `run` checks the tools before torch or Ray load; what is
wrong is one line (HflowError, exit 2).
"""

from __future__ import annotations

import inspect
import json
import keyword
from collections.abc import Callable
from dataclasses import dataclass

from hybridflow.runtime.sandbox import SandboxLimits
from hybridflow.simulator.errors import HflowError

JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass
class Tool:
    name: str
    schema: dict  # {"type": "function", "function": {...}}: what the chat template renders
    call: Callable[[dict, SandboxLimits], str]  # arguments → the observation (never raises)
    spec: str = ""

    @property
    def parameters(self) -> dict:
        return self.schema["function"].get("parameters", {})

    def run(self, arguments: dict, limits: SandboxLimits) -> str:
        missing = [p for p in self.parameters.get("required", []) if p not in arguments]
        if missing:
            return f"error (arguments): {self.name} needs {', '.join(missing)}"
        props = self.parameters.get("properties", {})
        unknown = [a for a in arguments if a not in props]
        if props and unknown:
            return f"error (arguments): {self.name} takes no argument {', '.join(unknown)}"
        try:
            return self.call(arguments, limits)
        except Exception as e:  # a tool's failure is the conversation's observation, never the run's
            return f"error (exception): {type(e).__name__}: {e}"


def check_schema(schema, where: str) -> dict:
    """A tool schema in the full form, or a one-line HflowError naming what is wrong."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise HflowError(f"{where}: its tool_schema is not JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                             "write it as a JSON object") from None
    if not isinstance(schema, dict):
        raise HflowError(f"{where}: its tool_schema must be a JSON object, not {type(schema).__name__}")
    fn = schema.get("function", schema) if schema.get("type", "function") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].isidentifier() \
            or keyword.iskeyword(fn["name"]):
        raise HflowError(f"{where}: its tool_schema needs a 'name' that is an identifier "
                         '({"type": "function", "function": {"name": ..., "parameters": {...}}})')
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object" or \
            not isinstance(params.get("properties", {}), dict) or not isinstance(params.get("required", []), list):
        raise HflowError(f"{where}: its tool_schema's 'parameters' must be a JSON schema of type 'object' with "
                         "'properties' (an object) and 'required' (a list)")
    for name in params.get("required", []):
        if name not in params.get("properties", {}):
            raise HflowError(f"{where}: its tool_schema requires '{name}', which is not among its properties")
    return {"type": "function", "function": {"name": fn["name"], "description": str(fn.get("description", "")),
                                             "parameters": params}}


def schema_from_signature(fn: Callable, where: str) -> dict:
    """A schema read from `fn`'s signature (annotated str/int/float/bool/list/dict; others: string)."""
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        ann = p.annotation if not isinstance(p.annotation, str) else \
            {v.__name__: v for v in JSON_TYPES}.get(p.annotation, str)
        props[p.name] = {"type": JSON_TYPES.get(ann, "string")}
        if p.default is p.empty:
            required.append(p.name)
    doc = (inspect.getdoc(fn) or "").strip().splitlines()
    return check_schema({"name": fn.__name__, "description": doc[0] if doc else "",
                         "parameters": {"type": "object", "properties": props, "required": required}}, where)
