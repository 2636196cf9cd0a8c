"""The arithmetic of a study's rules: `tokens_per_step / train.seq_len`.

Numbers, the study's `vars:` and dotted config keys, with + - * / // % and parentheses;
nothing else is evaluated (a study file is data, never code). `/` of two integers is an
integer when it divides exactly, so a derived batch size stays an integer and one that does
not divide is refused by the config's type check.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from pretrain.config import ConfigError

_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def parse_expression(text: str, names: set[str]) -> ast.expr:
    """Parse and check a rule's expression; `names`: the study's vars (bare words)."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise ConfigError(f"{text!r} is not an expression") from None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = _dotted(node)
            if name is None:
                raise ConfigError(f"{text!r}: only names and dotted config keys")
            if isinstance(node, ast.Name) and node.id not in names:
                continue  # checked where it stands alone, below
        elif isinstance(node, ast.BinOp):
            if type(node.op) not in _OPS:
                raise ConfigError(f"{text!r}: only + - * / // % are allowed")
        elif isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, (ast.USub, ast.UAdd)):
                raise ConfigError(f"{text!r}: only + - * / // % are allowed")
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise ConfigError(f"{text!r}: {node.value!r} is not a number")
        elif not isinstance(node, (ast.operator, ast.unaryop, ast.Load)):
            raise ConfigError(f"{text!r}: only arithmetic over numbers, vars and config keys")
    _check_names(tree, text, names)
    return tree


def _check_names(node: ast.AST, text: str, names: set[str]) -> None:
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise ConfigError(
                f"{text!r}: {node.id} is neither a var nor a dotted config key"
                f" (vars: {', '.join(sorted(names)) or 'none'})"
            )
        return
    if isinstance(node, ast.Attribute):
        return  # a dotted key: read from the run's config
    for child in ast.iter_child_nodes(node):
        _check_names(child, text, names)


def evaluate_expression(tree: Any, lookup: Callable[[str], Any], variables: dict[str, Any]) -> Any:
    """The expression's value; `lookup(key)` reads a dotted config key of the run."""
    if not isinstance(tree, ast.AST):
        return tree  # a constant rule
    if isinstance(tree, ast.Constant):
        return tree.value
    if isinstance(tree, ast.Name):
        return variables[tree.id]
    if isinstance(tree, ast.Attribute):
        key = _dotted(tree)
        value = lookup(key or "")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} is not a number")
        return value
    if isinstance(tree, ast.UnaryOp):
        value = evaluate_expression(tree.operand, lookup, variables)
        return -value if isinstance(tree.op, ast.USub) else value
    if isinstance(tree, ast.BinOp):
        a = evaluate_expression(tree.left, lookup, variables)
        b = evaluate_expression(tree.right, lookup, variables)
        if isinstance(tree.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
            raise ConfigError(f"division by zero ({ast.unparse(tree)})")
        if isinstance(tree.op, ast.Div) and isinstance(a, int) and isinstance(b, int):
            return a // b if a % b == 0 else a / b
        return _OPS[type(tree.op)](a, b)
    raise ConfigError(f"cannot evaluate {ast.unparse(tree)}")


__all__ = ["evaluate_expression", "parse_expression"]
