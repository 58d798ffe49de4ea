"""The training driver: ``train_and_evaluate(cfg, run_dir)`` reads top to bottom."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from dlrm_jax.config import Config, dump_config
from dlrm_jax.data.batch import Batch, DataSource
from dlrm_jax.data.pipeline import prefetch
from dlrm_jax.data.sources import make_source, resolve_data_config
from dlrm_jax.embedding.collection import EmbeddingCollection
from dlrm_jax.embedding.optimizers import sparse_optimizer_from_config
from dlrm_jax.embedding.plan import EmbeddingPlan
from dlrm_jax.embedding.planner import plan_from_config
from dlrm_jax.embedding.stats import plan_report
from dlrm_jax.parallel.mesh import AXIS, make_mesh
from dlrm_jax.train.checkpoint import Checkpoints
from dlrm_jax.train.metrics import MetricsWriter, log_loss, roc_auc
from dlrm_jax.train.step import StepFunctions, TrainState


@dataclass(frozen=True)
class RunSummary:
    """What a run ended with; ``final_line()`` is the CLI's contract line."""

    step: int
    loss: float
    auc: float
    logloss: float
    samples_per_s: float

    def final_line(self) -> str:
        return (f"final step={self.step} loss={self.loss:.6f} auc={self.auc:.6f} "
                f"logloss={self.logloss:.6f} samples_per_s={self.samples_per_s:.1f}")


def host_scalar(x) -> float:
    """A replicated scalar's value; works when the array spans other processes' devices too."""
    return float(np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else x)


CALIBRATION_BATCHES = 4


def build(cfg: Config, mesh: jax.sharding.Mesh, source: DataSource | None = None
          ) -> tuple[EmbeddingPlan, StepFunctions]:
    """Plan the tables for this mesh and build the jitted steps (no state allocated yet).

    With a data source and ``embedding.capacity_from=measured``, the all-to-all buckets are
    sized from the distinct requests of the first training batches (always the same batches,
    so a resumed run compiles the same step).
    """
    if cfg.train.batch_size % mesh.size:
        raise ValueError(f"train.batch_size={cfg.train.batch_size} must be divisible by the "
                         f"{mesh.size} devices of the mesh (mesh.devices)")
    plan = plan_from_config(cfg, mesh.size, budget_bytes=_device_budget(cfg))
    optimizer = sparse_optimizer_from_config(cfg)
    collection = EmbeddingCollection(plan, mesh, optimizer)
    if source is not None and cfg.embedding.capacity_from == "measured" and mesh.size > 1:
        batch_sharding = NamedSharding(mesh, P(AXIS))
        ids = [jax.make_array_from_process_local_data(batch_sharding, source.train_batch(i).ids)
               for i in range(CALIBRATION_BATCHES)]
        capacities = collection.measure_capacities(ids, cfg.embedding.capacity_factor)
        plan = dataclasses.replace(plan, capacities=capacities)
        collection = EmbeddingCollection(plan, mesh, optimizer)
    return plan, StepFunctions(cfg, mesh, collection)


def _device_budget(cfg: Config) -> int:
    """embedding.memory_budget_gb, or on an accelerator 90% of what its memory stats report."""
    if cfg.embedding.memory_budget_gb:
        return int(cfg.embedding.memory_budget_gb * 2**30)
    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    return int(0.9 * stats["bytes_limit"]) if stats and "bytes_limit" in stats else 0


def evaluate(steps: StepFunctions, state: TrainState, source: DataSource) -> tuple[float, float]:
    """Exact AUC and logloss over the held-out batches (every process gets the same numbers)."""
    per_process = steps.cfg.train.batch_size // jax.process_count()
    probs, labels = [], []
    for batch in source.eval_batches():
        n = batch.size
        padded = Batch(*(np.concatenate([x, np.zeros((per_process - n, *x.shape[1:]), x.dtype)])
                         if n < per_process else x for x in batch))
        out = steps.eval_step(state, steps.device_batch(padded))
        shards = sorted(out.addressable_shards, key=lambda s: s.index[0].start or 0)
        probs.append(np.concatenate([np.asarray(s.data) for s in shards])[:n])
        labels.append(batch.labels)
    p, y = np.concatenate(probs), np.concatenate(labels)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        p, y = (np.asarray(multihost_utils.process_allgather(a, tiled=True)) for a in (p, y))
    return roc_auc(y, p), log_loss(y, p)


def _prepare_run_dir(run_dir: Path | None, cfg: Config, plan: EmbeddingPlan) -> None:
    if run_dir is None or jax.process_index() != 0:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    (run_dir / "plan.txt").write_text(plan_report(plan) + "\n")
    (run_dir / "plan.json").write_text(plan.to_json() + "\n")


def restore_state(steps: StepFunctions, ckpts: Checkpoints, log=print) -> TrainState:
    """The newest checkpoint on this mesh and plan; tables saved under another plan (device
    count, strategy) are restored as saved, then re-laid out."""
    saved = EmbeddingPlan.from_json(ckpts.saved_plan())
    current = steps.collection.plan
    if saved == current:
        return ckpts.restore(steps.abstract_state())
    log(f"re-laying out embedding tables saved on {saved.num_devices} devices for this plan")
    abstract = steps.abstract_state()._replace(emb=steps.collection.abstract_state_for(saved))
    state = ckpts.restore(abstract)
    return state._replace(emb=steps.collection.relayout(state.emb, saved))


def _restore_or_init(steps: StepFunctions, ckpts: Checkpoints | None, log) -> TrainState:
    if ckpts is not None and ckpts.latest_step() is not None:
        log(f"resuming from checkpoint at step {ckpts.latest_step()}")
        return restore_state(steps, ckpts, log)
    return steps.init_state()


def train_and_evaluate(cfg: Config, run_dir: str | Path | None = None, *, log=print) -> RunSummary:
    """Train ``cfg`` on the current devices, resuming from ``run_dir``'s newest checkpoint."""
    run_dir = Path(run_dir) if run_dir else None
    cfg = resolve_data_config(cfg)
    mesh = make_mesh(cfg.mesh.devices)
    source = make_source(cfg, jax.process_index(), jax.process_count())
    plan, steps = build(cfg, mesh, source)
    _prepare_run_dir(run_dir, cfg, plan)
    log(plan_report(plan))
    t = cfg.train
    ckpts = Checkpoints(run_dir / "checkpoints", t.keep_checkpoints) if run_dir else None
    metrics = MetricsWriter(run_dir / "metrics.jsonl" if run_dir and jax.process_index() == 0 else None)
    state = _restore_or_init(steps, ckpts, log)
    plan_json = plan.to_json()
    start = int(host_scalar(state.step))
    metrics.truncate_after(start)

    t0 = time.perf_counter()
    compiled = steps.train_step.lower(state, steps.device_batch(source.train_batch(start))).compile()
    log(f"compiled the train step in {time.perf_counter() - t0:.1f}s on {mesh.size} "
        f"{jax.default_backend()} devices in {jax.process_count()} process(es); {_memory_report(compiled)}")

    bar = tqdm(total=t.steps, initial=start, unit="step", file=sys.stderr, dynamic_ncols=True,
               disable=not t.progress_bar or jax.process_index() != 0)
    window_loss, window_steps, window_start, window_overflows = 0.0, 0, None, 0
    train_time, trained_steps, last_loss = 0.0, 0, float("nan")
    batches = prefetch(lambda s: steps.device_batch(source.train_batch(s)), range(start, t.steps))
    for step, batch in zip(range(start + 1, t.steps + 1), batches, strict=True):
        if window_start is None:
            window_start = time.perf_counter()
        state, out = compiled(state, batch)
        window_loss, window_steps = window_loss + out["loss"], window_steps + 1
        window_overflows = window_overflows + out["exchange_overflows"]
        bar.update(1)
        boundary = step == t.steps or (t.log_every and step % t.log_every == 0) or (
            t.eval_every and step % t.eval_every == 0) or (t.checkpoint_every and step % t.checkpoint_every == 0)
        if not boundary:
            continue
        last_loss = host_scalar(window_loss) / window_steps  # waits for the device
        elapsed = time.perf_counter() - window_start
        train_time, trained_steps = train_time + elapsed, trained_steps + window_steps
        rate = window_steps * t.batch_size / elapsed
        if not math.isfinite(last_loss):
            raise FloatingPointError(f"training loss became {last_loss} at step {step}; stopping")
        event = {"event": "train", "step": step, "loss": last_loss, "samples_per_s": rate,
                 "learning_rate": float(steps.schedule(step - 1)),
                 "exchange_overflows": int(host_scalar(window_overflows))}
        bar.set_postfix(loss=f"{last_loss:.4f}", samples_per_s=f"{rate:,.0f}")
        if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
            auc, ll = evaluate(steps, state, source)
            event.update(event="eval", auc=auc, logloss=ll)
            bar.write(f"step {step}: loss {last_loss:.4f} eval auc {auc:.4f} logloss {ll:.4f}")
        metrics.write(event)
        if ckpts and ((t.checkpoint_every and step % t.checkpoint_every == 0) or step == t.steps):
            ckpts.save(step, state, plan_json)
        window_loss, window_steps, window_start, window_overflows = 0.0, 0, None, 0
    bar.close()

    if trained_steps == 0:  # already finished: evaluate what the checkpoint holds
        auc, ll = evaluate(steps, state, source)
    if ckpts:
        ckpts.close()
    rate = trained_steps * t.batch_size / train_time if train_time else float("nan")
    return RunSummary(int(host_scalar(state.step)), last_loss, auc, ll, rate)


def _memory_report(compiled) -> str:
    try:
        m = compiled.memory_analysis()
        total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
        return f"per-device memory {total / 2**20:.1f} MiB (temp {m.temp_size_in_bytes / 2**20:.1f} MiB)"
    except Exception:  # noqa: BLE001 - not every backend reports memory
        return "memory analysis unavailable"


def evaluate_run(run_dir: str | Path, overrides: list[str] = (), *, log=print) -> RunSummary:
    """Evaluate the newest checkpoint of ``run_dir`` with its saved config."""
    from dlrm_jax.config import load_config

    run_dir = Path(run_dir)
    cfg = resolve_data_config(load_config(run_dir / "config.yaml", overrides))
    mesh = make_mesh(cfg.mesh.devices)
    source = make_source(cfg, jax.process_index(), jax.process_count())
    _, steps = build(cfg, mesh, source)
    ckpts = Checkpoints(run_dir / "checkpoints", cfg.train.keep_checkpoints)
    if ckpts.latest_step() is None:
        raise FileNotFoundError(f"{run_dir / 'checkpoints'}: no checkpoint to evaluate")
    state = restore_state(steps, ckpts, log)
    auc, ll = evaluate(steps, state, source)
    ckpts.close()
    return RunSummary(int(host_scalar(state.step)), ll, auc, ll, float("nan"))
