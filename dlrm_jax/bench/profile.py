"""``dlrm-jax profile``: where a train step's time goes, phase by phase, and a trace to browse.

How each phase is timed (the output says so too):

- host phases (input pipeline, host->device) are timed alone on the host: reading this
  process's slice of a batch, then placing it on the devices and blocking until it is there.
  Synthetic data is made on the devices, as training makes it: that program is timed alone
  (``batches made``), and there is no host phase;
- device phases come from the compiled train step itself, traced with ``jax.profiler``: XLA
  records one event per executed operation (a thunk on CPU, a kernel on GPU), named after its
  instruction in the optimized program. Each instruction's metadata carries the named scope
  the step wrapped it in (``observe.trace.PHASE_SCOPES``); collectives are split off by opcode: the
  dense gradients' all-reduce from the dense scope, the gradient all-to-all from the sparse
  update. Times are summed over this process's devices and divided by devices and steps, so
  a phase's figure is the mean time one device spends in it per step. Operations fused across
  scopes are counted under the scope of the fusion's root.

With embedding.sync=per_host, the hosts' periodic table average (a program of its own) is
timed alone, blocking, and divided by ``embedding.sync_every``.

With tiered tables the steps run as training runs them (``TierRunner``: a planner thread,
fills read from the DRAM caches or the disk tier, evictions written back), each step blocked
on before the next; the dispatching thread's host work is timed in the run, by kind (waiting
for the planner, assembling and placing the fills, writing evictions back), and the device
caches' fill is a device phase of its own. The tier is made afresh in a folder of its own
under ``OUT`` (or ``embedding.tier.path``) and removed after: a training run's tier in the same
run dir, or at the same path, is never opened (restoring the initial tables there would replace
its snapshots).

The trace goes to ``OUT/profile-trace``, beside (not over) a training run's ``train.trace_steps``
trace in ``OUT/trace``; it replaces the last profile's trace only once whole (a profile stopped
or failing leaves that one, and ``profile.json``, as they were). The batches are placed on the devices before the steps run (so a step is
timed alone), at most :data:`PLACED_BATCHES` of them, used in turn.

Peak memory per device is the compiled step's own memory analysis.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from dlrm_jax import stopping
from dlrm_jax.config import Config, validated
from dlrm_jax.data.batch import faster_path, train_ids
from dlrm_jax.data.host_buffers import HostBuffers
from dlrm_jax.data.packed import packed_reader
from dlrm_jax.data.pipeline import input_readers
from dlrm_jax.data.sources import make_source, resolve_data_config
from dlrm_jax.embedding.hot.counts import RowCounts
from dlrm_jax.embedding.hot.schedule import HotSchedule
from dlrm_jax.embedding.tiers.tables import TieredTables
from dlrm_jax.files import check_dir, json_text, make_dir
from dlrm_jax.observe.trace import (
    DEVICE_PHASES,
    device_phase_ns,
    format_profile,
    instruction_phases,
)
from dlrm_jax.train.build import build, mesh_from_config
from dlrm_jax.train.driver import TieredDriver
from dlrm_jax.train.restore import restore_or_init

PLACED_BATCHES = 64  # distinct batches placed for the steps (more steps reuse them): memory stays bounded
TRACE = "profile-trace"


def profile(cfg: Config, out_dir: str | Path, steps: int = 10, warmup: int = 3, log=print) -> dict:
    """Run ``warmup`` then ``steps`` train steps of ``cfg``; print and return the per-phase table,
    write ``out_dir/profile.json`` and the trace under ``out_dir/profile-trace``."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"profile: needs steps >= 1 and warmup >= 0, got steps={steps} warmup={warmup}")
    out_dir = check_dir(out_dir, "run dir")  # before the steps run, not after
    if jax.process_index() == 0:
        make_dir(out_dir, "run dir")  # (one it cannot make is named now, not after the steps)
    cfg = resolve_data_config(validated(cfg))
    mesh = mesh_from_config(cfg)
    source = make_source(cfg, jax.process_index(), jax.process_count())
    plan, fns = build(cfg, mesh, source, log=lambda *_: None)
    driver, tier_dir = None, None
    if plan.tiered_tables:  # a tier of its own, made afresh (never a run's: see the module's doc)
        base = make_dir(
            cfg.embedding.tier.path or out_dir, "embedding.tier.path" if cfg.embedding.tier.path else "run dir"
        )
        tier_dir = Path(tempfile.mkdtemp(prefix="profile-tier-", dir=base))
        tiered = TieredTables(
            plan,
            fns.collection.groups,
            fns.collection.optimizer,
            tier_dir,
            fns.embedding_key(),
            int(cfg.embedding.tier.chunk_mb * 2**20),
            log=lambda *_: None,
            maps=fns.tiered_maps,
        )
        driver = TieredDriver(fns, source, tiered, cfg.embedding.tier.lookahead, log=lambda *_: None)
    try:
        return _profile(cfg, out_dir, mesh, source, fns, driver, steps, max(warmup, 1), log)
    finally:
        if driver is not None:
            driver.tiered.close()
        if tier_dir is not None:
            shutil.rmtree(tier_dir, ignore_errors=True)


def _placed_batches(fns, source, count: int, data, tiered: bool):
    """The batches placed on the devices as training places them, their ids on the host (read
    only where hot-row counting is profiled) and the profile's input rows. Read on the host:
    packed, one transfer, from the host buffers ``data.host_memory`` asks for, the read and
    the transfer each timed alone. Made on the devices (synthetic data, as training makes
    it): that program timed alone, and no host phase, as training has none."""
    counted = fns.hot is not None and fns.hot.refresh_every
    make = None if tiered else faster_path(source, "device_batches")
    if make is not None:
        make, made_s, batches = make(fns.batch_sharding), [], []
        for i in range(count):
            t0 = time.perf_counter()
            batches.append(jax.block_until_ready(make(i)))
            made_s.append(time.perf_counter() - t0)
        ids = [train_ids(source, i) for i in range(count)] if counted else []
        how = "its own program on the devices, timed alone; training dispatches it ahead of the steps"
        return batches, ids, [{"name": "batches made", "ms": 1e3 * float(np.median(made_s)), "how": how}]
    input_s, h2d_s, batches, ids = [], [], [], []
    buffers = HostBuffers.for_devices(data.host_memory, list(fns.batch_sharding.addressable_devices))
    read = packed_reader(source, fns.packed_layout(), buffers)
    for i in range(count):
        t0 = time.perf_counter()
        host = read(i)
        t1 = time.perf_counter()
        batches.append(jax.block_until_ready(fns.device_batch(host)))
        input_s.append(t1 - t0)
        h2d_s.append(time.perf_counter() - t1)
        if counted:
            ids.append(host.ids)
    buffers.close()  # (each buffer freed when its batch is gone)
    how = f"host, timed alone; in {input_readers(data.readers)} reader threads, off the dispatching thread"
    return (
        batches,
        ids,
        [
            {"name": "input pipeline", "ms": 1e3 * float(np.median(input_s)), "how": how},
            {"name": "host->device", "ms": 1e3 * float(np.median(h2d_s)), "how": how},
        ],
    )


def _step_runner(fns, source, driver: TieredDriver | None, batches, count: int, log):
    """(initial state, ``one(state, i) -> (state, out)`` running train step ``i``, a function
    giving the step's compiled program once a step ran). Device tables: the batches placed
    beforehand, so the step is timed alone; tiered ones: the steps as training's driver runs them."""
    if driver is None:
        state = fns.init_state()
        compiled = fns.train_step.lower(state, batches[0]).compile()
        return state, (lambda state, i: compiled(state, batches[i % len(batches)])[:2]), lambda state: compiled
    state = restore_or_init(fns, None, log, driver.tiered)
    items = iter(driver.batches(state, 0, count))

    def one(state, i):
        stepped = driver.run(state, next(items))
        return driver.after_step(stepped.state, i + 1, stepped.ids), stepped.out  # a due refresh, as in training

    return state, one, lambda state: fns.train_step.lower(state, *driver.runner.step_input_shapes()).compile()


def _profile(
    cfg: Config, out_dir: Path, mesh, source, fns, driver: TieredDriver | None, steps: int, warmup: int, log
) -> dict:
    batches, host_ids, rows = _placed_batches(
        fns, source, min(warmup + steps, PLACED_BATCHES), cfg.data, driver is not None
    )
    state, one, compiled_step = _step_runner(fns, source, driver, batches, warmup + steps, lambda *_: None)
    for i in range(warmup):
        stopping.raise_if_stopped()  # (a stop waits for the step under way: see the CLI's profile)
        state, out = one(state, i)
    jax.block_until_ready(state)
    compiled = compiled_step(state)
    phases = instruction_phases(compiled.as_text())
    if driver is not None:
        driver.runner.host_s.clear()

    # Traced beside the last profile's trace, which is replaced once this one is whole: a
    # profile stopped or failing leaves the last one, and its profile.json, as they were.
    trace_dir = out_dir / TRACE / f"process_{jax.process_index()}"
    tracing = trace_dir.with_name(trace_dir.name + ".partial")
    shutil.rmtree(tracing, ignore_errors=True)  # one a stopped profile left
    stopping.raise_if_stopped()  # (not inside the trace: the profiler's stop then never returned)
    walls = []
    with jax.profiler.trace(str(tracing), create_perfetto_trace=True):
        for i in range(warmup, warmup + steps):
            t0 = time.perf_counter()
            state, out = one(state, i)
            jax.block_until_ready((state, out))
            walls.append(time.perf_counter() - t0)
    stopping.raise_if_stopped()
    sync_every = fns.collection.sync_every  # per-host tables' periodic average
    sync_s = []
    for _ in range(steps if sync_every else 0):  # its own program: timed alone
        t0 = time.perf_counter()
        state = state._replace(emb=jax.block_until_ready(fns.collection.after_step(state.emb, sync_every)))
        sync_s.append(time.perf_counter() - t0)
    local = len(mesh.local_devices)
    per_phase = device_phase_ns(str(tracing), phases)
    rows += _hot_counting_rows(fns, host_ids)
    if driver is not None:
        rows += [
            {"name": f"tier {kind}", "ms": 1e3 * driver.runner.host_s[kind] / steps, "how": "host, in the run"}
            for kind in ("planner wait", "fill assembly + h2d", "write-back")
        ]
    rows += [
        {"name": name, "ms": per_phase[name] / 1e6 / steps / local, "how": "trace"}
        for name in DEVICE_PHASES
        if name in per_phase
    ]
    if sync_s:
        rows.append(
            {
                "name": "table sync over hosts",
                "ms": 1e3 * float(np.median(sync_s[1:] or sync_s)) / sync_every,
                "how": f"timed alone, / sync_every={sync_every}",
            }
        )
    result = {
        "devices": mesh.size,
        "tiered": driver is not None,
        "processes": jax.process_count(),
        "backend": jax.default_backend(),
        "steps": steps,
        "batch_size": cfg.train.batch_size,
        "step_wall_ms": 1e3 * float(np.median(walls)),
        "phases": rows,
        "memory_per_device": _memory(compiled),
        "trace_dir": str(out_dir / TRACE),
    }
    # Process 0's table, as its profile.json (every process's own, the same figures to within the
    # noise, was printed before: a launch's terminal showed it once a process); each process's
    # trace is its own, under trace_dir.
    for line in format_profile(result) if jax.process_index() == 0 else ():
        log(line)
    shutil.rmtree(trace_dir, ignore_errors=True)
    tracing.rename(trace_dir)
    if jax.process_index() == 0:
        make_dir(out_dir, "run dir")
        (out_dir / "profile.json").write_text(json_text(result, indent=1) + "\n")
    return result


def _hot_counting_rows(fns, host_ids: list) -> list[dict]:
    """Hot-row statistics as training keeps them: each counted batch (the ``window`` before
    every refresh) is counted on the schedule's counting threads, and at a refresh the
    dispatching thread sums the window and chooses the rows; both amortised over the refresh
    period. Timed on a copy of the schedule (this process's rows: no all-gather)."""
    hot = fns.hot
    if hot is None or not hot.refresh_every:
        return []
    count_s = []
    for ids in map(np.asarray, host_ids[:4]):
        t0 = time.perf_counter()
        RowCounts.from_batches([ids], hot.bag_sizes)
        count_s.append(time.perf_counter() - t0)
    refresh_s = []
    for _ in range(2):
        copy = HotSchedule(
            hot.capacity,
            hot.bag_sizes,
            hot.counts,
            window=hot.window,
            refresh_every=hot.refresh_every,
            decay=hot.decay,
            threads=hot.threads,
        )
        counted = min(hot.window, hot.refresh_every)
        for i in range(counted):
            copy.add(host_ids[i % len(host_ids)])
        t0 = time.perf_counter()  # the refresh right after the window's last step was dispatched
        copy.refresh()
        refresh_s.append(time.perf_counter() - t0)
        copy.close()
    share = counted / hot.refresh_every
    return [
        {
            "name": "hot-row id counting",
            "ms": 1e3 * float(np.median(count_s)) * share,
            "how": f"host, timed alone; per counted batch x {share:.2f} of the steps, on {hot.threads} counting thread(s)",
        },
        {
            "name": "hot-row refresh choice",
            "ms": 1e3 * min(refresh_s) / hot.refresh_every,
            "how": f"dispatching thread: waits for the window's counts, sums them, chooses; / refresh_every={hot.refresh_every}",
        },
    ]


def _memory(compiled) -> dict:
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend reports memory
        return {}
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return {
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "aliased": m.alias_size_in_bytes,
        "temp": m.temp_size_in_bytes,
        "peak": total,
    }
