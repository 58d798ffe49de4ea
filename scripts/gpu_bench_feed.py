"""End to end, for ``scripts/gpu_bench.py``: ``dlrm-jax train`` as a user runs it, on synthetic
batches and on a binary dataset generated first (the feed's cost), with the input pipeline
alone (``dlrm-jax bench input``) and evaluation alone (``scripts/bench_eval.py``) beside it."""

from __future__ import annotations

import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from gpu_bench_cases import COMMON, CONFIGS, EXTRA_OVERRIDES, REPO

# What a run says of the batches' host buffers (made, their memory, pinned: data.host_memory).
INPUT_BUFFERS = ("input_buffers", "input_buffer_mb", "input_buffers_pinned")
# Steps of each end-to-end run traced (train.trace_steps: after its first 50-step window).
TRACE_STEPS = 20
# A feed variant's item that is not a config override: Python's GIL switch interval for the run
# (``sys.setswitchinterval``; 5 ms by default: how long a thread that wants the GIL waits before
# the holder must give it up). Whether the dispatching thread's lost time is the readers'
# GIL: a shorter interval bounds each wait for it.
SWITCH = "switch_interval_ms="


def dlrm_jax_command(more: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """``python -m dlrm_jax``, with a ``switch_interval_ms=`` item of ``more`` set before it
    starts; the rest of ``more``."""
    switch = [m[len(SWITCH) :] for m in more if m.startswith(SWITCH)]
    rest = [m for m in more if not m.startswith(SWITCH)]
    if not switch:
        return [sys.executable, "-m", "dlrm_jax"], rest
    code = f"import runpy, sys; sys.setswitchinterval({float(switch[-1]) / 1e3!r}); "
    code += "runpy.run_module('dlrm_jax', run_name='__main__', alter_sys=True)"
    return [sys.executable, "-c", code], rest


def train_end_to_end(
    name: str, steps: int, data: str | None = None, more: tuple[str, ...] = (), keep_trace: str | None = None
) -> dict:
    """``dlrm-jax train`` as a user runs it (its input pipeline, logging, the end's evaluation
    and checkpoint), at the benchmark's settings: its windows' samples/s, the input pipeline's
    and the dispatching thread's per-step figures, its wall time, and its ``trace`` event
    (``train.trace_steps``: the devices' busy and idle time per step in the loop itself).
    ``data``: a binary dataset to read instead of the synthetic batches made on the device;
    ``more``: overrides of this run alone; ``keep_trace``: where to copy the run's Perfetto
    trace (ui.perfetto.dev)."""
    path, extra = CONFIGS[name]
    run_dir = tempfile.mkdtemp(prefix="dlrm-gpu-train-")
    overrides = COMMON + extra + EXTRA_OVERRIDES + ["mesh.devices=1", f"train.steps={steps}", "train.log_every=50"]
    overrides += [f"train.trace_steps={TRACE_STEPS}"]
    python, more = dlrm_jax_command(more)
    overrides += more
    if data:
        overrides += ["data.source=binary", f"data.path={data}"]
    cmd = [*python, "train", "--config", os.path.join(REPO, path), "--run-dir", run_dir]
    t = time.perf_counter()
    done = subprocess.run(cmd + [a for o in overrides for a in ("--set", o)], cwd=REPO)
    wall = time.perf_counter() - t
    if done.returncode:
        return {"failed": done.returncode}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        events = [json.loads(line) for line in f]
    trains = [e for e in events if "loss" in e and e.get("samples_per_s")]  # train or eval
    # the first window compiles, the last evaluates and saves, the second holds the trace
    inner = trains[2:-1] or trains[1:-1] or trains
    trace = next((e for e in events if e.get("event") == "trace"), {})
    kept = glob.glob(os.path.join(trace.get("trace_dir", "-"), "**", "perfetto_trace.json.gz"), recursive=True)
    if keep_trace and kept:
        shutil.copy(kept[0], keep_trace)
    last = next(e for e in reversed(events) if "run_samples_per_s" in e)
    host = {
        k: statistics.median(e[k] for e in inner if k in e)
        for k in (
            "input_read_ms",
            "input_h2d_ms",
            "input_wait_ms",
            "dispatch_ms",
            "result_read_cpu_ms",
            "result_wait_ms",
        )
        if any(k in e for e in inner)
    }
    return {
        "steps": steps,
        "run_dir": run_dir,
        "data": data or "synthetic",
        "wall_s": wall,
        "window_samples_per_s": [e["samples_per_s"] for e in trains],
        "median_window_samples_per_s": statistics.median(e["samples_per_s"] for e in inner),
        "run_samples_per_s": last["run_samples_per_s"],
        "host_ms_per_step": host,
        # the batches' host buffers at the end (data.host_memory: pinned on GPUs unless pageable)
        "input_buffers": {k: inner[-1][k] for k in INPUT_BUFFERS if k in inner[-1]},
        "trace": {k: v for k, v in trace.items() if k.startswith("trace_") and k != "trace_dir"},
    }


def input_alone(name: str, data: str, more: tuple[str, ...] = ()) -> dict:
    """``dlrm-jax bench input`` on the binary dataset ``data`` (the pipeline alone, no step):
    the shuffled case's samples/s, its per-batch figures and ``gil_wait``, how late a thread
    that gives up the GIL gets it back while the readers run (the dispatching thread's lot)."""
    path, extra = CONFIGS[name]
    out = os.path.join(tempfile.mkdtemp(prefix="dlrm-gpu-input-"), "input.json")
    overrides = COMMON + extra + EXTRA_OVERRIDES + ["mesh.devices=1", "data.source=binary", f"data.path={data}"]
    python, more = dlrm_jax_command(more)
    cmd = [*python, "bench", "input", "--config", os.path.join(REPO, path)]
    cmd += [a for o in overrides + more for a in ("--set", o)] + ["--steps", "200", "--step-steps", "0"]
    if subprocess.run(cmd + ["--output", out], cwd=REPO, stdout=subprocess.DEVNULL).returncode:
        return {"failed": True}
    with open(out) as f:
        report = json.load(f)
    case = next(c for c in report["cases"] if c["source"] == "binary" and c["shuffle"])
    keep = ("samples_per_s", "read_samples_per_s", "input_read_ms", "input_h2d_ms", "gil_wait", *INPUT_BUFFERS)
    return {"readers": report["readers"], **{k: case[k] for k in keep if k in case}}


# Held-out batches of the feed's datasets: each run's last evaluation scores them, and
# scripts/bench_eval.py times evaluating the binary run's checkpoint over them.
EVAL_BATCHES = 16


def eval_alone(run_dir: str) -> dict:
    """``scripts/bench_eval.py`` on a run's checkpoint: the held-out split scored three times in
    one process (the first compiles), with the run's own readers."""
    out = os.path.join(tempfile.mkdtemp(prefix="dlrm-gpu-eval-"), "eval.json")
    cmd = [sys.executable, os.path.join(REPO, "scripts", "bench_eval.py"), "--run-dir", run_dir, "--out", out]
    if subprocess.run(cmd, cwd=REPO).returncode:
        return {"failed": True}
    with open(out) as f:
        return json.load(f)


# The feed's end-to-end cases: rows of the generated binary dataset per config (criteo_kaggle:
# 8M rows, 1.3 GB, 122 steps an epoch at 65,536; DLRM-DCNv2: 2M rows of 214 ids, 1.8 GB).
FEED_ROWS = {"criteo_kaggle": 8_000_000, "mlperf_dcnv2_capped": 2_000_000}


def feed_cases(
    names: list[str],
    steps: int,
    work: str,
    variants: list[tuple[str, ...]] = (),
    keep: str | None = None,
    into: dict | None = None,
    progress=lambda: None,
) -> dict:
    """Each config trained end to end twice by ``dlrm-jax train``: on synthetic batches made on
    the device, and on a binary dataset of the same kind of rows written first
    (:func:`~dlrm_jax.data.preprocessing.synthetic_dataset.write_synthetic_dataset`) read
    through the input pipeline; the ratio is the feed's cost. ``variants``: overrides the
    binary run is repeated with (``data.readers`` counts, say), each reported beside it;
    ``keep``: a folder for each run's Perfetto trace; ``into``: the dict the results go into,
    ``progress`` called after each run (the caller saves what has come)."""
    from dlrm_jax.config import load_config
    from dlrm_jax.data.preprocessing.synthetic_dataset import write_synthetic_dataset

    out = {} if into is None else into
    for name in names:
        path, extra = CONFIGS[name]
        cfg = load_config(os.path.join(REPO, path), COMMON + extra + EXTRA_OVERRIDES)
        rows = FEED_ROWS.get(name, 4_000_000)
        data = os.path.join(work, f"feed_{name}")
        t = time.perf_counter()
        val_rows = EVAL_BATCHES * cfg.train.batch_size
        write_synthetic_dataset(cfg, data, train_rows=rows, val_rows=val_rows, overwrite=True)
        made_s = time.perf_counter() - t
        kept = lambda label, name=name: os.path.join(keep, f"trace-{name}-{label}.json.gz") if keep else None
        out[name] = case = {"dataset_rows": rows, "dataset_write_s": made_s}
        case["synthetic"] = synthetic = train_end_to_end(name, steps, keep_trace=kept("synthetic"))
        progress()
        case["binary"] = binary = train_end_to_end(name, steps, data, keep_trace=kept("binary"))
        if "failed" not in synthetic and "failed" not in binary:
            ratio = binary["median_window_samples_per_s"] / synthetic["median_window_samples_per_s"]
            case["binary_over_synthetic"] = ratio
        progress()
        case["input_alone"] = {"default": input_alone(name, data)}
        if "failed" not in binary:
            case["eval_alone"] = eval_alone(binary["run_dir"])
        progress()
        for more in variants:
            label = " ".join(more)
            case[f"binary {label}"] = train_end_to_end(name, steps, data, more, kept(label.replace("=", "-")))
            case["input_alone"][" ".join(more)] = input_alone(name, data, more)
            progress()
        print(json.dumps({name: out[name]}), flush=True)
        shutil.rmtree(data, ignore_errors=True)
    return out
