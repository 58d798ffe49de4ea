"""The step alone, for ``scripts/gpu_bench.py``: the device's ceilings (copy bandwidth, bf16
GEMM rate), each config's compiled train step timed, its bytes and FLOPs per sample, a profile
of its kernels, a fingerprint of its state (the same bits twice?), the cost model's prediction
beside it, parity of a small fp32 run with the CPU, and the tables printed from all of it."""

from __future__ import annotations

import collections
import glob
import hashlib
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time

from gpu_bench_cases import COMMON, CONFIGS, EXTRA_OVERRIDES, REPO, step_config, variant_batch

GPU_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_bench.py")  # (parity's children)


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


def bench_config(
    name: str, steps: int, profile_dir: str | None, variant: str = "default", determinism_steps: int = 20
) -> dict:
    """Config ``name``'s train step on one device as ``variant`` builds it: timed, costed,
    profiled, and (``determinism_steps``, 0: not) trained twice from the same seed."""
    import jax

    from dlrm_jax.data.sources import make_source
    from dlrm_jax.parallel.mesh import make_mesh
    from dlrm_jax.train.build import build

    path, extra = CONFIGS[name]
    cfg = step_config(name)
    mesh = make_mesh(1)
    source = make_source(cfg, 0, 1)
    plan, fns = build(cfg, mesh, source)
    # Dynamic tables: a batch of its own for every warm-up and timed step, as a stream gives
    # (four in turn let the maps hold every id from the fifth step on: no admissions,
    # evictions or resets); the same work whatever the batch otherwise.
    distinct = 5 + 2 * steps if cfg.dynamic_tables else 4
    host_batches = [source.train_batch(i) for i in range(distinct)]
    batches = [fns.device_batch(variant_batch(variant, fns, b)) for b in host_batches]
    cost = step_cost(cfg, plan, host_batches[:4])
    state = fns.init_state()
    t0 = time.perf_counter()
    compiled = fns.train_step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    turn = itertools.count()  # each warm-up and timed step its own batch (of `distinct`, in turn)
    for _ in range(5):
        state, out, _ = compiled(state, batches[next(turn) % distinct])
    jax.block_until_ready(state)
    one_at_a_time = []
    for _ in range(steps):
        t = time.perf_counter()
        state, out, _ = compiled(state, batches[next(turn) % distinct])
        jax.block_until_ready((state, out))
        one_at_a_time.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(steps):
        state, out, _ = compiled(state, batches[next(turn) % distinct])
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
    for _ in range(2 if determinism_steps else 0):
        s = fns.init_state()
        for i in range(determinism_steps):
            s, out, _ = compiled(s, batches[i % distinct])
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
                GPU_BENCH,
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


def print_tables(report: dict, log=print) -> None:
    c = report.get("ceilings")
    if c:
        log(
            f"\nceilings: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), "
            f"bf16 GEMM {c['bf16_gemm_flops_per_s'] / 1e12:.0f} TFLOP/s"
        )
    for mode, results in report.get("runs", {}).items():
        for name, r in results.items():
            if "failed" in r:
                log(f"\n== {name} [{mode}] failed: {r['failed']}")
                continue
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
