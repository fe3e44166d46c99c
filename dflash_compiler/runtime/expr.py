"""Evaluate the kernel table's expression strings (grid, block, shared memory, scalar arguments).

The runtime reads these strings from the artifact's manifest, so they are parsed with an AST whitelist
(ints, names, + - * // %, comparisons, conditionals, min/max) and never passed to ``eval``. Numpy-free
and TVM-free: it runs on the deploy box.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping

from dflash_compiler.errors import DFlashError


class UnsafeExpressionError(DFlashError):
    """An expression string is outside the whitelist, or names a value that was not given."""


_BINOPS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CMPOPS: dict[type[ast.cmpop], Callable[[int, int], bool]] = {
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
}
_FUNCS: dict[str, Callable[..., int]] = {"min": min, "max": max}
_MAX_EXPRESSION_CHARS = 4096


def _validate(node: ast.AST, text: str) -> None:
    """Reject anything outside: ints, names, + - * // %, unary -, min/max calls, comparisons, and/or/not, if-else."""

    def bad(what: str) -> UnsafeExpressionError:
        return UnsafeExpressionError(
            f"kernel-table expression {text!r}: {what} is not allowed; expected integers, names, + - * // %, "
            "min(...)/max(...), comparisons, and/or/not and `a if c else b`. Fix: regenerate the kernel table"
        )

    for sub in ast.walk(node):
        if isinstance(sub, ast.Expression | ast.Load | ast.operator | ast.cmpop | ast.boolop | ast.unaryop):
            if isinstance(sub, ast.operator) and type(sub) not in _BINOPS:
                raise bad(f"operator {type(sub).__name__}")
            if isinstance(sub, ast.unaryop) and not isinstance(sub, ast.USub | ast.UAdd | ast.Not):
                raise bad(f"operator {type(sub).__name__}")
            continue
        if isinstance(sub, ast.Constant):
            if type(sub.value) is not int and type(sub.value) is not bool:
                raise bad(f"constant {sub.value!r}")
        elif isinstance(sub, ast.Call):
            if not isinstance(sub.func, ast.Name) or sub.func.id not in _FUNCS or sub.keywords or len(sub.args) < 2:
                raise bad("a call other than min(a, b, ...)/max(a, b, ...)")
        elif not isinstance(sub, ast.Name | ast.BinOp | ast.UnaryOp | ast.Compare | ast.BoolOp | ast.IfExp):
            raise bad(type(sub).__name__)


def _eval(node: ast.AST, env: Mapping[str, int], text: str) -> int:
    if isinstance(node, ast.Constant):
        return int(node.value)
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise UnsafeExpressionError(
                f"kernel-table expression {text!r} needs {node.id!r}, which was not given; "
                f"given: {', '.join(sorted(env)) or 'nothing'}. "
                "Fix: pass every symbolic value (see HostFunction.variables)"
            )
        value = env[node.id]
        if type(value) is not int and not hasattr(value, "__index__"):
            raise UnsafeExpressionError(f"{node.id}={value!r} for {text!r}: expected an integer")
        return operator.index(value)
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, env, text), _eval(node.right, env, text)
        if isinstance(node.op, ast.FloorDiv | ast.Mod) and right == 0:
            raise UnsafeExpressionError(f"kernel-table expression {text!r} divides by zero with {dict(env)}")
        return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp):
        value = _eval(node.operand, env, text)
        if isinstance(node.op, ast.Not):
            return int(not value)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env, text)
        for op, comparator in zip(node.ops, node.comparators, strict=True):
            right = _eval(comparator, env, text)
            if not _CMPOPS[type(op)](left, right):
                return 0
            left = right
        return 1
    if isinstance(node, ast.BoolOp):
        if isinstance(node.op, ast.And):
            result = 1
            for v in node.values:
                result = _eval(v, env, text)
                if not result:
                    return result
            return result
        result = 0
        for v in node.values:
            result = _eval(v, env, text)
            if result:
                return result
        return result
    if isinstance(node, ast.IfExp):
        branch = node.body if _eval(node.test, env, text) else node.orelse
        return _eval(branch, env, text)
    if isinstance(node, ast.Call):
        assert isinstance(node.func, ast.Name)
        return _FUNCS[node.func.id](*(_eval(a, env, text) for a in node.args))
    raise UnsafeExpressionError(f"kernel-table expression {text!r}: {type(node).__name__} is not allowed")


def _parse(text: str) -> ast.Expression:
    if not isinstance(text, str):
        raise UnsafeExpressionError(f"kernel-table expression: expected a string, found {type(text).__name__}")
    if len(text) > _MAX_EXPRESSION_CHARS:
        raise UnsafeExpressionError(
            f"kernel-table expression of {len(text)} characters: expected at most {_MAX_EXPRESSION_CHARS}"
        )
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, RecursionError, ValueError) as exc:
        raise UnsafeExpressionError(f"kernel-table expression {text!r} does not parse: {exc}") from None
    _validate(tree, text)
    return tree


def compile_expression(text: str) -> Callable[[Mapping[str, int]], int]:
    """Validate `text` once; the returned function evaluates it for given symbolic values."""
    body = _parse(text).body

    def run(env: Mapping[str, int]) -> int:
        try:
            return _eval(body, env, text)
        except RecursionError:
            raise UnsafeExpressionError(f"kernel-table expression {text[:80]!r}...: nested too deeply") from None

    return run


def evaluate(text: str, env: Mapping[str, int] | None = None) -> int:
    """The integer value of a kernel-table expression such as "((m + 3) // 4)" for `env` (e.g. {"m": 5})."""
    return compile_expression(text)(env or {})


def expression_names(text: str) -> set[str]:
    """Free variable names an expression reads (min/max excluded)."""
    tree = _parse(text)
    calls = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in calls}
