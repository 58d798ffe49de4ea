"""Evaluating a saved run's checkpoint, read-only: the run may still be training there."""

from __future__ import annotations

import time
from pathlib import Path

import jax

from dlrm_jax.data.batch import check_source
from dlrm_jax.data.sources import data_identity, make_source
from dlrm_jax.jax_settings import with_library_settings
from dlrm_jax.parallel.mesh import host_scalar
from dlrm_jax.train.build import build, mesh_from_config
from dlrm_jax.train.checkpoint_reader import reading
from dlrm_jax.train.driver import DeviceDriver, StepDriver, TieredDriver
from dlrm_jax.train.evaluate import RunSummary
from dlrm_jax.train.progress import auc_note, checkpoint_step
from dlrm_jax.train.restore import checkpoint_tier, read_checkpoint, saved_run_config, saved_tiers
from dlrm_jax.train.rundir import data_change, given_source
from dlrm_jax.train.step import TrainState
from dlrm_jax.train.wiring import tier_root


@with_library_settings  # (whatever JAX settings the process has: see jax_settings)
def evaluate_run(
    run_dir: str | Path, overrides: list[str] = (), *, step: int | str | None = None, log=print, source=None
) -> RunSummary:
    """Evaluate ``run_dir``'s checkpoint at ``step`` (default the newest intact; ``best``: the
    best evaluation's, train.keep_best) with its saved config, on its config's data or
    ``source`` (a run trained on a source given to ``train_and_evaluate`` needs it: its
    config's data is not what it trained on). Read-only: the run may still be training there
    (nothing in ``run_dir`` is written, moved or deleted)."""
    log = log or (lambda *_: None)
    check_source(source)
    state, driver = restored(run_dir, overrides, step=step, log=log, source=source)
    try:
        start = time.perf_counter()
        auc, ll, samples = driver.evaluate(state)
        seconds = time.perf_counter() - start
    finally:
        driver.close()
    if note := auc_note(auc, ll, samples):
        log(f"note: {note}")
    return RunSummary(int(host_scalar(state.step)), ll, auc, ll, samples / seconds, eval_samples=samples)


def restored(
    run_dir: str | Path, overrides: list[str] = (), *, step: int | str | None = None, log=print, source=None
) -> tuple[TrainState, StepDriver]:
    """``run_dir``'s checkpoint at ``step`` (as :func:`evaluate_run` takes it), read-only, and a
    driver whose ``evaluate`` scores it (close it after: tiered tables hold their snapshot)."""
    run_dir = Path(run_dir)
    with reading(run_dir / "checkpoints") as leases:  # the run may be training, its rotation removing steps
        cfg = saved_run_config(run_dir, overrides)
        given = given_source(run_dir)
        if given and source is None:  # (it scored the config's synthetic data, without a word)
            raise ValueError(
                f"{run_dir}: trained on data given in Python ({given}), not its config's data.source="
                f"{cfg.data.source}: evaluate it on that data, evaluate_run(run_dir, source=...)"
            )
        mesh = mesh_from_config(cfg)
        made = source is None
        changed = data_change(run_dir, data_identity(cfg)) if made else ""
        if changed:
            log(f"warning: {changed}: it is scored on that data, whose ids may stand for other values than it learned")
        if made:
            source = make_source(cfg, jax.process_index(), jax.process_count(), trains=False, evaluates=True)
        elif hasattr(source, "check_config"):  # (as train_and_evaluate does)
            source.check_config(cfg, evaluates=True)
        step = checkpoint_step(run_dir / "checkpoints", step)
        plan, steps = build(cfg, mesh, source, log, saved_tiers(run_dir / "checkpoints", cfg, step))
        step, state = read_checkpoint(run_dir, cfg, steps, step, log=log, leases=leases)
        if plan.tiered_tables:  # the tier's snapshot of that step, not its working files
            tiered = checkpoint_tier(steps, plan, tier_root(cfg, run_dir), run_dir, step, log)
            driver = TieredDriver(steps, source, tiered, lookahead=0, log=log)
        else:
            driver = DeviceDriver(steps, source, readers=cfg.data.readers, prefetch=cfg.data.prefetch, log=log)
    driver.closes_source = made
    return state, driver
