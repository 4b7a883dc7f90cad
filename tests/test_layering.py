"""The core imports without torch and mpi4py (docs/architecture.md "Layers and subpackages")."""

from __future__ import annotations

import subprocess
import sys

CORE = ["aioready", "aioready.tasks", "aioready.placement", "aioready.hints",
        "aioready.ready_set", "aioready.arbiter", "aioready.runtime.rank",
        "aioready.runtime.pipeline", "aioready.schedulers", "aioready.transports",
        "aioready.transports.inproc", "aioready.transports.base", "aioready.transports.header",
        "aioready.clock", "aioready.telemetry", "aioready.devices", "aioready.errors",
        "aioready.cli", "aioready.sim", "aioready.sim.variability", "aioready.progress",
        "aioready.tp.grid", "aioready.tp.coordination"]
OPTIONAL_CORE: list[str] = []

BLOCK = """
import importlib, importlib.util, sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'mpi4py', 'cupy', 'numpy_not_blocked'):
            raise ImportError(f'blocked import of {name}')
        return None
sys.meta_path.insert(0, Blocker())
for mod in sys.argv[1:]:
    if mod in %r and importlib.util.find_spec(mod) is None:
        continue
    importlib.import_module(mod)
assert 'torch' not in sys.modules and 'mpi4py' not in sys.modules
print('ok')
""" % (OPTIONAL_CORE,)


def test_core_imports_without_torch_and_mpi4py(child_env: dict[str, str]) -> None:
    out = subprocess.run([sys.executable, "-c", BLOCK, *CORE, *OPTIONAL_CORE], env=child_env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


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
