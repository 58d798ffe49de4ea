"""Restoring a run's train state from its checkpoints onto the current mesh and plan.

Tables saved under another plan (device count, strategy) are read lazily and re-laid out;
tiered tables come back from the disk tier's snapshot of the same step; hot rows are chosen
afresh when the layout changed.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path

from dlrm_jax.config import Config, load_config, load_run_config
from dlrm_jax.data.sources import resolve_data_config
from dlrm_jax.embedding.exchange.relayout import relayout, saved_shapes
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan
from dlrm_jax.embedding.tiers import hot as tier_hot
from dlrm_jax.embedding.tiers.owner import record_owner, tier_owner
from dlrm_jax.embedding.tiers.setup import SavedTiers
from dlrm_jax.embedding.tiers.store import TierStore
from dlrm_jax.embedding.tiers.tables import TieredTables
from dlrm_jax.parallel.mesh import host_scalar
from dlrm_jax.train.checkpoint_leases import NOT_WRITABLE
from dlrm_jax.train.checkpoint_reader import (
    CheckpointReader,
    CheckpointsIntact,
    IncompatibleCheckpoint,
    error_line,
    saved_json,
    saved_steps,
)
from dlrm_jax.train.rundir import RunDirError, describe_changes, state_differences
from dlrm_jax.train.step import StepFunctions, TrainState
from dlrm_jax.wording import run_dir_flag, said, setting


def saved_run_config(run_dir: Path, overrides=()) -> Config:
    """``run_dir``'s saved config (with ``overrides``), as its checkpoints need it: per-host
    tables come back on as many hosts as they were saved from, simulated in this process when
    it is one (``dlrm-jax eval`` or ``export`` of a run trained on several processes)."""
    cfg = resolve_data_config(load_run_config(run_dir, overrides))
    steps = saved_steps(Path(run_dir) / "checkpoints")
    if cfg.embedding.tables_per_host and not cfg.mesh.hosts and steps:
        hosts = int(saved_json(Path(run_dir) / "checkpoints", steps[-1]).get("hosts") or 0)
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, hosts=hosts))
    return cfg


def restore_state(
    steps: StepFunctions,
    ckpts: CheckpointReader,
    log=print,
    step: int | None = None,
    tiered: TieredTables | None = None,
) -> TrainState:
    """The checkpoint at ``step`` (default newest) on this mesh and plan; tables saved under
    another plan (device count, strategy) are restored as saved, then re-laid out. ``tiered``:
    the disk tier, restored to its snapshot of that step (a step without one does not restore)."""
    state, relaid_out = _restore_state(steps, ckpts, log, step)
    if tiered is not None:
        _restore_tier(tiered, int(host_scalar(state.step)), ckpts.directory)
        if relaid_out and steps.hot is not None:  # the snapshot holds the hot rows: choose afresh
            state = _hot_rows_from_tier(steps, tiered, state)
    return state


def _restore_tier(tiered: TieredTables, step: int, ckpt_dir: Path | None) -> None:
    """The tier restored to its snapshot of ``step``; a tier folder that cannot be written is
    CheckpointsIntact, saying so (a restore rebuilds the working files there): the checkpoints
    in ``ckpt_dir`` are not damaged, and removing them would lose them."""
    try:
        tiered.restore(step)
    except OSError as e:
        if e.errno not in NOT_WRITABLE:
            raise
        root = tiered.store.root
        where = getattr(e, "path", None) or e.filename or root
        kept = f"; the checkpoints in {ckpt_dir} are intact and nothing was changed" if ckpt_dir else ""
        raise CheckpointsIntact(
            f"the disk tier's folder {root} is not writable ({errno.errorcode[e.errno]}, {os.strerror(e.errno)}: "
            f"{where}): a resume rebuilds its working files there{kept}; make {root} writable by this user and re-run"
        ) from None


def _hot_rows_from_tier(steps: StepFunctions, tiered: TieredTables, state: TrainState) -> TrainState:
    """The schedule's current hot set, tiered tables' rows read from the tier (its caches cold)."""
    return state._replace(emb=tier_hot.refresh(steps.collection, tiered, state.emb, steps.hot_keys()))


def _restore_state(steps: StepFunctions, ckpts: CheckpointReader, log, step: int | None) -> tuple[TrainState, bool]:
    """(state, whether it was re-laid out from another plan)."""
    step = ckpts.latest_step() if step is None else step
    saved = EmbeddingPlan.from_json(ckpts.saved_plan(step))
    tiered = saved.tiered_tables
    _check_tables(saved, steps, ckpts.directory / str(step))
    saved = saved.device_view() if tiered else saved  # what the devices held
    current = steps.collection.plan
    if steps.collection.host_sets:
        _check_host_sets(steps, ckpts, saved, step)
    counts = ckpts.saved_hot_counts(step)
    if steps.hot is not None and counts is not None:  # the statistics the saved run refreshes from
        steps.hot.load_json(counts)
    if saved == current:
        return steps.from_checkpoint_form(ckpts.restore(steps.abstract_state(), step)), False
    if tiered != steps.tiered_tables:
        raise IncompatibleCheckpoint(_tiers_moved(step, tiered, steps.tiered_tables, current))
    n = saved.num_devices
    log(
        f"re-laying out the embedding tables for this plan: the checkpoint's plan ({n} device{'s' * (n > 1)}) "
        f"differs from it (device count, sharding, capacities or hot rows)"
    )
    shapes = saved_shapes(saved, steps.collection.optimizer)
    state = steps.from_checkpoint_form(ckpts.restore_lazily(steps.abstract_state(), "emb", shapes, step))
    # Tiered tables' rows come from the tier's snapshot of this step; their caches start empty.
    emb = relayout(saved, state.emb, steps.collection, skip=frozenset(tiered))
    if steps.hot is not None and not tiered:  # hot rows chosen afresh from the statistics
        emb = steps.collection.refresh(emb, steps.hot_keys())
    return state._replace(emb=emb), True


def _check_tables(saved: EmbeddingPlan, steps: StepFunctions, where: Path) -> None:
    """The checkpoint at ``where`` holds the tables this config has, with as many rows and as
    wide (else no layout change can restore it: the config asks for another model or data). A
    tiered table's rows on the devices are its cache's; the tier checks its own."""
    current = steps.collection.plan
    ours, theirs = [tp.spec for tp in current.tables], [tp.spec for tp in saved.tables]
    if [s.name for s in ours] != [s.name for s in theirs]:
        raise IncompatibleCheckpoint(
            f"checkpoint {where} does not fit this config: it holds {len(theirs)} tables "
            f"({theirs[0].name}..{theirs[-1].name}), this config {len(ours)}"
        )
    tiered = set(saved.tiered_tables) | set(steps.tiered_tables)
    for t, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        if a.dim != b.dim or (a.rows != b.rows and t not in tiered):
            raise IncompatibleCheckpoint(
                f"checkpoint {where} does not fit this config: table {a.name} is {a.rows:,} rows x {a.dim} there, "
                f"{b.rows:,} x {b.dim} here (data.cardinalities, data.max_rows, model.embedding_dim)"
            )


def _check_host_sets(steps: StepFunctions, ckpts: CheckpointReader, saved: EmbeddingPlan, step: int | None) -> None:
    """Per-host tables restore only onto as many hosts, each with the plan they were saved with:
    there is no one right way to spread 2 hosts' diverged tables over 4 (or to re-lay out a
    leading hosts axis), so the user is told what the checkpoint needs."""
    hosts, step = ckpts.saved_hosts(step), ckpts.latest_step() if step is None else step
    if hosts != steps.collection.host_sets:
        raise IncompatibleCheckpoint(
            f"checkpoint step {step} holds the per-host tables of {hosts} hosts, this run has {steps.collection.host_sets} "
            f"(mesh.hosts, or one per process when 0); resume with {hosts} hosts (set mesh.hosts={hosts} "
            f"to simulate them in fewer processes)"
        )
    if saved != steps.collection.plan:
        raise IncompatibleCheckpoint(
            f"checkpoint step {step} holds per-host tables laid out on {saved.num_devices} devices per host, "
            f"this run has {steps.collection.plan.num_devices}; per-host tables are not re-laid out: resume with "
            f"mesh.devices = {saved.num_devices * hosts} and the same embedding.sharding"
        )


def restore_newest(
    steps: StepFunctions, ckpts: CheckpointReader, log=print, tiered: TieredTables | None = None
) -> tuple[int, TrainState]:
    """(step, state) of the newest checkpoint that restores; damaged newer ones are set aside."""
    return ckpts.restore_newest_intact(lambda s: restore_state(steps, ckpts, log, s, tiered), log)


def read_checkpoint(
    run_dir: Path, cfg: Config, steps: StepFunctions, step: int | None = None, log=print, leases=None
) -> tuple[int, TrainState]:
    """(step, state) of ``run_dir``'s checkpoint at ``step`` (default: the newest that restores),
    read-only (``eval``, ``export``: the run may still be training; a damaged checkpoint is
    skipped, not moved). ``cfg``: the run's saved config with the command's --set overrides; a
    refusal names the state keys in which it differs from the run's ``config.yaml``. ``leases``:
    the reading session's (:func:`~dlrm_jax.train.checkpoint_reader.reading`), else its own."""
    ckpts = CheckpointReader(Path(run_dir) / "checkpoints", leases)
    try:
        return _read_checkpoint(ckpts, Path(run_dir), cfg, steps, step, log)
    finally:
        ckpts.release()


def _read_checkpoint(ckpts: CheckpointReader, run_dir: Path, cfg: Config, steps: StepFunctions, step, log):
    saved = ckpts.all_steps()
    if not saved or (step is not None and step not in saved):
        damaged = Path(run_dir) / "damaged"
        have = (
            f"(steps {', '.join(map(str, saved))})"
            if saved
            else f"(none; {damaged} holds some set aside as damaged)"
            if damaged.is_dir() and any(damaged.iterdir())
            else "(none saved)"
        )
        raise FileNotFoundError(
            f"{ckpts.directory}: no checkpoint{f' at step {step}' if step is not None else ''} {have}"
        )
    saved_cfg = Path(run_dir) / "config.yaml"
    trained = load_config(saved_cfg)  # overrides that change what the state means are refused, not read
    changed = state_differences(trained, cfg)
    if changed:
        raise IncompatibleCheckpoint(
            f"{ckpts.directory}: its checkpoints hold the state of another config: changed from {saved_cfg}: "
            f"{describe_changes(changed)} (by {said('--set', 'the overrides')} or the data); read them with the keys they were trained with"
        )
    if step is None:
        return restore_newest(steps, ckpts, log)
    if not ckpts.hold(step):
        raise FileNotFoundError(
            f"{ckpts.directory}: the checkpoint at step {step} was removed by its training run's rotation "
            f"(train.keep_checkpoints) since this command started; use a newer step or none (the newest)"
        )
    try:
        state = restore_state(steps, ckpts, log, step)
        ckpts.check_contents(step)
        return step, state
    except IncompatibleCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001 - whatever orbax or json raise on damaged files
        others = [s for s in saved if s != step]
        first = error_line(e)
        raise ValueError(
            f"{ckpts.directory / str(step)}: the checkpoint at step {step} is damaged ({first}); "
            f"use another step ({said('--step', 'step=')} with one of {others}) or none (the newest intact)"
            if others
            else f"{ckpts.directory / str(step)}: the checkpoint at step {step} is damaged "
            f"({first}) and it is the only one"
        ) from None


def check_tier_kept(root: Path, ckpt_dir: Path, log=print, was: Path | None = None) -> None:
    """Refuses (RunDirError) to resume checkpoints whose tables are in a disk tier at ``root``
    that is gone: creating a new one there would make every checkpoint fail to restore. When
    only its working files are gone, they are made again from its newest snapshot (the resume
    then restores the snapshot of its checkpoint's step). ``was``: the tier's folder by the
    config the checkpoints were saved with (named where embedding.tier.path changed)."""
    steps = saved_steps(ckpt_dir)
    if not steps or TierStore.exists(root):
        return
    rebuilt = TierStore.rebuild_work(root)
    if rebuilt is not None:
        log(f"warning: {root / 'work'} was gone: made again from the disk tier's newest snapshot (step {rebuilt})")
        return
    tiered = tiered_in_checkpoint(ckpt_dir, steps[-1])
    if tiered and was is not None and Path(was).absolute() != Path(root).absolute() and TierStore.exists(was):
        owner = tier_owner(was)
        shared = owner is not None and owner.trains_another_run(was, ckpt_dir.parent)
        raise RunDirError(
            f"{root}: no disk tier there; the checkpoints in {ckpt_dir} (steps {', '.join(map(str, steps))}) "
            f"keep their tiered tables in {was}, where they were saved: "
            + (
                f"{owner.maker()} still trains on it (this run dir is a copy of it?): {COPY_THE_TIER}"
                if shared
                else f"resume with {setting('embedding.tier.path', was)}"
            )
        )
    if tiered:
        # (the tier the run left elsewhere, and gone from there too: that one is to be found,
        # not the folder this config names; before, the line sent the user to the wrong one)
        left = was if was is not None and Path(was).absolute() != Path(root).absolute() else root
        where = f"; nor at {left}, where the" if left is not root else ", but the"
        raise RunDirError(
            f"{root}: no disk tier there{where} checkpoints in {ckpt_dir} (steps "
            f"{', '.join(map(str, steps))}) keep their tiered tables; put {left} back as the run left it or "
            f"resume with {setting('embedding.tier.path', 'WHERE_IT_IS_NOW')} (moved?), or pass a new {run_dir_flag()} "
            "to start fresh"
        )


def _tiers_moved(step: int, saved, current, plan: EmbeddingPlan) -> str:
    names = lambda ts: ", ".join(plan.tables[t].spec.name for t in sorted(ts)) or "none"
    return (
        f"checkpoint step {step} keeps tables {names(saved)} in the disk tier, this config "
        f"{names(current)} (embedding.storage / embedding.table_storage); moving "
        f"tables between the devices and the tier on restore is not supported"
    )


def check_tiers_unmoved(ckpt_dir: Path, plan: EmbeddingPlan) -> None:
    """Refuses a resume whose plan keeps other tables in the disk tier than the newest
    checkpoint did, before a tier is made for it (the refusal came from the restore, after
    the run had made ``RUN_DIR/tier``, which it left behind)."""
    steps = saved_steps(ckpt_dir) if Path(ckpt_dir).is_dir() else []
    saved_plan = _saved_record(ckpt_dir, steps[-1]).get("plan") if steps else None
    if not saved_plan:  # (none, or unreadable: its restore reports that)
        return
    saved = frozenset(EmbeddingPlan.from_json(saved_plan).tiered_tables)
    if saved != frozenset(plan.tiered_tables):
        raise IncompatibleCheckpoint(_tiers_moved(steps[-1], saved, plan.tiered_tables, plan))


def saved_tiers(ckpt_dir: Path, asked: Config, step: int | None = None) -> SavedTiers | None:
    """Where checkpoint ``step`` (None: the newest) keeps its tables, of those the config it
    was saved with (``asked``) put in the disk tier; None where there is none."""
    tiered = tiered_in_checkpoint(ckpt_dir, step)
    return None if tiered is None else SavedTiers(tiered, frozenset(asked.tiered_tables))


def tiered_in_checkpoint(ckpt_dir: Path, step: int | None = None) -> frozenset[int] | None:
    """The tables checkpoint ``step`` (None: the newest) keeps in the disk tier; None where
    there is none, or it cannot be read (its restore reports that)."""
    steps = saved_steps(ckpt_dir) if Path(ckpt_dir).is_dir() else []
    step = steps[-1] if step is None and steps else step
    plan = _saved_record(ckpt_dir, step).get("plan") if step is not None else None
    return frozenset(EmbeddingPlan.from_json(plan).tiered_tables) if plan else None


COPY_THE_TIER = "copy the tier as well and resume with embedding.tier.path=THE_COPY"


def check_tier_owner(root: Path, run_dir: Path | None, ckpt_dir: Path | None) -> None:
    """Refuses (RunDirError) a disk tier at ``root`` that is not this run's: one the newest
    checkpoint in ``ckpt_dir`` was not saved with, or (a run with no checkpoints, which starts
    the tier anew) one that another run dir made. A tier inside ``run_dir`` is its own (a run
    dir moved with it); a tier without an owner record (made before them) is taken as it is."""
    owner = tier_owner(root)
    if owner is None:
        return
    steps = saved_steps(ckpt_dir) if ckpt_dir is not None else []
    saved = _saved_record(ckpt_dir, steps[-1]).get("tier") if steps else None
    inside = run_dir is not None and Path(root).absolute() == (Path(run_dir) / "tier").absolute()
    if saved is not None:
        if saved != owner.id:
            raise RunDirError(
                f"{root}: holds the disk tier of another run ({owner.maker()}), not the one the checkpoints in "
                f"{ckpt_dir} were saved with; give embedding.tier.path as this run left it"
            )
        if not inside and owner.trains_another_run(root, run_dir):  # this run dir is a copy of that one
            raise RunDirError(
                f"embedding.tier.path={root}: the disk tier of {owner.maker()}, which still trains on it; this "
                f"run dir's checkpoints were saved with it too (a copy of that run dir?), and the two would replace "
                f"each other's snapshots: {COPY_THE_TIER}"
            )
        if not owner.made_by(run_dir):  # a run dir moved, or copied with its tier: its tier now
            record_owner(root, run_dir, id=owner.id)
        return
    if not (inside or owner.made_by(run_dir)):
        raise RunDirError(
            f"embedding.tier.path={root}: holds the disk tier of {owner.maker()}, which this run would replace; "
            f"give this run a tier of its own (another embedding.tier.path), or remove {root} to start anew"
        )


def check_tier_of(root: Path, ckpt_dir: Path, step: int) -> None:
    """Refuses (RunDirError) to read checkpoint ``step``'s tiered tables from a tier at ``root``
    that it was not saved with (another run's tier at the same path)."""
    owner, saved = tier_owner(root), _saved_record(ckpt_dir, step).get("tier")
    if owner is not None and saved is not None and saved != owner.id:
        raise RunDirError(
            f"{root}: holds the disk tier of another run ({owner.maker()}), not the one checkpoint {step} in "
            f"{ckpt_dir} was saved with: its tiered tables are not there"
        )


def checkpoint_tier(steps: StepFunctions, plan: EmbeddingPlan, root: Path, run_dir: Path, step: int, log=print):
    """The tiered tables of ``run_dir``'s checkpoint ``step``, as the tier's snapshot of that
    step holds them (read-only: the run may be training), from the tier it was saved with."""
    check_tier_of(root, Path(run_dir) / "checkpoints", step)
    return TieredTables(
        plan,
        steps.collection.groups,
        steps.collection.optimizer,
        root,
        steps.embedding_key(),
        log=log,
        snapshot=step,
        maps=steps.tiered_maps,
    )


def _saved_record(ckpt_dir: Path, step: int) -> dict:
    """What checkpoint ``step`` saved beside its arrays (``checkpoint.saved_json``); empty where it
    cannot be read (a damaged checkpoint: its restore reports it)."""
    try:
        return saved_json(ckpt_dir, step)
    except Exception:  # noqa: BLE001 - reported by the restore
        return {}


def restore_or_init(
    steps: StepFunctions, ckpts: CheckpointReader | None, log, tiered: TieredTables | None = None
) -> TrainState:
    """The newest intact checkpoint's state, or (none saved yet) the initial one."""
    if ckpts is not None and ckpts.all_steps():
        step, state = restore_newest(steps, ckpts, log, tiered)
        log(f"resuming from checkpoint at step {step}")
        return state
    if tiered is None:
        return steps.init_state()
    _restore_tier(tiered, 0, None)  # the initial tables
    state = steps.init_state(hot=False)
    if steps.hot is not None:
        state = _hot_rows_from_tier(steps, tiered, state)
    return state
