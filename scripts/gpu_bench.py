#!/usr/bin/env python3
"""GPU figures for one device: throughput, bytes per sample, roofline, profile, determinism.

    python scripts/gpu_bench.py --out DIR                 # everything, on the default device
    python scripts/gpu_bench.py --out DIR --only ceilings # just the measured HBM and GEMM rates

For each config (``criteo_kaggle``; MLPerf-v1 and DLRM-DCNv2 shapes with tables capped to fit;
the v1 shape with uniform and Zipf 1.05 ids) it:
1. times the compiled train step back to back (pipelined, as training runs) and one at a time;
2. counts the bytes the step must move per sample (every input read once, every output written
   once: the distinct embedding rows of each batch read, then read and written by the sparse
   update; the dense inputs; the MLP weights) and the MLP/interaction FLOPs per sample;
3. turns those into a roofline from the *measured* copy bandwidth and bf16 GEMM rate, and
   reports the fraction reached;
4. traces a few steps with ``jax.profiler`` and prints what dominates the device time;
5. trains the same steps twice from the same seed and compares every parameter bit for bit
   (``--determinism-steps 0``: not);
6. sets the step-time model's prediction for the same plan (what ``dlrm-jax plan`` prints, on
   the ``h100`` profile with the card's own memory) beside the measured step.

``--train-configs`` are then trained end to end by ``dlrm-jax train`` (its input pipeline,
logging, evaluation and checkpoint), whose samples/s is set beside the step's alone; and
``--feed-configs`` twice, on synthetic batches and on a binary dataset of the same rows
generated first (``--only feed`` for these alone), with the input pipeline's per-step figures.

Each variant (``--variants``: the default; ``embedding.deterministic``, twice, the second
process loading the first one's autotuning results; ``embedding.sparse_update=xla`` (the
default, ``auto``, is ``fused`` on GPUs); ``embedding.sparse_update=fused``, twice the same
way, and with the row kernel's programs capped; XLA's two deterministic flags; the
``-nvptx-allow-ftz-atomics`` workaround for slow contended float atomics) runs in a process of its own, since XLA reads its flags once at start-up. ``--only parity`` compares a
small fp32 run on the device with the CPU.

Everything lands in DIR/gpu_bench.json; the tables are printed last.
"""

from __future__ import annotations

import argparse
import collections
import glob
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

CONFIGS = {
    "criteo_kaggle": ("configs/criteo_kaggle.yaml", []),
    # MLPerf v1 shapes, batch 64k; tables capped at 10M rows (54M rows x 128 x 4 B = 28 GB) so
    # that they fit one 80 GB GPU with room for the step's temporaries.
    "mlperf_v1_capped": ("configs/mlperf_dlrm_v1.yaml", ["data.max_rows=10000000"]),
    # The same with uniform ids: no repeated rows to help the gather and the update.
    "mlperf_v1_capped_uniform": ("configs/mlperf_dlrm_v1.yaml", ["data.max_rows=10000000", "data.zipf_exponent=0.0"]),
    # Zipf 1.05, the skew of the reported GPU scatter-add slowdown under index contention
    # (openxla/xla#46225, jax-ml/jax#38806): most lookups land on a few rows.
    "mlperf_v1_capped_zipf105": ("configs/mlperf_dlrm_v1.yaml", ["data.max_rows=10000000", "data.zipf_exponent=1.05"]),
    # DLRM-DCNv2 (multi-hot bags, 214 lookups a sample, cross network), tables capped at 10M
    # rows (54M rows x 128 x 4 B = 28 GB), with its own optimizers (Adagrad, row-wise Adagrad).
    # The same with SGD for the tables and the MLPs (COMMON's): the step without the
    # optimizers' state, what row-wise Adagrad's update is held against.
    "mlperf_dcnv2_capped_sgd": ("configs/mlperf_dlrm_dcnv2.yaml", ["data.max_rows=10000000"]),
    "mlperf_dcnv2_capped": (
        "configs/mlperf_dlrm_dcnv2.yaml",
        [
            "data.max_rows=10000000",
            "train.optimizer=adagrad",
            "train.learning_rate=0.005",
            "embedding.optimizer=rowwise_adagrad",
            "embedding.learning_rate=0.005",
        ],
    ),
}
# Issue 49's speed target, run on request (``--configs criteo_kaggle,criteo_kaggle_row_blocks,
# criteo_kaggle_dynamic --variants default --train-configs criteo_kaggle,criteo_kaggle_dynamic``):
# every table dynamic with configs/stream.yaml's map (the synthetic ids serve as raw ids), held
# against the same model with vocabulary ids, and with every table row-wise in blocks (the
# layout dynamic tables are given).
ON_REQUEST = {
    "criteo_kaggle_row_blocks": (
        "configs/criteo_kaggle.yaml",
        ["embedding.sharding=row", "embedding.row_layout=block"],
    ),
    "criteo_kaggle_dynamic": (
        "configs/criteo_kaggle.yaml",
        [
            "embedding.ids=dynamic",
            "embedding.dynamic.policy=lfu",
            "embedding.dynamic.half_life=64",
            "embedding.dynamic.admit=2",
            "embedding.dynamic.vshards=8",
            "embedding.dynamic.probes=8",
        ],
    ),
}
DEFAULT_CONFIGS = ",".join(CONFIGS)
CONFIGS.update(ON_REQUEST)
AUTOTUNE_FILE = os.path.join(tempfile.gettempdir(), "dlrm_gpu_bench_autotune.textproto")
FUSED_AUTOTUNE_FILE = os.path.join(tempfile.gettempdir(), "dlrm_gpu_bench_autotune_fused.textproto")
# Each variant's XLA flags and config overrides; a variant runs in a process of its own (XLA
# reads its flags at start-up).
VARIANTS = {
    # The default (on GPUs the fused update), its autotuning kept for ``fused_again``.
    "default": (f"--xla_gpu_dump_autotune_results_to={FUSED_AUTOTUNE_FILE}", []),
    # Ours: exact (order-independent) sums of duplicate rows' gradients.
    "embedding_deterministic": (
        f"--xla_gpu_dump_autotune_results_to={AUTOTUNE_FILE}",
        ["embedding.deterministic=true"],
    ),
    # The same in a second process that loads the first one's autotuning choices: XLA times GEMM
    # and fusion configurations afresh in every process, and a different choice sums in a
    # different order.
    "embedding_deterministic_again": (
        f"--xla_gpu_load_autotune_results_from={AUTOTUNE_FILE}",
        ["embedding.deterministic=true"],
    ),
    # The sparse update's XLA form (on GPUs the default, ``auto``, is the fused one).
    "xla": ("", ["embedding.sparse_update=xla"]),
    # The fused sparse update (Pallas kernels: each row's lookups summed in a fixed order and
    # the optimizer applied once), twice in two processes sharing the dense side's autotuning.
    "fused": (f"--xla_gpu_dump_autotune_results_to={FUSED_AUTOTUNE_FILE}", ["embedding.sparse_update=fused"]),
    # The fused update's row kernel with at most 65,536 programs (each taking distinct rows
    # until they run out) instead of one per 4 lookups, most of them idle.
    "fused_programs": ("", ["embedding.sparse_update=fused", "embedding.fused_programs=65536"]),
    "fused_again": (f"--xla_gpu_load_autotune_results_from={FUSED_AUTOTUNE_FILE}", ["embedding.sparse_update=fused"]),
    # Control flow on the device: XLA's GPU runtime reads a loop's predicate and a switch's
    # index on the host (a MemcpyD2H and a wait each time, the device idle meanwhile) unless
    # the loop or switch is recorded into a command buffer (CUDA graph conditional nodes). The
    # dynamic tables' step has a switch, conditionals and while loops (issue 49's 1.3 ms idle
    # a step on one H200); run it as ``device_control:criteo_kaggle_dynamic``.
    "device_control": ("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL", []),
    # The dynamic step's switch among prefix sizes of the batch's distinct ids on a GPU, nothing
    # else of the branches: one index read on the host a step for work that follows the
    # distinct ids rather than all N.
    "prefixes": ("", ["embedding.dynamic.control_flow=prefixes"]),
    # The CPUs' form of the dynamic step on a GPU: its switch among prefix sizes, the sketches'
    # halving in a conditional, loops that end when their work does.
    "branches": ("", ["embedding.dynamic.control_flow=branches"]),
    # The dynamic step's branches on a GPU (a switch among prefix sizes of the batch's distinct
    # ids: the least work, about 1.2x the distinct ids against all N on one path), its loops and
    # switches recorded into CUDA graphs so that none is read on the host.
    "branches_device_control": (
        "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
        ["embedding.dynamic.control_flow=branches"],
    ),
    # XLA's: every scatter sorted and scanned, autotuning kept.
    "exclude_nondeterministic_ops": ("--xla_gpu_exclude_nondeterministic_ops=true", []),
    # XLA's, and no autotuning either.
    "deterministic_ops": ("--xla_gpu_deterministic_ops=true", []),
    # The reported workaround for slow float atomics under index contention.
    "ftz_atomics": ("--xla_backend_extra_options=-nvptx-allow-ftz-atomics", []),
    # The step fed as training on a dataset feeds it: one array of bytes a batch, split into
    # its fields inside the step (data/packed.py); the other variants feed the three fields.
    "packed_input": ("", []),
    # The dot interaction's pairs by the Pallas kernels (model/pairs_kernel.py): no N x N
    # products in memory, no gather reading them by columns (dot models only).
    "pairs_fused": ("", ["model.dot_pairs=fused"]),
}
COMMON = [
    "train.batch_size=65536",
    "train.compute_dtype=bfloat16",
    "train.optimizer=sgd",
    "train.learning_rate=0.1",
    "train.warmup_steps=0",
    "train.decay_steps=0",
    "embedding.optimizer=sgd",
    "embedding.learning_rate=0.1",
    "data.source=synthetic",
]


def _median_time(fn, *args, repeats: int = 20) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_ceilings() -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and bf16 GEMM rate, on random data."""
    import jax
    import jax.numpy as jnp

    n = 1 << 30  # 1 Gi float32 = 4 GiB read + 4 GiB written
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    scale = jax.jit(lambda v: v * 1.0009765625)
    copy_s = _median_time(scale, x)
    del x
    m = 8192
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    mm = jax.jit(jnp.dot)
    gemm_s = _median_time(mm, a, b)
    return {
        "copy_bytes_per_s": 2 * 4 * n / copy_s,
        "bf16_gemm_flops_per_s": 2 * m**3 / gemm_s,
        "copy_s": copy_s,
        "gemm_s": gemm_s,
    }


def step_cost(cfg, plan, batches) -> dict:
    """FLOPs and the fewest bytes per sample the train step must move."""
    import numpy as np

    d = cfg.model.embedding_dim
    table_item = np.dtype(cfg.embedding.dtype).itemsize
    # MLPs: forward 2*in*out per layer, backward twice that (input and weight gradients).
    flops = 0
    width = cfg.data.num_dense
    for out in cfg.model.bottom_mlp:
        flops += 6 * width * out
        width = out
    f = len(cfg.data.cardinalities) + 1
    if cfg.model.interaction == "dot":
        flops += 3 * 2 * f * f * d  # Gram matrix of the F feature vectors, forward + backward
        width = d + f * (f - 1) // 2
    else:
        width = d * f
    for out in cfg.model.top_mlp:
        flops += 6 * width * out
        width = out
    unique_rows = []
    lookups = []
    bags = cfg.bag_sizes
    for b in batches:
        start, u, n = 0, 0, 0
        for bag in bags:
            ids = b.ids[:, start : start + bag]
            ids = ids[ids >= 0]
            u += np.unique(ids).size
            n += ids.size
            start += bag
        unique_rows.append(u)
        lookups.append(n)
    batch = cfg.train.batch_size
    u = float(np.mean(unique_rows))
    params = sum(t.size for t in _dense_param_shapes(cfg))
    sparse_min = 3 * u * d * table_item  # read once for the lookup, read + write for the update
    sparse_per_lookup = (float(np.mean(lookups)) + 2 * u) * d * table_item
    inputs = 4 * (cfg.data.num_dense + sum(bags) + 1)
    weights = 3 * 4 * params  # read, read-modify-write by SGD; amortized over the batch
    return {
        "flops_per_sample": flops,
        "unique_rows_per_batch": u,
        "lookups_per_batch": float(np.mean(lookups)),
        "bytes_per_sample_min": sparse_min / batch + inputs + weights / batch,
        "bytes_per_sample_every_lookup": sparse_per_lookup / batch + inputs + weights / batch,
        "dense_params": params,
    }


def _dense_param_shapes(cfg):
    import jax
    from flax import nnx

    from dlrm_jax.train.wiring import dlrm_from_config

    model = nnx.eval_shape(lambda: dlrm_from_config(cfg, nnx.Rngs(0)))
    return jax.tree.leaves(nnx.state(model, nnx.Param))


def _digest(state) -> str:
    """A fingerprint of every bit of the state, computed on the device (tables are tens of GB).

    Integer sums wrap and commute exactly, so the fingerprint itself is deterministic.
    """
    import jax
    import jax.numpy as jnp

    @jax.jit
    def fingerprint(leaf):
        bits = jax.lax.bitcast_convert_type(leaf.astype(jnp.float32), jnp.uint32).reshape(-1)
        weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) | jnp.uint32(1)
        return jnp.sum(bits * weights, dtype=jnp.uint32)

    h = hashlib.sha256()
    for leaf in jax.tree.leaves(state):
        h.update(int(fingerprint(leaf)).to_bytes(4, "little"))
    return h.hexdigest()[:16]


def profile_ops(compiled, state, batches, steps: int, keep: str | None) -> tuple:
    """Device time per XLA operation over ``steps`` traced steps (ms/step), largest first."""
    import jax
    from jax._src.lib import _profile_data

    trace_dir = tempfile.mkdtemp(prefix="dlrm-gpu-profile-")
    with jax.profiler.trace(trace_dir):
        for i in range(steps):
            state, out, _ = compiled(state, batches[i % len(batches)])
        jax.block_until_ready((state, out))
    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if keep:
        with open(path, "rb") as src, open(keep, "wb") as dst:
            dst.write(src.read())
    data = _profile_data.ProfileData.from_file(path)
    per_op, lines = collections.Counter(), collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            lines[line.name] += sum(ev.duration_ns for ev in line.events)
            if not line.name.startswith("Stream"):  # kernels, named after their fusion or library
                continue
            for ev in line.events:
                per_op[ev.name] += ev.duration_ns
    ms = {k: v / 1e6 / steps for k, v in per_op.most_common()}
    return state, ms, {k: v / 1e6 / steps for k, v in lines.items()}


def _is_sparse_update(kernel: str) -> bool:
    """A kernel of the sparse update: XLA's scatters and sorts, or the fused Pallas kernels."""
    k = kernel.lower()
    return any(word in k for word in ("scatter", "sort", "row_kernel", "chunk_kernel"))


def step_config(name: str):
    """Config ``name`` as the step is benched: COMMON's settings, the run's overrides, one device."""
    from dlrm_jax.config import load_config
    from dlrm_jax.data.sources import resolve_data_config

    path, extra = CONFIGS[name]
    return resolve_data_config(
        load_config(os.path.join(REPO, path), COMMON + extra + EXTRA_OVERRIDES + ["mesh.devices=1"])
    )


def variant_batch(variant: str, fns, batch):
    """A host batch as ``variant`` feeds the step: ``packed_input`` one array of bytes (as a
    dataset's readers hand it over), the others the batch's fields."""
    if variant != "packed_input":
        return batch
    from dlrm_jax.data.packed import HostPacked

    layout = fns.packed_layout()
    return HostPacked(layout.pack(batch), layout)


def bench_config(name: str, steps: int, profile_dir: str | None, variant: str = "default") -> dict:
    import jax

    from dlrm_jax.data.sources import make_source
    from dlrm_jax.parallel.mesh import make_mesh
    from dlrm_jax.train.build import build

    path, extra = CONFIGS[name]
    cfg = step_config(name)
    mesh = make_mesh(1)
    source = make_source(cfg, 0, 1)
    plan, fns = build(cfg, mesh, source)
    host_batches = [source.train_batch(i) for i in range(4)]
    batches = [fns.device_batch(variant_batch(variant, fns, b)) for b in host_batches]
    cost = step_cost(cfg, plan, host_batches)
    state = fns.init_state()
    t0 = time.perf_counter()
    compiled = fns.train_step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    for i in range(5):
        state, out, _ = compiled(state, batches[i % 4])
    jax.block_until_ready(state)
    one_at_a_time = []
    for i in range(steps):
        t = time.perf_counter()
        state, out, _ = compiled(state, batches[i % 4])
        jax.block_until_ready((state, out))
        one_at_a_time.append(time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(steps):
        state, out, _ = compiled(state, batches[i % 4])
    jax.block_until_ready((state, out))
    pipelined = (time.perf_counter() - t) / steps
    # the variant's flags and overrides change the program: each keeps its own
    prefix = "" if variant == "default" else f"{variant}-"
    keep = os.path.join(profile_dir, f"{prefix}{name}.xplane.pb") if profile_dir else None
    if profile_dir:
        with open(os.path.join(profile_dir, f"{prefix}{name}.hlo.txt"), "w") as f:
            f.write(compiled.as_text())
    state, ops, lines = profile_ops(compiled, state, batches, 5, keep)
    del state
    # Determinism: the same seed and batches twice, every parameter and table compared.
    digests = []
    for _ in range(2 if DETERMINISM_STEPS else 0):
        s = fns.init_state()
        for i in range(DETERMINISM_STEPS):
            s, out, _ = compiled(s, batches[i % 4])
        digests.append(_digest(s))
        del s
    batch = cfg.train.batch_size
    return {
        "config": path,
        "overrides": COMMON + extra + EXTRA_OVERRIDES,
        "batch": batch,
        "table_rows": sum(t.spec.rows for t in plan.tables),
        "compile_s": compile_s,
        "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
        "step_ms_pipelined": 1e3 * pipelined,
        "step_ms_one_at_a_time_median": 1e3 * statistics.median(one_at_a_time),
        "samples_per_s": batch / pipelined,
        "loss_last": float(out["loss"]),
        **cost,
        "device_ms_per_step_by_line": lines,
        "top_ops_ms_per_step": dict(list(ops.items())[:25]),
        "device_ops_ms_per_step": sum(ops.values()),
        "sparse_update_ms_per_step": sum(v for k, v in ops.items() if _is_sparse_update(k)),
        "predicted": predicted_step(cfg, plan),
        "determinism_digests": digests,
        "deterministic": bool(digests) and digests[0] == digests[1],
    }


# Memory bandwidth and size of the cards the cost model knows only as overrides of its h100
# profile (NVIDIA's H200 datasheet: HBM3e, 4.8 TB/s, 141 GB; the same Hopper compute).
CARD_OVERRIDES = {"H200": {"hbm_gbps": 4800.0, "device_memory_gb": 141.0}}


def predicted_step(cfg, plan) -> dict:
    """The step-time model's prediction for this step on this card (``dlrm-jax plan`` prints
    the same by phase), to hold against the measured step."""
    import jax

    from dlrm_jax.embedding.plan.cost import cluster_for, predict_step
    from dlrm_jax.train.wiring import dense_work

    kind = jax.devices()[0].device_kind
    overrides = next((o for card, o in CARD_OVERRIDES.items() if card in kind), {})
    step = predict_step(plan, cluster_for("h100", overrides, simulated=False), dense_work(cfg))
    return {
        "profile": "h100" + "".join(f" {k}={v}" for k, v in overrides.items()),
        "step_ms": 1e3 * step.total_s,
        "phases_ms": {k: 1e3 * v for k, v in step.phases.items()},
    }


def parity_child(out_npz: str, steps: int) -> None:
    """Train a small fp32 config for ``steps`` and save every state leaf (compared across backends)."""
    import jax
    import numpy as np

    from dlrm_jax.config import load_config
    from dlrm_jax.data.sources import make_source, resolve_data_config
    from dlrm_jax.parallel.mesh import make_mesh
    from dlrm_jax.train.build import build

    cfg = resolve_data_config(load_config(os.path.join(REPO, "configs/smoke.yaml"), PARITY_OVERRIDES))
    mesh = make_mesh(1)
    source = make_source(cfg, 0, 1)
    _, fns = build(cfg, mesh, source)
    state = fns.init_state()
    losses = []
    for i in range(steps):
        state, out, _ = fns.train_step(state, fns.device_batch(source.train_batch(i)))
        losses.append(float(out["loss"]))
    leaves = jax.tree.leaves(state)
    np.savez(
        out_npz,
        losses=np.array(losses),
        **{f"leaf{i}": np.asarray(jax.device_get(v), np.float64) for i, v in enumerate(leaves)},
    )


PARITY_OVERRIDES = ["mesh.devices=1", "train.compute_dtype=float32", "train.batch_size=1024"]


def check_parity(out: str, steps: int) -> dict:
    """The same fp32 training on this device and on the CPU: relative L2 error of every leaf."""
    import numpy as np

    files = {}
    for label, env in (
        ("device", {}),
        ("device_highest", {"JAX_DEFAULT_MATMUL_PRECISION": "highest"}),
        ("cpu", {"JAX_PLATFORMS": "cpu"}),
    ):
        files[label] = os.path.join(out, f"parity_{label}.npz")
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--out",
                out,
                "--only",
                "parity_child",
                "--steps",
                str(steps),
                "--parity-file",
                files[label],
            ],
            env=dict(os.environ, **env),
            check=True,
        )
    ref = np.load(files["cpu"])
    result = {}
    for label in ("device", "device_highest"):
        got = np.load(files[label])
        errs = [
            float(np.linalg.norm(got[k] - ref[k]) / max(np.linalg.norm(ref[k]), 1e-30))
            for k in ref.files
            if k.startswith("leaf")
        ]
        result[label] = {
            "max_leaf_rel_l2": max(errs),
            "loss_last": float(got["losses"][-1]),
            "loss_last_cpu": float(ref["losses"][-1]),
        }
    return result


DETERMINISM_STEPS = 20
EXTRA_OVERRIDES: list[str] = []


def print_tables(report: dict, log=print) -> None:
    c = report.get("ceilings")
    if c:
        log(
            f"\nceilings: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), "
            f"bf16 GEMM {c['bf16_gemm_flops_per_s'] / 1e12:.0f} TFLOP/s"
        )
    for mode, results in report.get("runs", {}).items():
        for name, r in results.items():
            log(f"\n== {name} [{mode}] batch {r['batch']}, {r['table_rows']:,} rows, compile {r['compile_s']:.1f} s")
            log(
                f"step {r['step_ms_pipelined']:.2f} ms pipelined ({r['samples_per_s']:,.0f} samples/s), "
                f"{r['step_ms_one_at_a_time_median']:.2f} ms one at a time; device ops "
                f"{r['device_ops_ms_per_step']:.2f} ms/step; loss {r['loss_last']:.4f}"
            )
            if c:
                byte_roof = c["copy_bytes_per_s"] / r["bytes_per_sample_min"]
                flop_roof = c["bf16_gemm_flops_per_s"] / r["flops_per_sample"]
                roof = min(byte_roof, flop_roof)
                r["roofline_samples_per_s"] = roof
                r["fraction_of_roofline"] = r["samples_per_s"] / roof
                log(
                    f"bytes/sample {r['bytes_per_sample_min']:,.0f} min ({r['unique_rows_per_batch']:,.0f} distinct "
                    f"rows of {r['lookups_per_batch']:,.0f} lookups), {r['bytes_per_sample_every_lookup']:,.0f} if "
                    f"every lookup is read; FLOPs/sample {r['flops_per_sample'] / 1e6:.1f} M"
                )
                log(
                    f"roofline: bytes {byte_roof / 1e6:.1f} M/s, FLOPs {flop_roof / 1e6:.1f} M/s -> "
                    f"{r['fraction_of_roofline']:.1%} of {roof / 1e6:.1f} M samples/s"
                )
            p = r.get("predicted")
            if p:
                log(
                    f"predicted {p['step_ms']:.2f} ms ({p['profile']}; "
                    + ", ".join(f"{k} {v:.2f}" for k, v in p["phases_ms"].items() if v)
                    + f"): measured / predicted {r['step_ms_pipelined'] / p['step_ms']:.2f}; "
                    f"sparse update (scatter, sort and fused kernels) {r['sparse_update_ms_per_step']:.2f} ms/step"
                )
            if r["determinism_digests"]:
                log(f"deterministic: {r['deterministic']} {r['determinism_digests']}")
            log(
                "top device ops (ms/step): "
                + ", ".join(f"{k} {v:.2f}" for k, v in list(r["top_ops_ms_per_step"].items())[:12])
            )


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
        for k in ("input_read_ms", "input_h2d_ms", "input_wait_ms", "dispatch_ms", "result_wait_ms")
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
    names: list[str], steps: int, work: str, variants: list[tuple[str, ...]] = (), keep: str | None = None
) -> dict:
    """Each config trained end to end twice by ``dlrm-jax train``: on synthetic batches made on
    the device, and on a binary dataset of the same kind of rows written first
    (:func:`~dlrm_jax.data.preprocessing.synthetic_dataset.write_synthetic_dataset`) read
    through the input pipeline; the ratio is the feed's cost. ``variants``: overrides the
    binary run is repeated with (``data.readers`` counts, say), each reported beside it;
    ``keep``: a folder for each run's Perfetto trace."""
    from dlrm_jax.config import load_config
    from dlrm_jax.data.preprocessing.synthetic_dataset import write_synthetic_dataset

    out = {}
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
        synthetic = train_end_to_end(name, steps, keep_trace=kept("synthetic"))
        binary = train_end_to_end(name, steps, data, keep_trace=kept("binary"))
        out[name] = {"dataset_rows": rows, "dataset_write_s": made_s, "synthetic": synthetic, "binary": binary}
        out[name]["input_alone"] = {"default": input_alone(name, data)}
        if "failed" not in binary:
            out[name]["eval_alone"] = eval_alone(binary["run_dir"])
        for more in variants:
            label = " ".join(more)
            out[name][f"binary {label}"] = train_end_to_end(name, steps, data, more, kept(label.replace("=", "-")))
            out[name]["input_alone"][" ".join(more)] = input_alone(name, data, more)
        if "failed" not in synthetic and "failed" not in binary:
            ratio = binary["median_window_samples_per_s"] / synthetic["median_window_samples_per_s"]
            out[name]["binary_over_synthetic"] = ratio
        print(json.dumps({name: out[name]}), flush=True)
        shutil.rmtree(data, ignore_errors=True)
    return out


def variant_runs(variants: str, configs: str) -> list[tuple[str, list[str]]]:
    """``--variants``' items as (variant, configs): ``NAME`` runs ``configs`` (comma-separated),
    ``NAME:CONFIG+CONFIG`` those alone. Raises ValueError naming an unknown variant or config."""
    runs = []
    for item in (i for i in variants.split(",") if i):
        label, _, only = item.partition(":")
        names = [n for n in (only.split("+") if only else configs.split(",")) if n]
        unknown = [x for x in (label, *names) if x not in (VARIANTS if x == label else CONFIGS)]
        if unknown:
            raise ValueError(f"--variants {item}: unknown variant or config {', '.join(unknown)}")
        runs.append((label, names))
    return runs


def main() -> int:
    global DETERMINISM_STEPS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--only", choices=["ceilings", "configs", "train", "feed", "child", "parity", "parity_child"], default=None
    )
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="of: " + ", ".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config overrides for every config (e.g. a smaller batch for a CPU try-out)",
    )
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="variants to compare, each LABEL or LABEL:CONFIG+CONFIG (those configs only, not "
        "--variant-configs): " + ", ".join(VARIANTS),
    )
    ap.add_argument(
        "--variant-configs",
        default="criteo_kaggle,mlperf_v1_capped",
        help="the configs the variants other than default run",
    )
    ap.add_argument(
        "--train-configs",
        default="criteo_kaggle",
        help="configs also trained end to end with `dlrm-jax train` (its samples/s beside the step's)",
    )
    ap.add_argument("--train-steps", type=int, default=400)
    ap.add_argument(
        "--feed-configs",
        default="criteo_kaggle,mlperf_dcnv2_capped",
        help="configs trained end to end on synthetic batches and on a generated binary dataset (the feed)",
    )
    ap.add_argument(
        "--feed-variants",
        default="",
        help="';'-separated sets of ','-separated overrides the binary run is repeated with "
        "(e.g. 'data.readers=2;data.readers=6'; an item switch_interval_ms=X sets Python's GIL switch "
        "interval for those runs instead)",
    )
    ap.add_argument("--determinism-steps", type=int, default=DETERMINISM_STEPS, help="0: no determinism check")
    ap.add_argument("--parity-file", help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    ap.add_argument("--profile-dir", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="default", help=argparse.SUPPRESS)
    ap.add_argument("--ceilings", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    DETERMINISM_STEPS = args.determinism_steps
    EXTRA_OVERRIDES.extend(args.overrides)
    os.makedirs(args.out, exist_ok=True)
    if args.only == "parity_child":
        parity_child(args.parity_file, args.steps)
        return 0
    names = [n for n in args.configs.split(",") if n]
    try:  # (before any device time is spent)
        runs = variant_runs(args.variants, args.variant_configs)
        variant_runs("default", args.configs)
    except ValueError as e:
        ap.error(str(e))
    if args.only == "child":  # one process per measurement: each GPU process takes most of the memory
        import jax

        result = {
            "machine": {
                "device_kind": jax.devices()[0].device_kind,
                "backend": jax.default_backend(),
                "jax": jax.__version__,
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
            }
        }
        if args.ceilings:
            result["ceilings"] = measure_ceilings()
        result["runs"] = {n: bench_config(n, args.steps, args.profile_dir, args.variant) for n in names}
        with open(args.result_file, "w") as f:
            json.dump(result, f)
        return 0

    work = tempfile.mkdtemp(prefix="dlrm-gpu-bench-")

    def child(label: str, configs: str, ceilings: bool) -> dict:
        result_file = os.path.join(work, f"result_{label}.json")
        cmd = [
            sys.executable,
            __file__,
            "--out",
            args.out,
            "--only",
            "child",
            "--configs",
            configs,
            "--steps",
            str(args.steps),
            "--result-file",
            result_file,
        ]
        flags, overrides = VARIANTS[label]
        cmd += [a for o in args.overrides + overrides for a in ("--set", o)]
        cmd += ["--determinism-steps", str(args.determinism_steps)]
        cmd += ["--ceilings"] * ceilings + ["--profile-dir", args.out, "--variant", label]
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
        if subprocess.run(cmd, env=env).returncode:
            print(f"variant {label} failed; going on without it")
            return {"runs": {}}
        with open(result_file) as f:
            result = json.load(f)
        print_tables({"runs": {label: result["runs"]}})  # as it comes, in case a later variant fails
        return result

    report = {}
    if args.only in (None, "parity"):
        report["parity"] = check_parity(work, 20)
        print(json.dumps(report["parity"]), flush=True)
    if args.only in (None, "configs", "ceilings"):
        first = child("default", "" if args.only == "ceilings" else args.configs, ceilings=True)
        report.update(machine=first["machine"], ceilings=first["ceilings"], runs={"default": first["runs"]})
        if args.only != "ceilings":
            for label, configs in runs:
                if label != "default":
                    report["runs"][label] = child(label, ",".join(configs), ceilings=False)["runs"]
                    report["runs"] = {k: v for k, v in report["runs"].items() if v}
    if args.only in (None, "configs", "train"):
        report["train"] = {}
        for n in (n for n in args.train_configs.split(",") if n):
            report["train"][n] = train_end_to_end(n, args.train_steps)
            print(json.dumps({n: report["train"][n]}), flush=True)
    if args.only in (None, "feed"):
        variants = [tuple(o for o in v.split(",") if o) for v in args.feed_variants.split(";") if v]
        names = [n for n in args.feed_configs.split(",") if n]
        report["feed"] = feed_cases(names, args.train_steps, work, variants, args.out)
    runs = report.get("runs", {})
    for label, p in report.get("parity", {}).items():
        print(
            f"parity with CPU ({label}): max relative L2 error of any state leaf {p['max_leaf_rel_l2']:.2e} "
            f"after 20 fp32 steps; loss {p['loss_last']:.6f} vs {p['loss_last_cpu']:.6f}"
        )
    print_tables(report)
    from dlrm_jax.observe.loop_trace import format_summary

    for label, results in runs.items():
        for n, r in results.items():
            if label != "default" and n in runs["default"]:
                ratio = r["samples_per_s"] / runs["default"][n]["samples_per_s"]
                print(f"{n} [{label}]: {ratio:.2f}x the default's samples/s, deterministic: {r['deterministic']}")
    for n, t in report.get("train", {}).items():
        step = runs.get("default", {}).get(n)
        if "failed" in t:
            print(f"{n}: dlrm-jax train failed ({t['failed']})")
            continue
        print(
            f"{n}: dlrm-jax train {t['median_window_samples_per_s']:,.0f} samples/s (median window; "
            f"{t['run_samples_per_s']:,.0f} over the run, {t['steps']} steps in {t['wall_s']:.0f} s wall)"
            + (f", {t['median_window_samples_per_s'] / step['samples_per_s']:.2f}x the step's alone" if step else "")
        )
        if t.get("trace"):
            print(f"{n}: {format_summary(t['trace'])}")
    for n, f in report.get("feed", {}).items():
        step = runs.get("default", {}).get(n)
        # synthetic, binary and its variants
        for kind in [k for k, v in f.items() if isinstance(v, dict) and k not in ("input_alone", "eval_alone")]:
            t = f[kind]
            if "failed" in t:
                print(f"{n} [{kind}]: dlrm-jax train failed ({t['failed']})")
                continue
            print(
                f"{n} [{kind}]: dlrm-jax train {t['median_window_samples_per_s']:,.0f} samples/s (median window)"
                + (
                    f", {t['median_window_samples_per_s'] / step['samples_per_s']:.2f}x the step's alone"
                    if step
                    else ""
                )
                + "; per step, ms: "
                + ", ".join(f"{k} {v:.2f}" for k, v in t["host_ms_per_step"].items())
            )
            if t.get("trace"):
                print(f"{n} [{kind}]: {format_summary(t['trace'])}")
        e = f.get("eval_alone", {})
        if "failed" not in e and e.get("evaluations"):
            rates = [f"{x['samples_per_s']:,.0f}" for x in e["evaluations"]]
            print(f"{n} [evaluation alone, {e['readers']} readers]: samples/s {', '.join(rates)} (the first compiles)")
        for label, a in f.get("input_alone", {}).items():
            if "failed" in a:
                continue
            busy = a["gil_wait"]["busy"]
            print(
                f"{n} [input alone, {label}: {a['readers']} readers]: {a['samples_per_s']:,.0f} samples/s; "
                f"a waking thread's wait for the GIL {busy['mean_ms']:.2f} ms mean, {busy['p90_ms']:.2f} p90, "
                f"{busy['p99_ms']:.2f} p99 (idle {a['gil_wait']['idle']['mean_ms']:.2f})"
            )
        if "binary_over_synthetic" in f:
            print(
                f"{n}: binary data end to end {f['binary_over_synthetic']:.2f}x synthetic ({f['dataset_rows']:,} rows)"
            )
    for first_labels, again_label in (
        (("embedding_deterministic",), "embedding_deterministic_again"),
        (("fused", "default"), "fused_again"),  # (the default is fused on GPUs: no need to run both)
    ):
        first_label = next((f for f in first_labels if f in runs), first_labels[0])
        for n, r in runs.get(again_label, {}).items():
            first = runs.get(first_label, {}).get(n, {}).get("determinism_digests", [None])[0]
            print(f"{n}: {first_label} gives the same bits in two processes: {r['determinism_digests'][0] == first}")
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
