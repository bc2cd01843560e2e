"""The shipped tools: `calculator` (arithmetic read by Python's parser, evaluated here, in-process: no
names, no calls, bounded powers) and `python` (the code runs in the sandbox, runtime/sandbox/; its stdout
is the observation)."""

from __future__ import annotations

import ast
import operator

from hybridflow.runtime.agents.tools import Tool
from hybridflow.runtime.sandbox import SandboxLimits, run_code

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10 ** 30


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (+ - * / // % ** and parentheses over numbers)."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
            value = _OPS[type(node.op)](left, right)
            if abs(value) > MAX_MAGNITUDE:
                raise ValueError("the result is too large")
            return value
        raise ValueError(f"not arithmetic: {ast.unparse(node) if hasattr(ast, 'unparse') else node}")
    return ev(ast.parse(expression.strip(), mode="eval"))


def _format(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


def calculator_tool() -> Tool:
    schema = {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}

    def call(arguments: dict, limits: SandboxLimits) -> str:
        try:
            return _format(evaluate(str(arguments["expression"])))
        except (ValueError, SyntaxError, ZeroDivisionError, TypeError, OverflowError) as e:
            return f"error (exception): {type(e).__name__}: {e}"
    return Tool("calculator", schema, call, "calculator")


def python_tool() -> Tool:
    schema = {"type": "function", "function": {
        "name": "python", "description": "Run Python code; what it prints is returned.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}

    def call(arguments: dict, limits: SandboxLimits) -> str:
        return run_code(str(arguments["code"]), limits).observation()
    return Tool("python", schema, call, "python")


BUILTIN_TOOLS = {"calculator": calculator_tool, "python": python_tool}
