"""``dlrm-jax bench input``: the input pipeline as training uses it, beside the train step.

For each case (the config's binary dataset with ``data.shuffle`` on and off, and synthetic
data) the pipeline of :mod:`dlrm_jax.data.pipeline` reads this process's batches, packed as
training reads them (:mod:`dlrm_jax.data.packed`), and places them on the current devices,
``data.readers`` threads ``data.prefetch`` steps ahead; nothing consumes them but a wait for
each to be on the devices, so its samples/s is what the input can feed (``samples_per_s``:
global, were every process as fast; ``process_samples_per_s``: this process's own rows).
Beside it: the same config's step-only samples/s (cached batches, ``bench train``'s measure)
and their ratio (above 1: the input outruns the step). Also the reading thread alone
(``read_samples_per_s``: ``BinarySource.train_batch`` on one thread, this process's rows),
the process's peak memory, and ``gil_wait``: how late a thread that gives up the GIL gets it
back while the pipeline runs (:mod:`dlrm_jax.bench.gil_wait`), what the readers cost the
training loop's dispatching thread at each of its waits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax

from dlrm_jax import hostmem
from dlrm_jax.bench import check_device_step
from dlrm_jax.bench.common import each_case, machine_description, write_report
from dlrm_jax.bench.gil_wait import GilWait
from dlrm_jax.bench.train import time_train_step
from dlrm_jax.data.batch import faster_path
from dlrm_jax.data.host_buffers import HostBuffers
from dlrm_jax.data.packed import packed_reader
from dlrm_jax.data.pipeline import InputPipeline, dispatched_ahead, input_readers
from dlrm_jax.data.reader_processes import ProcessReaders
from dlrm_jax.data.sources import make_source, resolve_data_config
from dlrm_jax.train.build import build, mesh_from_config


def _with_data(cfg, **data):
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **data))


def time_pipeline(cfg, steps: int) -> dict:
    """Samples/s of ``steps`` batches through the pipeline to the devices, after 2 warm-up
    steps; the GIL probe's figures over some more; and of the source's ``train_batch`` alone
    on this thread."""
    mesh = mesh_from_config(cfg)
    source = make_source(cfg, jax.process_index(), jax.process_count())
    _, fns = build(cfg, mesh, source, log=lambda *_: None)
    device_batches = faster_path(source, "device_batches")  # as training takes them
    hostmem.reset_peak_rss()
    # The GIL probe runs after the timed steps, over more of them (it takes a share of the
    # cores itself): the throughput is the pipeline's alone.
    probed, gil = max(10, steps // 2), GilWait()
    gil.idle()
    if device_batches is not None:  # generated on the devices: dispatched ahead, no host copy
        make = device_batches(fns.batch_sharding)
        # as training takes them: data.prefetch batches in flight, each awaited in turn
        for i, item in enumerate(dispatched_ahead(make, range(steps + 2 + probed), cfg.data.prefetch)):
            jax.block_until_ready(item.device)
            if i == 1:
                t0 = time.perf_counter()
            elif i == steps + 1:
                pipeline_s = time.perf_counter() - t0
                gil.start()
        gil.stop()
        read_s, times = float("nan"), {}
    else:
        layout = fns.packed_layout()  # as training reads: packed, one transfer, reused buffers
        buffers = HostBuffers.for_devices(cfg.data.host_memory, list(fns.batch_sharding.addressable_devices))
        in_processes = cfg.data.reader_processes
        read = ProcessReaders(source, layout, input_readers(cfg.data.readers), buffers) if in_processes else None
        with (
            contextlib.closing(buffers),
            contextlib.closing(read) if in_processes else contextlib.nullcontext(),
            InputPipeline(
                read or packed_reader(source, layout, buffers),
                range(steps + 2 + probed),
                to_device=fns.device_batch,
                readers=cfg.data.readers,
                depth=cfg.data.prefetch,
            ) as pipeline,
        ):
            for i, item in enumerate(pipeline):
                jax.block_until_ready(item.device)
                if i == 1:
                    t0, _ = time.perf_counter(), pipeline.times.take()
                elif i == steps + 1:
                    pipeline_s, times = time.perf_counter() - t0, pipeline.times.take()
                    gil.start()
            gil.stop()
            times |= buffers.stats()
        t1 = time.perf_counter()
        for step in range(steps):
            source.train_batch(step)
        read_s = time.perf_counter() - t1
    batch, processes = cfg.train.batch_size, jax.process_count()
    return {
        "samples_per_s": steps * batch / pipeline_s,  # global, were every process this fast
        "processes": processes,
        "process_samples_per_s": steps * batch / processes / pipeline_s,  # this process's own rows
        "read_samples_per_s": steps * batch / processes / read_s,
        "peak_rss_bytes": hostmem.peak_rss_bytes(),
        # what the readers cost a dispatching thread: its wait for the GIL at each wake-up
        "gil_wait": gil.result(),
        **times,
    }


def bench_input(cfg, *, steps: int, step_steps: int, output: str | None, log=print) -> dict:
    """Every case's pipeline samples/s beside the step's; a table, and JSON ``{"cases": [...]}``."""
    if step_steps:
        check_device_step("input", cfg)
    cases = []
    if cfg.data.source == "binary":
        cases += [_with_data(cfg, shuffle=True), _with_data(cfg, shuffle=False)]
    else:
        cases += [cfg] if cfg.data.source == "criteo" else []  # the text the user named, as train reads it
        log("binary cases: give a dataset with --set data.source=binary --set data.path=DATASET")
    synthetic = _with_data(cfg, source="synthetic", path="")
    cases.append(synthetic)
    results = []
    for case in each_case(cases):
        case = resolve_data_config(case)
        step = time_train_step(case, step_steps, warmup=2)["samples_per_s"] if step_steps else float("nan")
        r = {
            "source": case.data.source,
            "shuffle": case.data.shuffle if case.data.source == "binary" else None,
            "batch": case.train.batch_size,
            **time_pipeline(case, steps),
            "step_samples_per_s": step,
        }
        r["ratio"] = r["samples_per_s"] / step
        results.append(r)
    report = {
        "benchmark": "input",
        "timed_steps": steps,
        "readers": input_readers(cfg.data.readers),
        "prefetch": cfg.data.prefetch,
        "machine": machine_description(),
        "cases": results,
    }
    log(
        f"{'source':<10}{'shuffle':>8}{'batch':>8}{'input/s':>14}{'read/s (1 thread)':>19}{'step/s':>12}"
        f"{'ratio':>8}{'GIL wait ms (mean/p90/p99; idle mean)':>40}"
    )
    for r in results:
        busy, idle = r["gil_wait"]["busy"], r["gil_wait"]["idle"]
        wait = (
            f"{busy['mean_ms']:.2f}/{busy['p90_ms']:.2f}/{busy['p99_ms']:.2f}; {idle['mean_ms']:.2f}"
            if busy["wakes"]
            else "-"
        )
        log(
            f"{r['source']:<10}{str(r['shuffle']):>8}{r['batch']:>8}{r['samples_per_s']:>14,.0f}"
            f"{r['read_samples_per_s']:>19,.0f}{r['step_samples_per_s']:>12,.0f}{r['ratio']:>8.2f}{wait:>40}"
        )
    log(write_report(report, output))
    return report
