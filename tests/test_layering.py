"""The package's shape: layers that import only downwards, no import cycles, no reaching into
another subpackage's private names, and a core that loads without torch and mpi4py.

The import graph is read from the source (every import statement, module level or inside a
function, TYPE_CHECKING blocks included), so a lazy import that hides a cycle still fails here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "aioready"

# Each unit (a top-level module or subpackage of aioready) may import units of its own layer or
# below, never above. The root package (`aioready/__init__.py`) is the facade over all of them.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("tasks", "placement", "clock", "timerfd", "launch"),
    ("in_flight", "hints", "caps", "memory", "held_bytes", "forecast", "ready_set", "arbiter",
     "progress"),
    ("transports", "devices", "cuda", "schedulers", "testing", "modeling"),
    ("telemetry",),
    ("runtime", "tp", "dp"),
    ("sim",),
    ("cli", "__main__"),
)
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}

CORE = ["aioready", "aioready.tasks", "aioready.placement", "aioready.hints",
        "aioready.ready_set", "aioready.arbiter", "aioready.runtime.rank",
        "aioready.runtime.pipeline", "aioready.schedulers", "aioready.transports",
        "aioready.transports.inproc", "aioready.transports.base", "aioready.transports.header",
        "aioready.clock", "aioready.telemetry", "aioready.devices", "aioready.errors",
        "aioready.cli", "aioready.sim", "aioready.sim.variability", "aioready.progress",
        "aioready.tp.grid", "aioready.tp.coordination", "aioready.launch",
        "aioready.timerfd"]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every aioready import in module `name`."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name.startswith("aioready")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "aioready":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((sub, "", node.lineno) if sub in MODULES
                           else (target, alias.name, node.lineno))
    return out


def unit_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


GRAPH = {name: sorted({target for target, _, _ in imports_of(name) if target != name})
         for name in MODULES}


def test_every_unit_has_a_layer() -> None:
    units = {unit_of(name) for name in MODULES} - {""}
    assert units - set(LAYER_OF) == set(), "add new subpackages to LAYERS"
    assert set(LAYER_OF) - units == set(), "LAYERS names a unit that does not exist"


def upward(name: str, target: str) -> str | None:
    """Why module `name` may not import `target`, or None when it may."""
    here, there = unit_of(name), unit_of(target)
    if not here:
        return None  # the root facade re-exports from every layer
    if not there:
        return "the root facade: import the module instead"
    if there != here and LAYER_OF[there] > LAYER_OF[here]:
        return f"{there} sits above {here}"
    return None


def test_upward_names_what_is_forbidden() -> None:
    assert upward("aioready.sim.simulator", "aioready.cli.trainer") == "cli sits above sim"
    assert upward("aioready.runtime.rank", "aioready") is not None
    assert upward("aioready.cli.trainer", "aioready.sim.simulator") is None
    assert upward("aioready.tp.layers", "aioready.tp.collectives") is None
    assert upward("aioready", "aioready.cli") is None


def test_imports_go_downwards_only() -> None:
    bad = [f"{name}:{line} imports {target}: {why}"
           for name in MODULES for target, _, line in imports_of(name)
           if (why := upward(name, target)) is not None]
    assert bad == []


def test_no_private_names_across_units() -> None:
    bad = [f"{name}:{line} imports {target}.{what}"
           for name in MODULES for target, what, line in imports_of(name)
           if what.startswith("_") and unit_of(target) != unit_of(name)]
    assert bad == []


def strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm; returns the components with more than one node (the cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_strongly_connected_finds_a_planted_cycle() -> None:
    graph = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert strongly_connected({"a": ["b"], "b": []}) == []


def test_no_module_import_cycles() -> None:
    # a package's __init__ importing its own submodules is how re-exports work: not a cycle
    graph = {name: [t for t in targets if not name or not t.startswith(name + ".")]
             for name, targets in GRAPH.items()}
    assert strongly_connected(graph) == []


def test_no_unit_import_cycles() -> None:
    units: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        if unit_of(name):
            units.setdefault(unit_of(name), set()).update(
                unit_of(t) for t in targets if unit_of(t) and unit_of(t) != unit_of(name))
    assert strongly_connected({u: sorted(t) for u, t in units.items()}) == []


BLOCK = """
import importlib, sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'mpi4py', 'cupy'):
            raise ImportError(f'blocked import of {name}')
        return None
sys.meta_path.insert(0, Blocker())
for mod in sys.argv[1:]:
    importlib.import_module(mod)
assert 'torch' not in sys.modules and 'mpi4py' not in sys.modules
print('ok')
"""


def test_core_imports_without_torch_and_mpi4py(child_env: dict[str, str]) -> None:
    out = subprocess.run([sys.executable, "-c", BLOCK, *CORE], env=child_env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("unit", ["torch", "mpi4py"])
def test_the_blocker_really_blocks(child_env: dict[str, str], unit: str) -> None:
    out = subprocess.run([sys.executable, "-c", BLOCK, unit], env=child_env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and f"blocked import of {unit}" in out.stderr


def test_a_pure_simulation_runs_without_torch(child_env: dict[str, str]) -> None:
    code = BLOCK.replace("print('ok')", """
from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
import aioready
async def main():
    pipe = aioready.Pipeline([None] * 4, None, microbatches=8, hint='1f1b', mode='strict',
                             device=SimDevice(lambda i: 1.0 if i.kind == 0 else 2.0,
                                              run_compute=False))
    await pipe.step()
    return pipe.last_step.step_time
print(run_virtual(main()))
assert 'torch' not in sys.modules
""")
    out = subprocess.run([sys.executable, "-c", code, "aioready"], env=child_env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "33.0"


def test_the_graph_sees_lazy_relative_and_package_imports() -> None:
    assert "aioready.runtime.checkpoint" in GRAPH["aioready.runtime.pipeline"]  # inside a method
    assert "aioready.errors" in GRAPH["aioready.schedulers"]  # `from ..errors` in an __init__
    assert "aioready.schedulers.listsched" in GRAPH["aioready.schedulers"]  # `from . import`-style
    assert "aioready.runtime.pipeline" in GRAPH["aioready"]  # the facade's lazy __getattr__
