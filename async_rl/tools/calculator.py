"""A safe arithmetic calculator tool (no ``eval``/``exec``).

The expression is parsed with ``ast.parse(mode="eval")`` and only these nodes are evaluated:
int/float literals (not bool, str or complex), ``+ - * / // % **`` between two operands, unary
``+``/``-``, and parentheses. Anything else (names, calls, attributes, subscripts, comparisons,
lambdas, strings, bitwise operators) is rejected with a ValueError that names the construct, so
``__import__('os')`` never runs.

Resource guards: the expression is at most ``MAX_EXPRESSION_CHARS`` (512) characters; an exponent
is at most ``MAX_EXPONENT`` (1024) in absolute value; an integer result may have at most
``MAX_RESULT_BITS`` (2048) bits (about 617 decimal digits); the size of an integer power is
checked before it is computed, so ``9**9**9`` or ``(10**100)**1000`` is refused at once. Float
overflow, inf and nan are errors, as is division (or modulo) by zero.

Result formatting follows Python semantics: integers print as integers (``12*34+28`` ->
``"436"``), floats with ``repr`` (``7/2`` -> ``"3.5"``; true division always yields a float, so
``8/2`` -> ``"4.0"``); ``2**-1`` -> ``"0.5"``.

    >>> evaluate("2 + 3 * (4 - 1) ** 2")
    '29'
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from async_rl.tools.definition import Tool

__all__ = [
    "MAX_EXPONENT",
    "MAX_EXPRESSION_CHARS",
    "MAX_RESULT_BITS",
    "calculator",
    "calculator_tool",
    "evaluate",
]

MAX_EXPRESSION_CHARS = 512
MAX_EXPONENT = 1024
MAX_RESULT_BITS = 2048

_BINARY_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}

# What a rejected operator is called in the error message, with a hint where models often slip.
_REJECTED_OPS = {
    ast.BitXor: "'^' (bitwise xor; use ** for powers)",
    ast.BitOr: "'|' (bitwise or)",
    ast.BitAnd: "'&' (bitwise and)",
    ast.LShift: "'<<' (shift)",
    ast.RShift: "'>>' (shift)",
    ast.MatMult: "'@' (matrix multiplication)",
    ast.Invert: "'~' (bitwise not)",
    ast.Not: "'not'",
}

_NODE_NAMES = {
    ast.Name: "names (variables)",
    ast.Call: "function calls",
    ast.Attribute: "attribute access",
    ast.Subscript: "subscripts",
    ast.Compare: "comparisons",
    ast.BoolOp: "boolean operators (and/or)",
    ast.Lambda: "lambdas",
    ast.IfExp: "conditional expressions",
    ast.List: "lists",
    ast.Tuple: "tuples",
    ast.Dict: "dicts",
    ast.Set: "sets",
    ast.JoinedStr: "f-strings",
    ast.ListComp: "comprehensions",
    ast.GeneratorExp: "comprehensions",
    ast.NamedExpr: "assignment expressions",
}


def evaluate(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result as text.

    Args:
        expression: e.g. ``"12*34+28"``, ``"(1.5 + 2) ** 2 / 7"``; at most 512 characters.

    Returns:
        The value: integers as integers, floats with ``repr`` (see the module docstring).

    Raises:
        ValueError: not a string, empty, too long, a syntax error, a disallowed construct (named
            in the message), division or modulo by zero, an exponent or result over the limits,
            a non-finite or complex result.
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(
            f"expression is {len(expression)} characters long; the limit is {MAX_EXPRESSION_CHARS}"
        )
    if not expression.strip():
        raise ValueError("expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not a valid arithmetic expression: {e.msg}") from None
    except (RecursionError, MemoryError):
        raise ValueError("expression is nested too deeply") from None
    try:
        value = _eval(tree.body)
    except RecursionError:
        raise ValueError("expression is nested too deeply") from None
    return _format(value)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"only int and float literals are allowed, got {value!r}")
        return _check(value)
    if isinstance(node, ast.UnaryOp):
        if type(node.op) not in _UNARY_OPS:
            raise ValueError(f"operator {_op_name(node.op)} is not allowed")
        return _check(_UNARY_OPS[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp):
        if type(node.op) not in _BINARY_OPS:
            raise ValueError(f"operator {_op_name(node.op)} is not allowed")
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        try:
            return _check(_BINARY_OPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None  # e.g. 0 ** -1
        except OverflowError:
            raise ValueError("result is too large") from None
    what = _NODE_NAMES.get(type(node), type(node).__name__)
    raise ValueError(f"{what} are not allowed; use numbers, + - * / // % ** and parentheses")


def _op_name(op: ast.AST) -> str:
    return _REJECTED_OPS.get(type(op), type(op).__name__)


def _check_power(base: int | float, exponent: int | float) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent {exponent!r} is too large; the limit is {MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        # bit_length * exponent bounds the result's bits from above: refuse before computing.
        if (abs(base).bit_length() - 1) * exponent > MAX_RESULT_BITS:
            raise ValueError(f"result is too large (more than {MAX_RESULT_BITS} bits)")


def _check(value: Any) -> int | float:
    if isinstance(value, complex):
        raise ValueError("result is a complex number (e.g. a fractional power of a negative number)")
    if isinstance(value, int):
        if value.bit_length() > MAX_RESULT_BITS:
            raise ValueError(f"result is too large (more than {MAX_RESULT_BITS} bits)")
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not a finite number")
    return value


def _format(value: int | float) -> str:
    return str(value) if isinstance(value, int) else repr(value)


def _calculator(expression: str) -> str:
    return evaluate(expression)


calculator_tool = Tool(
    name="calculator",
    description=(
        "Evaluate an arithmetic expression exactly and return the result. Supports integers and "
        "decimals, + - * / // % ** and parentheses; / always gives a decimal (8/2 = 4.0), // is "
        "integer division."
    ),
    parameters={
        "type": "object",
        "properties": {
            "expression": {
                "type": "string",
                "description": "The expression to evaluate, e.g. \"(12 + 7) * 3 / 4\".",
            }
        },
        "required": ["expression"],
    },
    fn=_calculator,
    timeout_s=5.0,
)

# The name the brief uses; not re-exported from the package, where it would shadow this module.
calculator = calculator_tool
