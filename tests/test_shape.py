"""The package keeps a shape a newcomer can read: no module over 800 lines and no
function body over 80 lines (docstrings excluded), apart from data tables."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dpmp"
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    first = body[0]
    is_docstring = (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )
    start = body[1].lineno if is_docstring and len(body) > 1 else first.lineno
    return node.end_lineno - start + 1


def long_functions(source: str) -> list[tuple[str, int]]:
    """(name, body lines) of each function or method whose body is over the limit."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = _body_lines(node)
            if lines > MAX_FUNCTION_LINES:
                out.append((node.name, lines))
    return out


def test_the_checker_sees_a_long_function_and_not_its_docstring():
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    doc = '    """' + "\n" * 200 + '    """\n'
    assert long_functions(f"def f():\n{long_body}\n") == [("f", MAX_FUNCTION_LINES + 1)]
    short_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{doc}{short_body}\n") == []


def test_no_module_is_over_800_lines():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in _modules()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_body_is_over_80_lines():
    long = {
        f"{p.relative_to(PACKAGE)}:{name}": n
        for p in _modules()
        for name, n in long_functions(p.read_text(encoding="utf-8"))
    }
    assert not long, f"function bodies over {MAX_FUNCTION_LINES} lines: {long}"
