"""``dlrm-jax export``: a run's tables as tensorstore arrays, whatever their plan.

Every table of the checkpoint (newest intact, or ``step``) is written as compressed zarr3 arrays
``DEST/<table>/values`` and ``DEST/<table>/<optimizer state>`` ([rows, dim] or [rows]), readable
with tensorstore alone (extra sparse parts too, by their names: Wide&Deep's ``wide_<feature>``,
and ``wide_linear``, the dense features' weights then the bias); a dynamic table's id map as
``DEST/<table>/map/<field>`` (``key_hi``, ``key_lo``, ``used``, ``last_seen``, ``count``, per row;
``sketch``; embedding/dynamic/idmap.py). Tiered tables are copied chunk by chunk from the tier's snapshot of that
step; device-resident tables are gathered from the checkpoint one table at a time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from dlrm_jax.data.sources import close_source, make_source
from dlrm_jax.embedding.exchange.relayout import tables_on_host
from dlrm_jax.embedding.tiers.format import export_array
from dlrm_jax.embedding.tiers.tables import TieredTables
from dlrm_jax.files import check_new_folder, new_folder
from dlrm_jax.jax_settings import with_library_settings
from dlrm_jax.train.build import build, mesh_from_config
from dlrm_jax.train.checkpoint_reader import reading
from dlrm_jax.train.progress import checkpoint_step
from dlrm_jax.train.restore import checkpoint_tier, read_checkpoint, saved_run_config, saved_tiers
from dlrm_jax.train.wiring import tier_root
from dlrm_jax.wording import said


class RestoredRun(NamedTuple):
    """A saved run's checkpoint, read-only: its config, plan, step functions, step and state
    (tables of per-host runs averaged over hosts, host replicas as host 0's copy)."""

    cfg: object
    plan: object
    steps: object
    step: int
    state: object


def restore_run(
    run_dir: str | Path, overrides: list[str] = (), step: int | str | None = None, log=print
) -> RestoredRun:
    """``run_dir``'s checkpoint at ``step`` (default: the newest intact; ``best``: the best
    evaluation's, train.keep_best), with the tables as evaluation scores them. Per-host tables
    (embedding.sync=per_host) are their average over hosts; host replicas
    (embedding.sync=host_replicas) host 0's copy, which every host's equals."""
    run_dir = Path(run_dir)
    cfg = saved_run_config(run_dir, overrides)
    mesh = mesh_from_config(cfg)
    source = make_source(cfg, jax.process_index(), jax.process_count(), trains=False)
    with reading(run_dir / "checkpoints") as leases:  # read-only: the run may be training, and rotating
        step = checkpoint_step(run_dir / "checkpoints", step)  # "best": train.keep_best's step
        try:
            plan, steps = build(cfg, mesh, source, log, saved_tiers(run_dir / "checkpoints", cfg, step))
        finally:
            close_source(source)
        step, state = read_checkpoint(run_dir, cfg, steps, step, log, leases)
    return RestoredRun(cfg, plan, steps, step, as_evaluated(steps, state))


def as_evaluated(steps, state):
    """``state`` with its tables as evaluation scores them: per-host tables their average over
    the hosts, host replicas host 0's copy (every host's is equal)."""
    if not steps.collection.host_sets:
        return state
    return state._replace(emb=jax.tree.map(lambda x: x[0], steps.collection.model_tables(state.emb)))


def tier_snapshot(run: RestoredRun, run_dir: str | Path, step: int, log=print) -> TieredTables:
    """The tiered tables of ``run`` as the tier's snapshot of ``step`` holds them (read-only)."""
    return checkpoint_tier(run.steps, run.plan, tier_root(run.cfg, Path(run_dir)), Path(run_dir), step, log)


def id_maps(run: RestoredRun, run_dir: str | Path) -> dict:
    """Every dynamic table's id map at the run's step, in table order, {name: (MapSpec, IdMap
    of numpy arrays)}: the devices' from the state, tiered tables' from the tier's snapshot."""
    steps, found = run.steps, {}
    if steps.dynamic is not None:
        by_table = steps.dynamic.by_table(run.state.maps)
        for t, name in steps.dynamic.names().items():
            found[t] = (steps.dynamic.maps[t], jax.device_get(by_table[name]))
    if steps.tiered_maps:
        tiered = tier_snapshot(run, run_dir, run.step)
        try:
            found.update({t: (steps.tiered_maps[t], m) for t, m in tiered.maps.maps_at(run.step).items()})
        finally:
            tiered.close()
    return {run.plan.tables[t].spec.name: found[t] for t in sorted(found)}


@with_library_settings  # (whatever JAX settings the process has: see jax_settings)
def export_run(
    run_dir: str | Path, dest: str | Path, overrides: list[str] = (), *, step: int | str | None = None, log=print
) -> int:
    """Write every table of ``run_dir``'s checkpoint at ``step`` (:func:`restore_run`) under
    ``dest``, a new or empty folder that appears whole or not at all; returns the step exported.
    ``log=None``: no lines."""
    log = log or (lambda *_: None)  # (None raised TypeError after the export was written)
    dest = check_new_folder(dest, "export")
    run = restore_run(run_dir, overrides, step, log)
    check_outside_run(dest, run_dir, run.cfg)
    steps, state, step = run.steps, run.state, run.step
    with new_folder(dest, "export") as work:  # (whole or not at all)
        _export_tables(work, steps.collection, state.emb)
        for name, part in steps.parts.items():  # extra sparse parts (Wide&Deep's wide): tables, dense weights
            _export_tables(work, part.collection, part.tables(state.parts[name]))
            for k, v in part.dense_arrays(state.parts[name]).items():
                export_array(work / f"{name}_linear" / k, np.asarray(v))
        for name, (_, m) in id_maps(run, run_dir).items():  # dynamic tables' id maps, beside their tables
            for k, v in m._asdict().items():
                export_array(work / name / "map" / k, np.asarray(v))
        if run.plan.tiered_tables:
            tiered = tier_snapshot(run, run_dir, step, log)
            try:
                tiered.store.export(work, snapshot=step)
            finally:
                tiered.close()
    log(f"exported {len(run.plan.tables)} tables of step {step} to {dest}")
    return step


def check_outside_run(dest: str | Path, run_dir: str | Path, cfg) -> None:
    """Refuses an export's ``dest`` inside a folder the run manages: its checkpoints (a resume
    took an export there for a damaged checkpoint and moved it aside) or its disk tier."""
    managed = [Path(run_dir) / "checkpoints"]
    if cfg.tiered_tables:
        managed.append(tier_root(cfg, Path(run_dir)))
    where = Path(os.path.realpath(dest))
    for folder in managed:
        real = Path(os.path.realpath(folder))
        if where == real or real in where.parents:
            raise ValueError(
                f"{said('--output', 'dest')} {dest}: inside {folder}, which the run manages (its resume moves what it does not "
                f"recognise there aside as damaged); export outside it"
            )


def _export_tables(dest: Path, collection, emb) -> None:
    """Every device-resident table of ``collection`` (tiered ones are the tier's to export)."""
    names = [tp.spec.name for tp in collection.plan.tables]
    for t, values, slots in tables_on_host(collection, emb, frozenset(collection.tiered_tables)):
        export_array(dest / names[t] / "values", values)
        for k, v in slots.items():
            export_array(dest / names[t] / k, v)
