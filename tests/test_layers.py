"""The platform's layering (docs/architecture.md), checked over the source's own imports.

Each package may import only from its own layer's allowed set; `control` may import the model
code (engine, encoders, worker) only lazily, inside a function, so a control or gateway process
starts without torch. Imports under `if TYPE_CHECKING:` are annotations only and are not counted
there. Two rules count them too: the worker imports nothing of the engine but its front door
(`modelyard.engine.client`), and the modules of every package import each other without a
circle (`control/`, `engine/` and `gateway/` above all: a newcomer reads them from their imports).
And no module is over `MAX_MODULE_LINES` lines.

`KNOWN_VIOLATIONS`, `KNOWN_TORCH_IMPORTERS`, `KNOWN_CYCLES` and `LONG_MODULES` list what is
still wrong, each with who removes it; the tests fail on a new violation AND on a listed one that
no longer occurs, so the lists only shrink.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "modelyard"

# Top-level part of modelyard -> the parts it may import at module level (itself always).
_BELOW_API = {
    "config", "core", "protocol", "store", "engine", "encoders", "worker", "gateway",
    "control", "batch",
}  # fmt: skip
_TOP = _BELOW_API | {
    "api", "console", "platform", "roles", "cli", "cli_commands", "registry_client",
}  # fmt: skip
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "config": set(),
    "core": {"config"},
    "store": {"config", "core", "protocol"},
    "engine": {"config"},
    "encoders": {"config"},
    "worker": {"config", "core", "protocol", "engine", "encoders"},
    "gateway": {"config", "core", "protocol", "store"},
    "control": {"config", "core", "protocol", "store"},
    "batch": {"config", "core", "protocol", "store", "gateway"},
    "api": _BELOW_API,
    "console": _BELOW_API | {"api"},
    # Layer 7: the composition root, the command line and the registry client use everything.
    "platform": _TOP,
    "roles": _TOP,
    "cli": _TOP,
    "cli_commands": _TOP,
    "registry_client": _TOP,
}
# Imported only inside functions (never at module import): the model code, which loads torch.
LAZY: dict[str, set[str]] = {"control": {"engine", "encoders", "worker"}}

# The one module of the engine the worker may import, at any level, type-only included.
WORKER_ENGINE_DOOR = "modelyard.engine.client"
# Packages whose modules import one another without a circle (any level, type-only included):
# every package of the source tree.
ACYCLIC = tuple(
    sorted(p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
)
# Circles still there (their modules, sorted), by who removes them: none left.
KNOWN_CYCLES: set[tuple[str, ...]] = set()

# The longest a module of src/modelyard may be, in lines: one job, readable in one sitting.
MAX_MODULE_LINES = 400
# Modules still longer (path under src/modelyard -> why), by who shortens them.
LONG_MODULES: dict[str, str] = {}

# (importer, imported module, "lazy" or "module") still wrong today, by who removes them.
KNOWN_VIOLATIONS: set[tuple[str, str, str]] = set()

# Modules of the import-light packages that still pull torch in when imported (same owners).
KNOWN_TORCH_IMPORTERS: set[str] = set()
TORCH_FREE_PACKAGES = ("gateway", "control", "core", "protocol", "store", "batch")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    """Whether `modelyard.x.y` is a module or a package of the source tree."""
    path = SRC.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, type_only: bool = False) -> list[tuple[str, bool]]:
    """(imported modelyard module, whether at module level) for every import in `path`; those
    under `if TYPE_CHECKING:` only with `type_only` (and then as module level)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_only:
            for child in node.orelse:
                visit(child, top)
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, top) for a in node.names if a.name.startswith("modelyard."))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base == "modelyard" or base.startswith("modelyard."):
                # `from package import x`: x is a module of it, or a name in it
                found.extend(
                    (f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base, top)
                    for a in node.names
                )
        inner = top and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


def _part(module: str) -> str:
    """`modelyard.gateway.proxy` -> `gateway`; the package itself (its version) -> `""`."""
    return module.split(".")[1] if module.count(".") else ""


def layer_violations() -> set[tuple[str, str, str]]:
    out: set[tuple[str, str, str]] = set()
    for path in sorted(SRC.rglob("*.py")):
        importer = _module_name(path)
        part = _part(importer)
        if part not in ALLOWED:  # `modelyard/__init__.py`, migrations' own tree
            continue
        allowed = ALLOWED[part] | {part, ""}
        for imported, top in _imports(path):
            target = _part(imported)
            if target in allowed or (not top and target in LAZY.get(part, set())):
                continue
            out.add((importer, imported, "module" if top else "lazy"))
    return out


def test_every_package_is_listed() -> None:
    parts = {p.stem if p.is_file() else p.name for p in SRC.iterdir() if p.name != "__pycache__"}
    parts -= {"__init__", "py"}
    missing = {p for p in parts if not p.startswith(".") and p not in ALLOWED}
    assert not missing, f"add these to ALLOWED in tests/test_layers.py: {sorted(missing)}"


def test_imports_point_down() -> None:
    found = layer_violations()
    new = found - KNOWN_VIOLATIONS
    gone = KNOWN_VIOLATIONS - found
    assert not new, "imports against the layering (docs/architecture.md):\n" + "\n".join(
        f"  {a} imports {b} ({where} level)" for a, b, where in sorted(new)
    )
    assert not gone, "fixed; remove from KNOWN_VIOLATIONS:\n" + "\n".join(
        f"  {v}" for v in sorted(gone)
    )


def test_the_worker_imports_only_the_engine_client() -> None:
    found = {
        (_module_name(path), imported)
        for path in sorted((SRC / "worker").rglob("*.py"))
        for imported, _ in _imports(path, type_only=True)
        if _part(imported) == "engine" and imported != WORKER_ENGINE_DOOR
    }
    assert not found, (
        f"the worker uses the engine only through `{WORKER_ENGINE_DOOR}` (its `EngineClient` and "
        "the data types it exports); add what is missing there:\n"
        + "\n".join(f"  {a} imports {b}" for a, b in sorted(found))
    )


def _owner(module: str, modules: set[str]) -> str | None:
    """The module of `modules` that an import of `module` (maybe a name in it) loads."""
    while module and module not in modules:
        module = module.rpartition(".")[0]
    return module or None


def import_cycles(part: str) -> list[list[str]]:
    """The circles among `part`'s modules (strongly connected components of more than one
    module), over every import: module level, in functions, and under `if TYPE_CHECKING:`."""
    paths = {_module_name(p): p for p in sorted((SRC / part).rglob("*.py"))}
    modules = set(paths)
    graph = {
        name: sorted(
            {
                owner
                for imported, _ in _imports(path, type_only=True)
                if (owner := _owner(imported, modules)) is not None and owner != name
            }
        )
        for name, path in paths.items()
    }
    # Tarjan's algorithm, iterative.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(graph[node]):
                work.append((node, i + 1))
                nxt = graph[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return cycles


def test_no_import_cycles() -> None:
    assert {"control", "engine", "gateway", "worker"} <= set(ACYCLIC)
    found = {tuple(c) for part in ACYCLIC for c in import_cycles(part)}
    new = found - KNOWN_CYCLES
    gone = KNOWN_CYCLES - found
    assert not new, (
        "modules that import each other in a circle (move what both need into a module of its "
        "own, or the code to where it is used):\n"
        + "\n".join(f"  {' <-> '.join(c)}" for c in sorted(new))
    )
    assert not gone, "fixed; remove from KNOWN_CYCLES:\n" + "\n".join(
        f"  {' <-> '.join(c)}" for c in sorted(gone)
    )


def test_no_module_is_over_the_limit() -> None:
    lengths = {
        path.relative_to(SRC).as_posix(): len(path.read_text().splitlines())
        for path in sorted(SRC.rglob("*.py"))
    }
    long = {name for name, n in lengths.items() if n > MAX_MODULE_LINES}
    new = sorted(long - set(LONG_MODULES))
    gone = sorted(set(LONG_MODULES) - long)
    assert not new, f"modules over {MAX_MODULE_LINES} lines (split them by job):\n" + "\n".join(
        f"  src/modelyard/{name}: {lengths[name]} lines" for name in new
    )
    assert not gone, "fixed; remove from LONG_MODULES:\n" + "\n".join(f"  {n}" for n in gone)


_TORCH_PROBE = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("modelyard-layers: torch is blocked")
            return None

    blocked = sys.argv[1] == "blocked"
    known = set(json.loads(sys.argv[2]))
    if blocked:
        sys.meta_path.insert(0, NoTorch())
    names = []
    for part in json.loads(sys.argv[3]):
        package = importlib.import_module("modelyard." + part)
        names.append(package.__name__)
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if ".migrations" not in info.name:
                names.append(info.name)
    needs_torch = []
    for name in names:
        if name in known and not blocked:
            continue
        try:
            importlib.import_module(name)
        except ImportError as exc:
            if "modelyard-layers: torch is blocked" not in str(exc):
                raise
            needs_torch.append(name)
    print(json.dumps({"needs_torch": needs_torch, "torch": "torch" in sys.modules}))
    """
)


def _probe(mode: str) -> dict[str, object]:
    import json

    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _TORCH_PROBE,
            mode,
            json.dumps(sorted(KNOWN_TORCH_IMPORTERS)),
            json.dumps(TORCH_FREE_PACKAGES),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_control_and_gateway_import_without_torch() -> None:
    # Which modules need torch to import at all: exactly the known ones.
    blocked = _probe("blocked")
    needs = set(blocked["needs_torch"])  # type: ignore[arg-type]
    assert not needs - KNOWN_TORCH_IMPORTERS, (
        f"these now import torch at module import: {sorted(needs - KNOWN_TORCH_IMPORTERS)}"
    )
    assert not KNOWN_TORCH_IMPORTERS - needs, (
        f"fixed; remove from KNOWN_TORCH_IMPORTERS: {sorted(KNOWN_TORCH_IMPORTERS - needs)}"
    )
    # And importing every other module of those packages, as a process would, loads no torch.
    plain = _probe("plain")
    assert plain["torch"] is False


# Inside the platform only domain errors (`core/errors.py`) are raised; the HTTP-shaped
# `APIError` belongs to the edges (api/, worker/, protocol/), which turn domain errors into it.
DOMAIN_ONLY_PACKAGES = ("gateway", "control", "batch")


def _wire_error_uses(path: Path) -> list[int]:
    """Lines of `path` that import or name `APIError` (however it is reached)."""

    def names(node: ast.AST) -> set[str]:
        if isinstance(node, ast.ImportFrom):
            return {a.name for a in node.names}
        if isinstance(node, ast.Name):
            return {node.id}
        return {node.attr} if isinstance(node, ast.Attribute) else set()

    tree = ast.parse(path.read_text(), str(path))
    return [node.lineno for node in ast.walk(tree) if "APIError" in names(node)]


def test_gateway_control_and_batch_raise_only_domain_errors() -> None:
    found = [
        f"  {path.relative_to(SRC.parent)}:{line}"
        for part in DOMAIN_ONLY_PACKAGES
        for path in sorted((SRC / part).rglob("*.py"))
        for line in _wire_error_uses(path)
    ]
    assert not found, (
        "APIError used where only domain errors (modelyard.core.errors) belong; raise the "
        "domain error and let the edge shape it:\n" + "\n".join(found)
    )


def test_every_domain_error_is_raised_somewhere() -> None:
    from modelyard.core import errors

    defined = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type)
        and issubclass(value, errors.DomainError)
        and value is not errors.DomainError
    }
    named: set[str] = set()
    for path in SRC.rglob("*.py"):
        if path == SRC / "core" / "errors.py":
            continue
        named |= {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)}
    unused = sorted(defined - named)
    assert not unused, f"domain errors nobody raises (remove them or raise them): {unused}"
