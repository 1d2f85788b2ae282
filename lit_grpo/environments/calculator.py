"""A ``calculator`` tool: safe arithmetic on numbers, for tool-use tasks such as ``synthetic:mul_2digit``.

The expression is parsed with :mod:`ast` and only numbers, ``+ - * / // % **``, parentheses and unary signs are
evaluated: there is no ``eval``, no names, no calls, no attribute access, so a model's call cannot run code. Powers
are bounded (an exponent of at most :data:`MAX_EXPONENT` in size, a base of at most :data:`MAX_POWER_BASE`), and so
is the expression's length, so no call can take the process down with one huge number.

A model calls it in the Hermes format with the compact spelling :func:`calculator_call_text` writes (the one the
``calc-tiny-sft`` warm start is trained on)::

    <tool_call>{"name":"calculator","arguments":{"expression":"47 * 38"}}</tool_call>
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable

#: the longest expression evaluated (characters)
MAX_EXPRESSION_CHARS = 200
#: the largest exponent in absolute value that ``**`` accepts
MAX_EXPONENT = 64
#: the largest base in absolute value that ``**`` accepts (10**6 ** 64 has 385 digits: still instant)
MAX_POWER_BASE = 10**6
#: the largest integer result printed in full (beyond it, one line says so instead of a huge number)
MAX_RESULT_DIGITS = 400

BINARY: dict[type, Callable[[object, object], object]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
UNARY: dict[type, Callable[[object], object]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}
ALLOWED = "numbers, + - * / // % **, parentheses and unary minus"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The arithmetic expression to evaluate, e.g. "47*38" or "(12+3)/4". Numbers, the operators
            + - * / // % ** and parentheses only.

    Returns:
        The value as text: an integer without a decimal point, other values with up to 12 significant digits.
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression has {len(expression)} characters; expected at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse {expression!r} as arithmetic ({e.msg}); expected {ALLOWED}") from None
    return format_number(evaluate(tree.body, expression))


def evaluate(node: ast.AST, expression: str) -> int | float:
    """The value of one node of a parsed expression; anything but :data:`ALLOWED` raises ``ValueError``."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ValueError(f"{node.value!r} in {expression!r} is not a number; expected {ALLOWED}")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](evaluate(node.operand, expression))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = evaluate(node.left, expression), evaluate(node.right, expression)
        if isinstance(node.op, ast.Pow):
            check_power(left, right, expression)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError(f"division by zero in {expression!r}")
        try:
            return BINARY[type(node.op)](left, right)
        except OverflowError:
            raise ValueError(f"{expression!r} overflows a float") from None
    what = type(node).__name__
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        what = f"operator {type(node.op).__name__}"
    elif isinstance(node, ast.Name):
        what = f"name {node.id!r}"
    elif isinstance(node, ast.Call):
        what = "function call"
    raise ValueError(f"{what} is not allowed in {expression!r}; expected {ALLOWED}")


def check_power(base: int | float, exponent: int | float, expression: str) -> None:
    """Refuse a power whose result could be huge (its time and memory grow with the exponent and the base)."""
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent {exponent} in {expression!r} is too large; expected at most {MAX_EXPONENT} "
                         f"in absolute value")
    if abs(base) > MAX_POWER_BASE:
        raise ValueError(f"base {base} of a power in {expression!r} is too large; expected at most "
                         f"{MAX_POWER_BASE} in absolute value")
    if base == 0 and exponent < 0:
        raise ValueError(f"zero to a negative power in {expression!r}")


def format_number(value: int | float | complex) -> str:
    """An integer (or a float with an integer value) without ``.0``; other floats with 12 significant digits."""
    if isinstance(value, complex):  # (-8) ** 0.5
        raise ValueError(f"the result {value} is not a real number")
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"the result {value} is not a finite number")
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".12g")
    if len(str(abs(value))) > MAX_RESULT_DIGITS:  # ints are exact: refuse rather than send pages of digits
        raise ValueError(f"the result has more than {MAX_RESULT_DIGITS} digits")
    return str(value)


def calculator_call_text(expression: str) -> str:
    """The Hermes tool call of ``calculator`` on ``expression``, in the compact JSON spelling (no spaces) that the
    ``calc-tiny-sft`` warm start writes: ``<tool_call>{"name":"calculator","arguments":{...}}</tool_call>``."""
    payload = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(payload, separators=(',', ':'))}</tool_call>"
