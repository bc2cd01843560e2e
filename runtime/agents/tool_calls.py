"""Tool calls in a model's turn, in the Hermes / Qwen2.5 format its chat template teaches:
`<tool_call>\\n{"name": "...", "arguments": {...}}\\n</tool_call>` (one or more per turn). A call whose
JSON does not parse, or that names no tool, is still a call: it gets an error observation."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: str = ""  # why the call cannot run (bad JSON, no name); empty when it can

    def as_text(self) -> str:
        return json.dumps({"name": self.name, "arguments": self.arguments})


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>…</tool_call>` in `text`, in order. An opening tag never closed counts as a
    malformed call (the turn ended inside it)."""
    calls = [_one(m.group(1)) for m in _CALL.finditer(text)]
    tail = text[text.rfind(CLOSE) + len(CLOSE):] if CLOSE in text else text
    if OPEN in tail:
        calls.append(ToolCall("", error="the tool call was not closed with </tool_call>"))
    return calls


def _one(body: str) -> ToolCall:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"the tool call is not JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", error='the tool call needs {"name": "...", "arguments": {...}}')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(obj["name"], error="the tool call's arguments are not a JSON object")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error="the tool call's arguments are not a JSON object")
    return ToolCall(obj["name"], args)
