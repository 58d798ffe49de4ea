"""``dlrm-jax bench tiers``: tiered tables against the same tables on the devices, side by side.

Every case trains the same config on the same stream of distinct batches (Zipf exponent and id
layout as given; by default 1.1 and a frequency-ordered vocabulary) with every sharded table
tiered, for device caches of several fractions of each owner's rows, lookahead 0 and > 0, the
DRAM caches' policies (``--policies lru,lfu``: their measured hit rates beside the plan's
prediction), and once with every table on the devices: the reference each case is a ratio of. Throughput is
end to end, pipelined as training runs it (planner thread, fills, write-backs, host reads),
timed over ``steps`` steps per turn after a warm-up, the variants taking turns ``repeats``
times so that drift of the machine's speed hits them alike. Reported per case: samples/s and
its ratio to all-in-device, device and DRAM hit rates, host->device bytes and stall per step,
and the process's peak RSS. ``effective_cache_fraction``: the caches as planned (a cache
smaller than one batch needs is raised, so on small tables low fractions coincide).
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax

from dlrm_jax.bench.common import each_case, machine_description, write_report
from dlrm_jax.bench.disk import probe_disk
from dlrm_jax.config import load_config
from dlrm_jax.data.pipeline import prefetch
from dlrm_jax.data.sources.synthetic import SyntheticSource
from dlrm_jax.embedding.plan.embedding_plan import DTYPE_BYTES, optimizer_bytes_per_row
from dlrm_jax.embedding.tiers.tables import TieredTables
from dlrm_jax.files import make_dir
from dlrm_jax.parallel.mesh import make_mesh
from dlrm_jax.train.build import build
from dlrm_jax.train.tier_runner import TierRunner

FRACTIONS = (1.0, 0.5, 0.2, 0.1, 0.05)


class _Variant:
    """One config, its state and its batch stream, advanced ``n`` steps at a time."""

    def __init__(self, cfg, root: Path | None, total_steps: int):
        self.cfg, self.source = cfg, SyntheticSource(cfg)
        self.plan, self.steps = build(cfg, make_mesh(cfg.mesh.devices), self.source, log=lambda *a: None)
        self.state = self.steps.init_state()
        self.runner = None
        if self.plan.tiered_tables:
            tiered = TieredTables(
                self.plan,
                self.steps.collection.groups,
                self.steps.collection.optimizer,
                root,
                self.steps.embedding_key(),
                chunk_bytes=int(cfg.embedding.tier.chunk_mb * 2**20),
                log=lambda *a: None,
            )
            self.runner = TierRunner(self.steps, tiered, cfg.embedding.tier.lookahead)
            self.batches = self.runner.planned(self.source.train_batch, range(total_steps))
        else:
            self.batches = prefetch(self.source.train_batch, range(total_steps))
        self.times, self.samples = [], 0
        tiered = [self.plan.tables[t] for t in self.plan.tiered_tables]
        n = self.plan.num_devices
        self.tiered_rows = sum(tp.spec.rows for tp in tiered)
        self.tier_bytes = self.tiered_rows * (
            DTYPE_BYTES[self.plan.dtype] * self.plan.tables[0].spec.dim
            + optimizer_bytes_per_row(self.plan.optimizer, self.plan.tables[0].spec.dim)
        )
        # The caches as planned: a cache below one batch's need is raised (tier_setup.fit_caches).
        self.cache_fraction = sum(tp.cache_rows * tp.spaces(n) for tp in tiered) / max(self.tiered_rows, 1)

    def run(self, n: int, timed: bool) -> None:
        if not n:  # (--warmup 0)
            return
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            item = next(self.batches)
            if self.runner is None:
                self.state, out, _ = self.steps.train_step(self.state, self.steps.device_batch(item))
            else:
                self.state, out = self.runner.train(self.state, item.batch, item.fills, item.reads)
        jax.block_until_ready(out["loss"])
        if timed:
            self.times.append(time.perf_counter() - t0)
            self.samples += n * self.cfg.train.batch_size
        elif self.runner is not None:
            self.runner.take_metrics(1)  # warm-up figures are not reported
            self.runner.host_s.clear()

    def host_ms(self, steps: int) -> dict:
        """The dispatching thread's host time per step, by kind (timed steps only)."""
        return {k: 1e3 * v / max(steps, 1) for k, v in self.runner.host_s.items()}

    def close(self) -> None:
        if self.runner is not None:
            self.runner.tiered.close()


def bench_tiers(
    config: str | None,
    base_overrides: list[str],
    steps: int,
    repeats: int,
    fractions=FRACTIONS,
    lookaheads=(0, 4),
    policies=("lru",),
    zipf: float = 1.1,
    layout: str = "frequency_ordered",
    warmup: int = 30,
    output: str | None = None,
    large_gb: float = 0.0,
    large_fraction: float = 0.01,
    large_host_fraction: float = 0.05,
    tier_dir: str | None = None,
    disk_probe_mb: int = 1024,
    disk_probe_s: float = 3.0,
    log=print,
) -> dict:
    """Run every case side by side; returns (and writes) the JSON report. ``large_gb``: one
    more case whose tables are scaled up to about that many GB in the disk tier (more than
    the machine's RAM, to show what holding them costs), device caches ``large_fraction`` of
    the rows, DRAM caches ``large_host_fraction``, the largest lookahead; its ratio is to the all-in-device run of the base size
    (the only one that fits). ``tier_dir``: where the tiers are created (default: a
    temporary folder). ``disk_probe_mb``: the size of the file the tier directory's disk is
    measured on first (:func:`~dlrm_jax.bench.disk.probe_disk`, ``disk_probe_s`` seconds per
    queue depth; 0: not measured)."""
    common = [*base_overrides, f"data.zipf_exponent={zipf}", f"data.id_layout={layout}", "train.progress_bar=false"]
    total = warmup + steps * repeats + 8
    where = make_dir(tier_dir, "--tier-dir") if tier_dir else None  # made if it is not there yet
    root = Path(tempfile.mkdtemp(prefix="dlrm-bench-tiers-", dir=where))
    variants: dict = {}
    try:  # (the tier folder goes whatever fails: a config, the disk probe, a step)
        disk = probe_disk(root, disk_probe_mb << 20, disk_probe_s) if disk_probe_mb else {}
        if disk:
            log(
                f"disk of {root}: {disk['disk_iops_qd1']:,.0f} random 4 KiB reads/s at queue depth 1, "
                f"{disk['disk_iops_qd32']:,.0f} at 32 ({disk['disk_probe']})"
            )
        base = load_config(config, common)
        variants[("device", 0.0, 0, "")] = _Variant(base, None, total)
        for fraction in fractions:
            for lookahead in lookaheads:
                for policy in each_case(policies):
                    cfg = load_config(
                        config,
                        [
                            *common,
                            "embedding.storage=tiered",
                            f"embedding.tier.device_cache_fraction={fraction}",
                            f"embedding.tier.lookahead={lookahead}",
                            f"embedding.tier.policy={policy}",
                        ],
                    )
                    where = root / f"{fraction}_{lookahead}_{policy}"
                    variants[("tiered", fraction, lookahead, policy)] = _Variant(cfg, where, total)
        if large_gb:
            cfg = load_config(
                config,
                [
                    *common,
                    *_scaled_tables(base, large_gb),
                    "embedding.storage=tiered",
                    f"embedding.tier.device_cache_fraction={large_fraction}",
                    f"embedding.tier.host_cache_fraction={large_host_fraction}",
                    f"embedding.tier.lookahead={max(lookaheads)}",
                    f"embedding.tier.policy={policies[0]}",
                ],
            )
            t0 = time.perf_counter()
            key = ("large", large_fraction, max(lookaheads), policies[0])
            variants[key] = large = _Variant(cfg, root / "large", total)
            log(
                f"large case: {large.tier_bytes / 2**30:.1f} GiB of tables in the disk tier, created in "
                f"{time.perf_counter() - t0:.0f}s; machine RAM {_ram_bytes() / 2**30:.1f} GiB"
            )
        for v in variants.values():
            v.run(warmup, timed=False)
        for _ in each_case(range(repeats)):
            for v in variants.values():
                v.run(steps, timed=True)
        device = variants[("device", 0.0, 0, "")]
        device_rate = device.samples / sum(device.times)
        cases = []
        for (kind, fraction, lookahead, policy), v in variants.items():
            rate = v.samples / sum(v.times)
            m = v.runner.take_metrics(steps * repeats) if v.runner else {}
            cases.append(
                {
                    "zipf": zipf,
                    "layout": layout,
                    "storage": kind,
                    "tier_gib": v.tier_bytes / 2**30,
                    "device_cache_fraction": fraction if kind != "device" else 1.0,
                    "effective_cache_fraction": v.cache_fraction if kind != "device" else 1.0,
                    "tiered_tables": len(v.plan.tiered_tables),
                    "tiered_rows": v.tiered_rows,
                    "lookahead": lookahead,
                    "policy": policy,
                    "samples_per_s": rate,
                    "ratio_to_device": rate / device_rate,
                    "step_ms_median": 1e3 * statistics.median(v.times) / steps,
                    "device_hit_rate": m.get("device_hit_rate", 1.0),
                    "host_hit_rate": m.get("host_hit_rate", 0.0),
                    "h2d_bytes_per_step": m.get("h2d_bytes_per_step", 0.0),
                    "stall_ms_per_step": m.get("stall_ms_per_step", 0.0),
                    "fill_rounds": m.get("fill_rounds", 0),
                    **_tier_traffic(m, sum(v.times), steps * repeats, disk),
                    **({k: disk[k] for k in ("disk_iops_qd1", "disk_iops_qd32") if k in disk} if v.runner else {}),
                    **({"host_ms_per_step": v.host_ms(steps * repeats)} if v.runner else {}),
                    **_predicted(v.plan),
                }
            )
    finally:
        for v in variants.values():
            v.close()
        shutil.rmtree(root, ignore_errors=True)
    report = {
        "benchmark": "tiers",
        "machine": machine_description(),
        "overrides": base_overrides,
        "steps": steps,
        "repeats": repeats,
        "peak_rss_mib": _peak_rss_mib(),
        "disk": disk,
        "cases": cases,
    }
    log(_table(cases))
    write_report(report, output)
    return report


def _tier_traffic(m: dict, seconds: float, steps: int, disk: dict) -> dict:
    """The disk tier's reads in a case's timed steps, against what the disk allows."""
    if "tier_reads" not in m:
        return {}
    iops = m["tier_reads"] / seconds
    out = {
        "tier_read_iops": iops,
        "tier_read_bytes_per_step": m["tier_read_bytes"] / steps,
        "tier_wait_ms_per_step": m["tier_wait_ms_per_step"],
        "rows_read_ahead_per_step": m["rows_read_ahead"] / steps,
        "rows_read_at_step_per_step": m["rows_read_at_step"] / steps,
        "rows_from_write_queue_per_step": m["rows_from_write_queue"] / steps,
    }
    if disk.get("disk_iops_qd32"):
        out["tier_read_iops_to_disk_qd32"] = iops / disk["disk_iops_qd32"]
    return out


def _predicted(plan) -> dict:
    """The plan's predicted hit rates, averaged over the tiered tables."""
    tier, tiered = plan.tier, plan.tiered_tables
    if tier is None or not tiered:
        return {}
    mean = lambda rates: sum(rates[t] for t in tiered) / len(tiered) if rates else 0.0
    return {
        "predicted_device_hit_rate": mean(tier.device_hit_rates),
        "predicted_host_hit_rate": mean(tier.host_hit_rates),
    }


def _scaled_tables(cfg, gb: float) -> list[str]:
    """Overrides scaling every table (uncapped) so that values and optimizer state total about
    ``gb`` GB."""
    rows = cfg.table_rows
    row_bytes = 4 * cfg.model.embedding_dim + optimizer_bytes_per_row(cfg.embedding.optimizer, cfg.model.embedding_dim)
    scale = gb * 1e9 / (sum(rows) * row_bytes)
    return ["data.max_rows=0", f"data.cardinalities=[{', '.join(str(max(r, round(r * scale))) for r in rows)}]"]


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _table(cases: list[dict]) -> str:
    lines = [
        f"{'storage':<8}{'cache':>7}{'actual':>7}{'ahead':>6}{'policy':>7}{'samples/s':>12}{'ratio':>7}{'dev hit':>9}{'host hit':>9}"
        f"{'h2d/step':>11}{'stall ms':>9}"
    ]
    for c in cases:
        lines.append(
            f"{c['storage']:<8}{100 * c['device_cache_fraction']:>6.0f}%"
            f"{100 * c['effective_cache_fraction']:>6.1f}%{c['lookahead']:>6}{c['policy']:>7}"
            f"{c['samples_per_s']:>12,.0f}{c['ratio_to_device']:>7.2f}{100 * c['device_hit_rate']:>8.1f}%"
            f"{100 * c['host_hit_rate']:>8.1f}%{c['h2d_bytes_per_step'] / 1024:>9.1f}Ki"
            f"{c['stall_ms_per_step']:>9.2f}"
        )
    return "\n".join(lines)
