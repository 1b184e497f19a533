"""Imports point one way: monitor/core is pure (numpy + stdlib + itself)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "monitor" / "core"
ALLOWED_THIRD_PARTY = {"numpy"}


def _imported_modules(path: Path, root: Path = CORE) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: stays inside monitor.core only if it does not climb out
                package = path.relative_to(root).parent.parts
                if node.level - 1 > len(package):
                    found.append((node.lineno, "." * node.level + (node.module or "")))
                continue
            found.append((node.lineno, node.module or ""))
    return found


def _allowed(module: str) -> bool:
    top = module.split(".")[0]
    return (
        module == "monitor.core"
        or module.startswith("monitor.core.")
        or top in ALLOWED_THIRD_PARTY
        or top in sys.stdlib_module_names
        or top == "__future__"
    )


def test_core_imports_only_numpy_stdlib_and_itself():
    files = sorted(CORE.rglob("*.py"))
    assert files, "monitor/core has no modules"
    bad = [
        f"{path.relative_to(CORE.parent.parent)}:{line} imports {module}"
        for path in files
        for line, module in _imported_modules(path)
        if not _allowed(module)
    ]
    assert not bad, "\n".join(bad)


def test_the_check_itself_catches_a_forbidden_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import pydantic\nfrom monitor import settings\nfrom .. import cli\nfrom . import metrics\n")
    modules = [m for _, m in _imported_modules(probe, root=tmp_path)]
    assert [m for m in modules if not _allowed(m)] == ["pydantic", "monitor", ".."]
