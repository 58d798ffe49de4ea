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
way, and with the row kernel's programs uncapped; XLA's two deterministic flags; the
``-nvptx-allow-ftz-atomics`` workaround for slow contended float atomics) runs in a process of its own, since XLA reads its flags once at start-up. ``--only parity`` compares a
small fp32 run on the device with the CPU.

Everything lands in DIR/gpu_bench.json (``--json FILE``: there), written again after each part
and each config, so a run cut short (a crash, the device tool's time limit) keeps what it had
measured; a config that fails is noted as failed and the rest still run. The tables are
printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from gpu_bench_cases import CONFIGS, DEFAULT_CONFIGS, EXTRA_OVERRIDES, VARIANTS, variant_runs
from gpu_bench_feed import feed_cases, train_end_to_end
from gpu_bench_step import bench_config, check_parity, measure_ceilings, parity_child, print_tables

DETERMINISM_STEPS = 20  # steps trained twice from the same seed, every bit compared


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--json", help="the report's file (default: OUT/gpu_bench.json), rewritten as results come")
    ap.add_argument(
        "--baseline",
        help="an earlier report (its JSON) whose default runs this run's variants are set against, "
        "where this run has none of its own (a lease's levers run apart from its defaults)",
    )
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

        from dlrm_jax.bench.xla_options import command_buffer_types_installed

        result = {
            "machine": {
                "device_kind": jax.devices()[0].device_kind,
                "backend": jax.default_backend(),
                "jax": jax.__version__,
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
                # what its XLA records into CUDA graphs (bench.hlo_kernels' model of host reads)
                "command_buffer_types": sorted(command_buffer_types_installed() or []),
            }
        }
        if args.ceilings:
            result["ceilings"] = measure_ceilings()
        result["runs"] = {}
        for n in names:  # each config's result kept as it comes: a later one may crash the process
            try:
                r = result["runs"][n] = bench_config(
                    n, args.steps, args.profile_dir, args.variant, args.determinism_steps
                )
                print(f"{n} [{args.variant}]: {r['step_ms_pipelined']:.2f} ms a step", flush=True)
            except Exception as e:  # (out of memory, say: the next config may still fit)
                result["runs"][n] = {"failed": f"{type(e).__name__}: {e}"[:2000]}
                print(f"{n} [{args.variant}] failed: {type(e).__name__}: {e}", flush=True)
            write_json(args.result_file, result)
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
        code = subprocess.run(cmd, env=env).returncode
        try:  # what the process wrote before it ended, whether or not it ended well
            with open(result_file) as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = {"runs": {}}
        if code:
            done = [n for n, r in result["runs"].items() if "failed" not in r]
            print(f"variant {label}: its process ended with {code} after {len(done)} configs ({', '.join(done)})")
        print_tables({"runs": {label: result["runs"]}})  # as it comes, in case a later variant fails
        return result

    report = {}
    json_path = args.json or os.path.join(args.out, "gpu_bench.json")
    save = lambda: write_json(json_path, report)  # after each part: a run cut short keeps the rest
    if args.only in (None, "parity"):
        report["parity"] = check_parity(work, 20)
        print(json.dumps(report["parity"]), flush=True)
        save()
    if args.only in (None, "configs", "ceilings"):
        first = child("default", "" if args.only == "ceilings" else args.configs, ceilings=True)
        report.update(machine=first.get("machine"), ceilings=first.get("ceilings"), runs={"default": first["runs"]})
        save()
        if args.only != "ceilings":
            for label, configs in runs:
                if label != "default":
                    report["runs"][label] = child(label, ",".join(configs), ceilings=False)["runs"]
                    report["runs"] = {k: v for k, v in report["runs"].items() if v}
                    save()
    if args.only in (None, "configs", "train"):
        report["train"] = {}
        for n in (n for n in args.train_configs.split(",") if n):
            report["train"][n] = train_end_to_end(n, args.train_steps)
            print(json.dumps({n: report["train"][n]}), flush=True)
            save()
    if args.only in (None, "feed"):
        variants = [tuple(o for o in v.split(",") if o) for v in args.feed_variants.split(";") if v]
        names = [n for n in args.feed_configs.split(",") if n]
        report["feed"] = {}
        feed_cases(names, args.train_steps, work, variants, args.out, into=report["feed"], progress=save)
    runs = {
        label: {n: r for n, r in results.items() if "failed" not in r}
        for label, results in report.get("runs", {}).items()
    }
    if args.baseline and os.path.exists(args.baseline):  # (for the ratios printed below only)
        with open(args.baseline) as f:
            earlier = json.load(f).get("runs", {}).get("default", {})
        runs["default"] = {n: r for n, r in earlier.items() if "failed" not in r} | runs.get("default", {})
    for label, p in report.get("parity", {}).items():
        print(
            f"parity with CPU ({label}): max relative L2 error of any state leaf {p['max_leaf_rel_l2']:.2e} "
            f"after 20 fp32 steps; loss {p['loss_last']:.6f} vs {p['loss_last_cpu']:.6f}"
        )
    print_tables(report)
    from dlrm_jax.observe.loop_trace import format_summary

    for label, results in runs.items():
        for n, r in results.items():
            if label != "default" and n in runs.get("default", {}):
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
    save()
    return 0


def write_json(path: str, value) -> None:
    """``value`` as JSON at ``path``, whole or not at all (written beside it, then renamed)."""
    with open(f"{path}.part", "w") as f:
        json.dump(value, f, indent=1)
    os.replace(f"{path}.part", path)


if __name__ == "__main__":
    sys.exit(main())
