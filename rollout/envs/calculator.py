"""A calculator tool environment in TRL's ``environment_factory`` form (runs unchanged under TRL 1.16).

    rollout.env=rollout.envs.calculator:CalculatorEnv    (rows: a prompt and an ``answer`` column)

The model calls ``calculate(expression)``; the reward is 1.0 when the last result it obtained (or, failing that,
the last integer it wrote) equals the row's answer.
"""

from __future__ import annotations

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_DIGITS = 64  # results larger than this are refused (no 10**10**10)


def evaluate(expression: str) -> int | float:
    """Arithmetic on numbers with + - * / // % and parentheses; anything else is a ValueError."""

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            value = _OPS[type(node.op)](ev(node.left), ev(node.right))
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            value = _OPS[type(node.op)](ev(node.operand))
        else:
            raise ValueError(f"unsupported expression: {ast.unparse(node)!r}")
        if abs(value) >= 10**MAX_DIGITS:
            raise ValueError("result too large")
        return value

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    return ev(tree)


class CalculatorEnv:
    def reset(self, **row) -> str | None:
        self.answer = row.get("answer")
        self.result: int | float | None = None
        return " You may call the calculate tool."

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: An expression over numbers with + - * / // % and parentheses, e.g. "3 * (4 + 5)".
        """
        value = evaluate(expression)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        self.result = value
        return str(value)

    def get_reward(self) -> float:
        if self.answer is None or self.result is None:
            return 0.0
        try:
            return 1.0 if float(self.result) == float(self.answer) else 0.0
        except ValueError:
            return 0.0
