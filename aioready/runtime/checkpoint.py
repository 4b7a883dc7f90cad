"""Checkpoints: each rank's stage modules, optimizers, step number and RNG state.

Layout: `DIR/step-00000003/rank-00001-of-00004.pt`, one file per rank, written by that rank (in
one process, by the Pipeline for every rank). The step number is the number of steps completed,
that is the index of the next step. A file is written to a temporary name in the same directory,
fsynced, then renamed over its final name (os.replace is atomic), so a crash mid-write leaves the
previous checkpoint whole; `latest(DIR)` returns the newest step directory that holds every rank's
file. On a shared file system all ranks agree on it.

On a process grid (`Pipeline(grid=...)`) the replicas of a data-parallel group hold the same
state, so only replica 0 writes: one file per (pipeline rank, TP rank), numbered
`pp_rank * tp + tp_rank` of `pp * tp`, and every replica reads those. The manifest records the
grid; a checkpoint of another grid is refused (resharding is not supported).

The optimizers belong to the user: pass them as `optimizers=`, either a sequence with one per
local stage (the order of the `stages` given to the Pipeline; None where a stage has none), a
mapping {stage index: optimizer}, each holding only its stage's parameters, or one optimizer over
all of this process's stages (kept in the file of the process's first rank).

Content is tensors and primitives only and is read with `torch.load(weights_only=True)`: nothing
is unpickled. A file carries a manifest (format version, rank, stages, stage count, parameter
names, shapes and dtypes, hint, microbatches) that is checked against the pipeline before anything
is loaded: a checkpoint of another model or stage count raises CheckpointError naming the first
difference and leaves the model, the optimizers and the files untouched.

Verified, all or nothing: each file carries the SHA-256 of its content (runtime/digest.py), checked
when it is read, so a flipped byte is refused naming the file; the tensors themselves (names,
shapes, dtypes, finite values) and the optimizers' parameter groups are checked against the
pipeline for every rank before any stage is overwritten. Leftover temporary files of a killed
write are removed when this process writes or resumes its ranks' files.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..errors import CheckpointError, ConfigError
from .digest import content_digest

__all__ = ["FORMAT", "FORMAT_VERSION", "state_dict", "load_state_dict", "save_checkpoint",
           "load_checkpoint", "latest", "resume", "step_dir"]

FORMAT = "aioready-checkpoint"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_RANK_FILE = re.compile(r"^rank-(\d{5})-of-(\d{5})\.pt$")


# -- state of a pipeline ---------------------------------------------------------------------
def _local_stages(pipe: Any) -> dict[int, tuple[int, Any]]:
    """stage index -> (rank, module) for every stage this process holds."""
    out = {}
    for rt in pipe.runtimes:
        if rt.executors is None:
            raise CheckpointError("this pipeline has no modules to checkpoint (simulation)",
                                  rank=rt.rank, expected="torch modules", got=None)
        for stage, ex in zip(rt.stages, rt.executors):
            out[stage] = (rt.rank, ex.module)
    return out


_WHOLE = -1  # key of an optimizer that spans every local stage


def _optimizers(pipe: Any, optimizers: Any) -> dict[int, Any]:
    stages = _local_stages(pipe)
    if optimizers is None:
        return {}
    if hasattr(optimizers, "param_groups") and hasattr(optimizers, "state_dict"):
        mine = {id(p) for _, m in stages.values() for p in m.parameters()}
        if any(id(p) not in mine for g in optimizers.param_groups for p in g["params"]):
            raise ConfigError("the optimizer holds parameters of modules outside this "
                              "pipeline", expected="parameters of the local stages",
                              got="foreign parameters")
        return {_WHOLE: optimizers}
    if isinstance(optimizers, Mapping):
        found = dict(optimizers)
    elif isinstance(optimizers, Sequence):
        if len(optimizers) != len(stages):
            raise ConfigError("optimizers: one per local stage (None where a stage has none)",
                              expected=len(stages), got=len(optimizers))
        found = dict(zip(sorted(stages), optimizers))
    else:
        raise ConfigError("optimizers", expected="a sequence (one per local stage) or "
                          "{stage: optimizer}", got=type(optimizers).__name__)
    for stage, opt in found.items():
        if stage not in stages:
            raise ConfigError("optimizer for a stage this process does not hold",
                              expected=f"stages {sorted(stages)}", got=stage)
        if opt is None:
            continue
        mine = {id(p) for p in stages[stage][1].parameters()}
        if any(id(p) not in mine for g in opt.param_groups for p in g["params"]):
            raise ConfigError(f"the optimizer given for stage {stage} holds parameters of "
                              "another module", expected="one optimizer per stage module",
                              got="foreign parameters")
    return {s: o for s, o in found.items() if o is not None}


def _rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "python": [version, list(internal), gauss]}
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype("int64")),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np
        n = state["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype("uint32"), n["pos"],
                             n["has_gauss"], n["cached"]))


def _manifest(pipe: Any, rank: int, stages: list[int], modules: dict[int, Any],
              opts: dict[int, Any], step: int) -> dict[str, Any]:
    placement = pipe.hint.placement
    return {
        "format": FORMAT, "version": FORMAT_VERSION, "rank": rank,
        "num_ranks": placement.num_ranks, "num_stages": placement.num_stages,
        "placement": placement.style, "stages": stages, "step": step,
        "hint": pipe.hint.name, "microbatches": pipe.microbatches,
        "split_backward": pipe.hint.split_backward,
        "params": {s: [[n, list(t.shape), str(t.dtype).removeprefix("torch.")]
                       for n, t in modules[s].state_dict().items()] for s in stages},
        "optimizers": {s: type(opts[s]).__name__ for s in stages if s in opts},
        "process_optimizer": (type(opts[_WHOLE]).__name__
                              if _WHOLE in opts and rank == pipe.runtimes[0].rank else None),
        "grid": _grid_sizes(pipe),
    }


def _grid_sizes(pipe: Any) -> list[int] | None:
    """[pp, tp, dp] of the pipeline's process grid, or None without one."""
    grid = getattr(pipe, "grid", None)
    if grid is None:
        return None
    g = grid.comms.grid
    return [g.pp_size, g.tp_size, g.dp_size]


def _file_name(pipe: Any, rank: int) -> str:
    """This rank's file: by pipeline rank, or by (pipeline rank, TP rank) on a grid."""
    grid = getattr(pipe, "grid", None)
    if grid is None:
        index, total = rank, pipe.hint.placement.num_ranks
    else:
        c, g = grid.comms.coords, grid.comms.grid
        index, total = c.pp_rank * g.tp_size + c.tp_rank, g.pp_size * g.tp_size
    return f"rank-{index:05d}-of-{total:05d}.pt"


def _grid_text(sizes: list[int] | None) -> str:
    return "no grid" if sizes is None else "pp {} x tp {} x dp {}".format(*sizes)


def state_dict(pipe: Any, optimizers: Any = None, *, step: int | None = None
               ) -> dict[int, dict[str, Any]]:
    """{rank: that rank's state} for every rank this process holds (see the module note)."""
    local = _local_stages(pipe)
    opts = _optimizers(pipe, optimizers)
    step = pipe.step_index if step is None else step
    rng = _rng_state()
    out = {}
    for rt in pipe.runtimes:
        stages = list(rt.stages)
        modules = {s: local[s][1] for s in stages}
        out[rt.rank] = {
            "manifest": _manifest(pipe, rt.rank, stages, modules, opts, step),
            "stages": {s: {"model": modules[s].state_dict(),
                           "optimizer": opts[s].state_dict() if s in opts else None}
                       for s in stages},
            "rng": rng,
            "process_optimizer": (opts[_WHOLE].state_dict() if _WHOLE in opts
                                  and rt is pipe.runtimes[0] else None),
        }
    return out


def _differs(what: str, ours: Any, theirs: Any, rank: int, fix: str | None = None) -> None:
    if ours != theirs:
        raise CheckpointError(f"the checkpoint belongs to another {what}", rank=rank,
                              expected=f"{what} {ours!r} (this pipeline)",
                              got=f"{theirs!r} (the checkpoint)", fix=fix)


def _validate(pipe: Any, states: Mapping[int, Any], opts: dict[int, Any], check_config: bool
              ) -> None:
    local = _local_stages(pipe)
    for rt in pipe.runtimes:
        if rt.rank not in states:
            raise CheckpointError("no state for this rank", rank=rt.rank,
                                  expected=f"rank {rt.rank}", got=sorted(states))
        st = states[rt.rank]
        if not isinstance(st, Mapping) or not {"manifest", "stages", "rng"} <= set(st):
            raise CheckpointError("not an aioready checkpoint state", rank=rt.rank,
                                  expected="manifest, stages, rng", got=type(st).__name__)
        man = st["manifest"]
        if man.get("format") != FORMAT or man.get("version") != FORMAT_VERSION:
            raise CheckpointError("unknown checkpoint format", rank=rt.rank,
                                  expected=f"{FORMAT} v{FORMAT_VERSION}",
                                  got=f"{man.get('format')} v{man.get('version')}")
        place = pipe.hint.placement
        _differs("process grid", _grid_text(_grid_sizes(pipe)), _grid_text(man.get("grid")),
                 rt.rank, _GRID_FIX)
        _differs("stage count", place.num_stages, man["num_stages"], rt.rank)
        _differs("rank count", place.num_ranks, man["num_ranks"], rt.rank)
        _differs("placement", place.style, man["placement"], rt.rank)
        _differs("rank's stage list", list(rt.stages), list(man["stages"]), rt.rank)
        if check_config:
            fix = ("pass check_config=False (aioready train --no-check-config) to resume "
                   "with another schedule")
            if pipe.auto is None:  # hint="auto" switches hints: its checkpoints hold any
                _differs("hint", pipe.hint.name, man["hint"], rt.rank, fix)
            _differs("microbatch count", pipe.microbatches, man["microbatches"], rt.rank, fix)
            _differs("split_backward", pipe.hint.split_backward, man["split_backward"],
                     rt.rank, fix)
        whole = type(opts[_WHOLE]).__name__ if _WHOLE in opts and rt is pipe.runtimes[0] \
            else None
        if man.get("process_optimizer") != whole:
            raise CheckpointError("the optimizers do not match", rank=rt.rank,
                                  expected=f"{whole or 'no optimizer'} over all local stages "
                                  "(given)", got=f"{man.get('process_optimizer') or 'none'} "
                                  "(the checkpoint)")
        for s in rt.stages:
            _check_params(s, local[s][1], man["params"].get(s), rt.rank)
            _check_tensors(s, local[s][1], st["stages"].get(s), rt.rank)
            if s in opts:
                _check_optimizer(s, opts[s], st["stages"][s].get("optimizer"), rt.rank)
            saved_opt = man["optimizers"].get(s)
            given = type(opts[s]).__name__ if s in opts else None
            if saved_opt != given:
                raise CheckpointError(f"stage {s}: the optimizers do not match", rank=rt.rank,
                                      expected=f"{given or 'no optimizer'} (given)",
                                      got=f"{saved_opt or 'no optimizer'} (the checkpoint)")


_GRID_FIX = "resume on the grid that wrote it (resharding is not supported)"


def _check_params(stage: int, module: Any, saved: Any, rank: int) -> None:
    ours = [[n, list(t.shape), str(t.dtype).removeprefix("torch.")]
            for n, t in module.state_dict().items()]
    if saved is None:
        raise CheckpointError(f"no state for stage {stage}", rank=rank,
                              expected=f"stage {stage}", got="nothing")
    names_ours, names_saved = [p[0] for p in ours], [p[0] for p in saved]
    if names_ours != names_saved:
        missing = sorted(set(names_ours) - set(names_saved))[:4]
        extra = sorted(set(names_saved) - set(names_ours))[:4]
        raise CheckpointError(f"stage {stage}: the checkpoint belongs to another model",
                              rank=rank, expected=f"{len(names_ours)} tensors, missing there: "
                              f"{missing}", got=f"{len(names_saved)} tensors, unknown here: "
                              f"{extra}")
    for mine, theirs in zip(ours, saved):
        if list(mine) != list(theirs):
            raise CheckpointError(f"stage {stage}: parameter {mine[0]!r} differs", rank=rank,
                                  expected=f"shape {tuple(mine[1])} {mine[2]} (this model)",
                                  got=f"shape {tuple(theirs[1])} {theirs[2]} (the checkpoint)")


def _check_tensors(stage: int, module: Any, saved: Any, rank: int) -> None:
    """The tensors themselves, not only the manifest: a file whose weights disagree with its
    manifest, or hold NaN or inf, is refused before anything is loaded."""
    model = saved.get("model") if isinstance(saved, Mapping) else None
    if not isinstance(model, Mapping):
        raise CheckpointError(f"stage {stage}: no model state", rank=rank,
                              expected="a state dict", got=type(model).__name__)
    ours = module.state_dict()
    if list(model) != list(ours):
        raise CheckpointError(f"stage {stage}: the weights disagree with the manifest",
                              rank=rank, expected=f"{len(ours)} tensors", got=f"{len(model)}")
    for name, mine in ours.items():
        t = model[name]
        if not isinstance(t, torch.Tensor) or t.shape != mine.shape or t.dtype != mine.dtype:
            raise CheckpointError(f"stage {stage}: tensor {name!r} disagrees with the manifest",
                                  rank=rank, expected=f"shape {tuple(mine.shape)} {mine.dtype}",
                                  got=f"shape {tuple(getattr(t, 'shape', ()))} "
                                  f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"stage {stage}: tensor {name!r} holds NaN or inf",
                                  rank=rank, expected="finite weights", got="NaN or inf",
                                  fix="resume from an earlier checkpoint (the run diverged)")


def _check_optimizer(stage: int, opt: Any, saved: Any, rank: int) -> None:
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    ours = [len(g["params"]) for g in opt.param_groups]
    theirs = [len(g.get("params", ())) for g in groups] if isinstance(groups, list) else None
    if theirs != ours:
        raise CheckpointError(f"stage {stage}: the optimizer state does not fit the optimizer",
                              rank=rank, expected=f"parameter groups of sizes {ours}",
                              got=theirs if theirs is not None else type(saved).__name__)


def load_state_dict(pipe: Any, states: Mapping[int, Any], optimizers: Any = None, *,
                    check_config: bool = True) -> int:
    """Validate everything, then load modules, optimizers, RNG and the step; return the step."""
    opts = _optimizers(pipe, optimizers)
    _validate(pipe, states, opts, check_config)
    local = _local_stages(pipe)
    steps = {states[rt.rank]["manifest"]["step"] for rt in pipe.runtimes}
    if len(steps) != 1:
        raise CheckpointError("ranks of the checkpoint are at different steps",
                              expected="one step", got=sorted(steps))
    for rt in pipe.runtimes:
        for s in rt.stages:
            local[s][1].load_state_dict(states[rt.rank]["stages"][s]["model"], strict=True)
            if s in opts:
                opts[s].load_state_dict(states[rt.rank]["stages"][s]["optimizer"])
    if _WHOLE in opts:
        opts[_WHOLE].load_state_dict(states[pipe.runtimes[0].rank]["process_optimizer"])
    _set_rng_state(states[pipe.runtimes[0].rank]["rng"])
    step = steps.pop()
    pipe.set_step_index(step)
    return int(step)


# -- files -----------------------------------------------------------------------------------
def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def _sweep(path: Path) -> None:
    """Remove what killed writes of `path` left behind (any process id)."""
    for tmp in path.parent.glob(f".{path.name}.tmp-*"):
        tmp.unlink(missing_ok=True)


def _write_atomic(path: Path, obj: Any) -> None:
    _sweep(path)
    obj = {**obj, "sha256": content_digest(obj)}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # disk full, no permission: the previous checkpoint stays whole
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write checkpoint file {path}", expected="a writable "
                              "directory with room", got=f"{type(exc).__name__}: "
                              f"{exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(directory: str | Path, pipe: Any, optimizers: Any = None,
                    step: int | None = None) -> Path:
    """Write this process's ranks' files for `step` (default: steps completed); return the dir."""
    grid = getattr(pipe, "grid", None)
    out = step_dir(directory, pipe.step_index if step is None else step)
    if grid is not None and grid.comms.coords.dp != 0:
        return out  # replica 0 of the data-parallel group writes for all of them
    states = state_dict(pipe, optimizers, step=step)
    out.mkdir(parents=True, exist_ok=True)
    for rank, st in states.items():
        _write_atomic(out / _file_name(pipe, rank), st)
    return out


def latest(directory: str | Path) -> Path | None:
    """The newest complete step directory (every rank's file present), or None."""
    root = Path(directory)
    if not root.is_dir():
        return None
    steps = sorted((int(m.group(1)), p) for p in root.iterdir()
                   if (m := _STEP_DIR.match(p.name)) and p.is_dir())
    for _, path in reversed(steps):
        files = [m for f in path.iterdir() if (m := _RANK_FILE.match(f.name))]
        if files:
            total = int(files[0].group(2))
            if {int(m.group(1)) for m in files} >= set(range(total)):
                return path
    return None


def _read(path: Path, verify: bool = True) -> Any:
    try:
        if path.stat().st_size == 0:
            raise CheckpointError(f"checkpoint file {path} is empty", expected="a file "
                                  "written by aioready.runtime.checkpoint", got="0 bytes")
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError("checkpoint file missing", expected=str(path),
                              got="no such file") from None
    except CheckpointError:
        raise
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0][:200]
        raise CheckpointError(f"cannot read checkpoint file {path}",
                              expected="a file written by aioready.runtime.checkpoint",
                              got=f"{type(exc).__name__}: {first}") from None
    if verify:
        _verify(path, state)
    return state


def _verify(path: Path, state: Any) -> None:
    """The file's content against the SHA-256 it carries (see the module note)."""
    if not isinstance(state, dict) or not isinstance(state.get("sha256"), str):
        raise CheckpointError(f"checkpoint file {path} carries no checksum", expected="a "
                              "SHA-256 of its content", got="none", fix="a file written "
                              "before checksums: load it with verify=False (aioready train: "
                              "--resume --no-verify)")
    content = {k: v for k, v in state.items() if k != "sha256"}
    got = content_digest(content)
    if got != state["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is corrupt: its content does not match "
                              "its SHA-256", expected=state["sha256"], got=got,
                              fix="resume from an earlier step directory")


def load_checkpoint(path: str | Path, pipe: Any, optimizers: Any = None, *,
                    check_config: bool = True, verify: bool = True) -> int:
    """Load a step directory (or the latest under a checkpoint dir); return the next step."""
    p = Path(path)
    if not _STEP_DIR.match(p.name):
        found = latest(p)
        if found is None:
            raise CheckpointError("no complete checkpoint", expected=f"step-* under {p}",
                                  got="none")
        p = found
    num_ranks = pipe.hint.placement.num_ranks
    states = {}
    for rt in pipe.runtimes:
        f = p / _file_name(pipe, rt.rank)
        if not f.exists():
            others = sorted(x.name for x in p.glob("rank-*.pt"))[:4]
            if others:  # the usual cause: another grid; say so from the manifest
                theirs = _read(p / others[0]).get("manifest", {}).get("grid")
                _differs("process grid", _grid_text(_grid_sizes(pipe)), _grid_text(theirs),
                         rt.rank, _GRID_FIX)
            raise CheckpointError(f"no file for rank {rt.rank} of {num_ranks} in {p}",
                                  rank=rt.rank, expected=f.name, got=others or "none",
                                  fix="the checkpoint was written for another rank count")
        states[rt.rank] = _read(f, verify)
    return load_state_dict(pipe, states, optimizers, check_config=check_config)


def resume(directory: str | Path, pipe: Any, optimizers: Any = None, *,
           check_config: bool = True, verify: bool = True) -> int:
    """Load the latest checkpoint under `directory` if any; return the step to start from."""
    root = Path(directory)
    if root.is_dir():  # a killed write's leftovers of this process's ranks' files
        num_ranks = pipe.hint.placement.num_ranks
        for step in root.glob("step-*"):
            for rt in pipe.runtimes:
                _sweep(step / f"rank-{rt.rank:05d}-of-{num_ranks:05d}.pt")
    if latest(directory) is None:
        return 0
    return load_checkpoint(directory, pipe, optimizers, check_config=check_config,
                           verify=verify)
