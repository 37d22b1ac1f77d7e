"""How the code is laid out, where a user would notice: the supervisor never loads MLX, and no module
imports another that imports it back.

The layers: ``common`` (MLX-free, shared) <- ``runner`` (the MLX process) and ``supervisor`` (never MLX).
These tests read every module's imports, the ones inside functions too, so a layer is kept by the layout,
not by where an import happens to sit.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests.processes import REPO, child_environment

PACKAGES = ("common", "runner", "supervisor", "bench", "tests")
MLX = ("mlx", "mlx_lm")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in (REPO / package).rglob("*.py")}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module ``name`` imports (at the top or inside a function): project modules by their full
    name, others by their top-level package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            found.add(target)
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges.get(node, ()):
            if other not in edges:
                continue
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_among_the_projects_modules():
    assert cycles(graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def layer_violations(edges, layer: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{name} imports {target}"
        for name, targets in edges.items()
        if name.split(".")[0] == layer
        for target in targets
        if target.split(".")[0] in forbidden
    )


def test_the_shared_layer_and_the_supervisor_never_import_mlx_or_the_runner():
    edges = graph()
    assert layer_violations(edges, "common", ("runner", "supervisor") + MLX) == []
    assert layer_violations(edges, "supervisor", ("runner",) + MLX) == []
    assert layer_violations(edges, "runner", ("supervisor",)) == []
    # The check sees imports inside functions too: the runner's do import MLX.
    assert any(target in MLX for target in edges["runner.engine"])


IMPORT_EVERY_SUPERVISOR_MODULE = """
import importlib, json, pkgutil, sys
import common, supervisor
for package in (common, supervisor):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
import supervisor.__main__
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm", "runner"))))
"""


def test_importing_every_supervisor_module_loads_no_mlx():
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERY_SUPERVISOR_MODULE],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_environment(),
        cwd=REPO,
        check=True,
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
