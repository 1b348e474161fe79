"""The control plane is built from composed collaborators, not from class hierarchies: no class
in `control/` inherits from another of the project's classes (a mixin, a base whose private
method a subclass overrides), other than an error deriving from an error, and no method is a
`NotImplementedError` stub. Enums, `Protocol`s and a library's interface are fine."""

from __future__ import annotations

import ast
from pathlib import Path

CONTROL = Path(__file__).resolve().parents[2] / "src" / "modelyard" / "control"


def _project_classes(tree: ast.Module) -> dict[str, str]:
    """Names the module binds to the project's classes: its own classes and its imports from
    `modelyard` (name -> where it comes from)."""
    names = {n.name: "this module" for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("modelyard"):
            for alias in node.names:
                names[alias.asname or alias.name] = str(node.module)
    return names


def _is_error(name: str) -> bool:
    return name.endswith(("Error", "Exception")) or name in {
        "Invalid", "Conflict", "NotFound", "Forbidden", "Unavailable",
    }  # fmt: skip


def shape_problems(path: Path, source: str) -> list[str]:
    tree = ast.parse(source)
    project = _project_classes(tree)
    where = path.relative_to(CONTROL.parent)
    problems: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                name = ast.unparse(base)
                if name in project and not _is_error(name):
                    problems.append(
                        f"{where}:{node.lineno}: {node.name} inherits {name} ({project[name]})"
                    )
        stub = isinstance(node, ast.Raise) and node.exc is not None
        if stub and "NotImplementedError" in ast.unparse(node.exc):  # type: ignore[union-attr]
            problems.append(f"{where}:{node.lineno}: a NotImplementedError stub")
    return problems


def test_control_classes_compose_rather_than_inherit() -> None:
    problems = [
        p for path in sorted(CONTROL.rglob("*.py")) for p in shape_problems(path, path.read_text())
    ]
    assert not problems, "\n".join(problems)


def test_the_shape_check_sees_mixins_and_stubs() -> None:
    path = CONTROL / "example.py"
    mixin = "from modelyard.control.health import ReplicaHealth\nclass C(ReplicaHealth): ..."
    assert shape_problems(path, mixin)
    local = "class A: ...\nclass B(A): ..."
    assert shape_problems(path, local)
    stub = "class A:\n    def f(self) -> None:\n        raise NotImplementedError"
    assert shape_problems(path, stub)
    allowed = (
        "import enum\nfrom modelyard.core.errors import Invalid\n"
        "class E(Invalid): ...\nclass R(enum.Enum): ...\nclass X(RuntimeError): ..."
    )
    assert not shape_problems(path, allowed)
