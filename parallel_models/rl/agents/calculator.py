"""The built-in ``calculator`` tool: arithmetic on numbers, evaluated by walking the ``ast`` of
the expression (never ``eval``).

Allowed: int and float literals, ``+ - * / // % **``, unary ``+ -``, parentheses, and the
functions ``abs round min max sqrt floor ceil``. Anything else (names, attributes, calls of
other functions, strings, comprehensions, ...) is refused. Exponents are capped (``|exponent|
<= 10000`` with a base magnitude whose result stays under ``MAX_DIGITS`` digits) so that ``9**9**9``
cannot hang the rollout.
"""

from __future__ import annotations

import ast
import math
import operator

from parallel_models.rl.agents.schema import Tool

MAX_DIGITS = 4000  # the most digits an integer result may have
MAX_EXPRESSION_CHARS = 1000

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt,
              "floor": math.floor, "ceil": math.ceil}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate."""


def evaluate(expression: str) -> int | float:
    """The value of the arithmetic ``expression``; :class:`CalculatorError` says why not."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("empty expression")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise CalculatorError(f"not an arithmetic expression: {err.msg}") from None
    try:
        return _value(tree.body)
    except (ZeroDivisionError, OverflowError, ValueError, TypeError) as err:
        if isinstance(err, CalculatorError):
            raise
        raise CalculatorError(f"{type(err).__name__}: {err}") from None


def _value(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCTIONS and not node.keywords):
        return _FUNCTIONS[node.func.id](*(_value(a) for a in node.args))
    raise CalculatorError(f"not allowed in an arithmetic expression: "
                          f"{ast.unparse(node)!r} ({type(node).__name__})")


def _check_power(base, exponent) -> None:
    if abs(exponent) > 10000:
        raise CalculatorError(f"exponent {exponent} too large")
    if abs(base) > 1 and abs(exponent) * math.log10(abs(base)) > MAX_DIGITS:
        raise CalculatorError(f"{base} ** {exponent} has more than {MAX_DIGITS} digits")


def calculator(expression: str) -> str:
    """The tool: the value of ``expression`` as text (integral floats without ``.0``)."""
    value = evaluate(expression)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses, "
                "abs round min max sqrt floor ceil) and return its value.",
    parameters={"type": "object",
                "properties": {"expression": {"type": "string",
                                              "description": "e.g. (12 + 7) * 3"}},
                "required": ["expression"], "additionalProperties": False},
    run=calculator)

__all__ = ["CALCULATOR", "CalculatorError", "calculator", "evaluate"]
