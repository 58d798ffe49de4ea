"""Restoring a run's train state from its checkpoints onto the current mesh and plan.

Tables saved under another plan (device count, strategy) are read lazily and re-laid out;
tiered tables come back from the disk tier's snapshot of the same step; hot rows are chosen
afresh when the layout changed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dlrm_jax.config import Config, load_config
from dlrm_jax.data.sources import resolve_data_config
from dlrm_jax.embedding.exchange.relayout import relayout, saved_shapes
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan
from dlrm_jax.embedding.tiers import hot as tier_hot
from dlrm_jax.embedding.tiers.tables import TieredTables
from dlrm_jax.parallel.mesh import host_scalar
from dlrm_jax.train.checkpoint import Checkpoints, IncompatibleCheckpoint, saved_json, saved_steps
from dlrm_jax.train.step import StepFunctions, TrainState


def saved_run_config(run_dir: Path, overrides=()) -> Config:
    """``run_dir``'s saved config (with ``overrides``), as its checkpoints need it: per-host
    tables come back on as many hosts as they were saved from, simulated in this process when
    it is one (``dlrm-jax eval`` or ``export`` of a run trained on several processes)."""
    cfg = resolve_data_config(load_config(Path(run_dir) / "config.yaml", overrides))
    steps = saved_steps(Path(run_dir) / "checkpoints")
    if cfg.embedding.tables_per_host and not cfg.mesh.hosts and steps:
        hosts = int(saved_json(Path(run_dir) / "checkpoints", steps[-1]).get("hosts") or 0)
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, hosts=hosts))
    return cfg


def restore_state(steps: StepFunctions, ckpts: Checkpoints, log=print, step: int | None = None,
                  tiered: TieredTables | None = None) -> TrainState:
    """The checkpoint at ``step`` (default newest) on this mesh and plan; tables saved under
    another plan (device count, strategy) are restored as saved, then re-laid out. ``tiered``:
    the disk tier, restored to its snapshot of that step (a step without one does not restore)."""
    state, relaid_out = _restore_state(steps, ckpts, log, step)
    if tiered is not None:
        tiered.restore(int(host_scalar(state.step)))
        if relaid_out and steps.hot is not None:  # the snapshot holds the hot rows: choose afresh
            state = _hot_rows_from_tier(steps, tiered, state)
    return state


def _hot_rows_from_tier(steps: StepFunctions, tiered: TieredTables, state: TrainState) -> TrainState:
    """The schedule's current hot set, tiered tables' rows read from the tier (its caches cold)."""
    return state._replace(emb=tier_hot.refresh(steps.collection, tiered, state.emb, steps.hot_keys()))


def _restore_state(steps: StepFunctions, ckpts: Checkpoints, log, step: int | None) -> tuple[TrainState, bool]:
    """(state, whether it was re-laid out from another plan)."""
    saved = EmbeddingPlan.from_json(ckpts.saved_plan(step))
    tiered = saved.tiered_tables
    saved = saved.device_view() if tiered else saved  # what the devices held
    current = steps.collection.plan
    if steps.per_host:
        _check_per_host(steps, ckpts, saved, step)
    counts = ckpts.saved_hot_counts(step)
    if steps.hot is not None and counts is not None:  # the statistics the saved run refreshes from
        steps.hot.load_json(counts)
    if saved == current:
        return steps.from_checkpoint_form(ckpts.restore(steps.abstract_state(), step)), False
    if tiered != steps.tiered_tables:
        names = lambda ts: ", ".join(current.tables[t].spec.name for t in ts) or "none"  # noqa: E731
        raise IncompatibleCheckpoint(f"checkpoint step {step} keeps tables {names(tiered)} in the disk tier, this config "
                         f"{names(steps.tiered_tables)} (embedding.storage / embedding.table_storage); moving "
                         f"tables between the devices and the tier on restore is not supported")
    log(f"re-laying out embedding tables saved on {saved.num_devices} devices for this plan")
    shapes = saved_shapes(saved, steps.collection.optimizer)
    state = steps.from_checkpoint_form(ckpts.restore_lazily(steps.abstract_state(), "emb", shapes, step))
    # Tiered tables' rows come from the tier's snapshot of this step; their caches start empty.
    emb = relayout(saved, state.emb, steps.collection, skip=frozenset(tiered))
    if steps.hot is not None and not tiered:  # hot rows chosen afresh from the statistics
        emb = steps.collection.refresh(emb, steps.hot_keys())
    return state._replace(emb=emb), True


def _check_per_host(steps: StepFunctions, ckpts: Checkpoints, saved: EmbeddingPlan, step: int | None) -> None:
    """Per-host tables restore only onto as many hosts, each with the plan they were saved with:
    there is no one right way to spread 2 hosts' diverged tables over 4 (or to re-lay out a
    leading hosts axis), so the user is told what the checkpoint needs."""
    hosts, step = ckpts.saved_hosts(step), ckpts.latest_step() if step is None else step
    if hosts != steps.hosts:
        raise IncompatibleCheckpoint(
            f"checkpoint step {step} holds the per-host tables of {hosts} hosts, this run has {steps.hosts} "
            f"(mesh.hosts, or one per process when 0); resume with {hosts} hosts (set mesh.hosts={hosts} "
            f"to simulate them in fewer processes)")
    if saved != steps.collection.plan:
        raise IncompatibleCheckpoint(
            f"checkpoint step {step} holds per-host tables laid out on {saved.num_devices} devices per host, "
            f"this run has {steps.collection.plan.num_devices}; per-host tables are not re-laid out: resume with "
            f"mesh.devices = {saved.num_devices * hosts} and the same embedding.sharding")


def restore_newest(steps: StepFunctions, ckpts: Checkpoints, log=print, tiered: TieredTables | None = None
                   ) -> tuple[int, TrainState]:
    """(step, state) of the newest checkpoint that restores; damaged newer ones are set aside."""
    return ckpts.restore_newest_intact(lambda s: restore_state(steps, ckpts, log, s, tiered), log)


def restore_or_init(steps: StepFunctions, ckpts: Checkpoints | None, log, tiered: TieredTables | None = None
                    ) -> TrainState:
    """The newest intact checkpoint's state, or (none saved yet) the initial one."""
    if ckpts is not None and ckpts.all_steps():
        step, state = restore_newest(steps, ckpts, log, tiered)
        log(f"resuming from checkpoint at step {step}")
        return state
    if tiered is None:
        return steps.init_state()
    tiered.restore(0)  # the initial tables
    state = steps.init_state(hot=False)
    if steps.hot is not None:
        state = _hot_rows_from_tier(steps, tiered, state)
    return state


