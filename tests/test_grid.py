import pytest

from aioready.errors import ConfigError
from aioready.tp.grid import Coords, ProcessGrid


def test_layout_tp_fastest_then_pp_then_dp():
    g = ProcessGrid(pp_size=2, tp_size=2, dp_size=2)
    assert g.world_size == 8
    assert [g.coords(r) for r in range(4)] == [Coords(0, 0, 0), Coords(0, 0, 1),
                                               Coords(0, 1, 0), Coords(0, 1, 1)]
    assert g.coords(5) == Coords(1, 0, 1)
    assert all(g.rank_of(g.coords(r)) == r for r in range(8))


def test_groups_partition_the_world():
    g = ProcessGrid.for_world(12, tp=2, dp=2)
    assert (g.pp_size, g.tp_size, g.dp_size) == (3, 2, 2)
    assert g.tp_group(3) == [2, 3]
    assert g.pp_group(3) == [1, 3, 5]
    assert g.dp_group(3) == [3, 9]
    for groups in (g.tp_group, g.pp_group, g.dp_group):
        seen = sorted(r for r in range(12) for r2 in groups(r) if r2 == r)
        assert seen == list(range(12))
        assert all(r in groups(r) for r in range(12))
    assert g.coords(0).is_tp_leader and not g.coords(1).is_tp_leader


def test_pp_line_members_share_the_tp_rank():
    g = ProcessGrid.for_world(8, tp=2)
    for r in range(8):
        assert {g.coords(x).tp_rank for x in g.pp_group(r)} == {g.coords(r).tp_rank}
        assert [g.coords(x).pp_rank for x in g.pp_group(r)] == [0, 1, 2, 3]


@pytest.mark.parametrize("n, tp", [(4, 3), (5, 2), (4, 0)])
def test_bad_sizes_are_config_errors(n, tp):
    with pytest.raises(ConfigError, match="tp"):
        ProcessGrid.for_world(n, tp=tp)


def test_rank_outside_the_grid():
    with pytest.raises(ConfigError, match="outside the grid"):
        ProcessGrid(2, 2).coords(4)


def test_grid_and_coordination_import_without_torch_or_mpi4py(child_env):
    import subprocess
    import sys
    code = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'mpi4py'):
            raise ImportError('blocked import of ' + name)
sys.meta_path.insert(0, Blocker())
import aioready.tp.grid, aioready.tp.coordination, aioready.tp.collectives, aioready.devices.delayed
assert 'torch' not in sys.modules and 'mpi4py' not in sys.modules
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
