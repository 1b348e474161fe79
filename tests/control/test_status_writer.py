"""An endpoint's status has one writer: `control/endpoint_status.py` (`EndpointStatuses`). This
test reads every module of `src/` and fails on a write of an endpoint's status, trigger or
status message anywhere else: an assignment to `.status`, `.trigger`, `.message` or
`.status_message` (plain, augmented or in a tuple), a `setattr` of one of them, or a bulk SQL
`.values(status=...)` in a module that handles endpoints.

Other records have statuses of their own (batches, the gateway's call records, the engine's
sequences, errors): the packages that own them cannot reach an endpoint (`tests/test_layers.py`),
and a module of theirs that imports the endpoint's table or the control plane is scanned too.
An object's own constructor (`self.status = ...` in `__init__`) is not an endpoint's write.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "modelyard"
WRITER = SRC / "control" / "endpoint_status.py"
FIELDS = {"status", "trigger", "message", "status_message"}
# Packages whose `status` fields are their own records', never an endpoint's.
OTHER_RECORDS = ("batch", "engine", "gateway", "protocol", "encoders", "worker")


def _handles_endpoints(path: Path, tree: ast.Module) -> bool:
    """Whether the module can hold an endpoint: any module outside `OTHER_RECORDS`, and one of
    theirs that imports the endpoint's table, its state or the control plane."""
    package = path.relative_to(SRC).parts[0]
    if package not in OTHER_RECORDS:
        return True
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("modelyard.control"):
                return True
            if node.module == "modelyard.store.tables" and any(
                a.name == "Endpoint" for a in node.names
            ):
                return True
    return False


def _constructors(tree: ast.Module) -> set[ast.AST]:
    """Statements of `__init__` methods: an object's own fields, set as it is built."""
    inside: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            inside.update(ast.walk(node))
    return inside


def _own_field(target: ast.Attribute, in_init: bool) -> bool:
    return in_init and isinstance(target.value, ast.Name) and target.value.id == "self"


def status_writes(path: Path, source: str) -> list[str]:
    """Every write of an endpoint's status fields in `source` (`path:line: code`)."""
    tree = ast.parse(source)
    if not _handles_endpoints(path, tree):
        return []
    init = _constructors(tree)
    found: list[str] = []

    def hit(node: ast.AST) -> None:
        found.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: {ast.unparse(node)}")

    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        if any(
            isinstance(part, ast.Attribute)
            and isinstance(part.ctx, ast.Store)
            and part.attr in FIELDS
            and not _own_field(part, node in init)
            for target in targets
            for part in ast.walk(target)
        ):
            hit(node)
        if isinstance(node, ast.Call):
            func = node.func
            if (
                isinstance(func, ast.Name)
                and func.id == "setattr"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in FIELDS
            ):
                hit(node)
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "values"
                and any(k.arg in FIELDS for k in node.keywords)
            ):
                hit(node)
    return found


def test_only_the_status_writer_writes_an_endpoints_status() -> None:
    writes = [
        w
        for path in sorted(SRC.rglob("*.py"))
        if path != WRITER
        for w in status_writes(path, path.read_text())
    ]
    assert not writes, (
        "an endpoint's status changes only through `EndpointStatuses` "
        "(control/endpoint_status.py):\n" + "\n".join(writes)
    )


def test_the_scan_sees_each_kind_of_write() -> None:
    """The scan itself: each way of writing a status is found, in a control module."""
    path = SRC / "control" / "example.py"
    for code in (
        "state.status = EndpointStatus.READY",
        "state.status, state.trigger = a, b",
        "row.status_message = 'x'",
        "setattr(state, 'status', s)",
        "s.execute(update(Endpoint).values(status='ready'))",
        "class A:\n    def go(self):\n        self.message = 'x'",
    ):
        assert status_writes(path, code), code
    assert not status_writes(path, "class E:\n    def __init__(self):\n        self.status = 1")
    assert not status_writes(SRC / "batch" / "example.py", "b.status = 'failed'")
    imports_endpoint = "from modelyard.store.tables import Endpoint\nrow.status = 'ready'"
    assert status_writes(SRC / "batch" / "example.py", imports_endpoint)
