"""No function in the `thinkspec` package runs over 80 lines.

A function is measured from its `def` line to its last line (decorators left out), nested
functions on their own as well as inside their parent. Triton kernel modules (`*_triton.py`) are
exempt: a kernel is one launch and reads best whole.
"""

from __future__ import annotations

import ast
from pathlib import Path

MAX_LINES = 80
PACKAGE_DIR = Path(__file__).resolve().parent.parent / "thinkspec"


def long_functions(root: Path, max_lines: int = MAX_LINES) -> list[str]:
    """"path:line name (N lines)" for each function under root longer than max_lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name.endswith("_triton.py"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                if length > max_lines:
                    where = path.relative_to(root.parent)
                    found.append(f"{where}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_long_functions_are_found(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(79))
    (tmp_path / "m.py").write_text(
        f"@decorator\ndef ok():\n{body}\n\n\nasync def outer():\n    def inner():\n{body}\n        pass\n"
    )
    (tmp_path / "k_triton.py").write_text(f"def kernel():\n{body}\n        pass\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "deep.py").write_text(f"class C:\n    def method(self):\n{body}\n        pass\n")
    names = [line.split()[1] for line in long_functions(tmp_path)]
    assert names == ["outer", "inner", "method"]  # ok is exactly 80 lines; the kernel module is exempt


def test_no_function_over_80_lines():
    found = long_functions(PACKAGE_DIR)  # every subpackage and the modules directly under thinkspec/
    assert not found, f"functions over {MAX_LINES} lines:\n" + "\n".join(found)
