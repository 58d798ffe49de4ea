"""The step-time model a plan is chosen by: one training step of one device, by phase.

Every exchange part's collectives move the bytes the kind's ``links`` (``part_kinds``) counts (what the compiled
step moves, checked against HLO by the tests); each crosses the links its devices span: within
a host of ``devices_per_host`` devices at ``intra_host_gbps``, between hosts at
``inter_host_gbps``. An all-to-all or all-gather over every device sends (G-1)/(N-1) of its
bytes within the host and the rest between hosts, both at once (one over a host's devices only
within it, one over a device of each host only between hosts); an all-reduce runs hierarchically (reduce-
scatter within the host, all-reduce of 1/G of it between hosts, all-gather within the host).
Lookups and updates read and write rows at ``hbm_gbps``; the dense MLPs (data-parallel, the
same under every plan) run at ``tflops`` and all-reduce their gradients. Every collective
also pays ``latency_us``. Phases are added, not overlapped: the prediction is what a step
costs when nothing hides anything, and the planner compares plans by it.

Constants (peaks, then the share of them a step reaches, ``*_efficiency``):

- H100 SXM: NVLink 4 about 450 GB/s each way per GPU within an 8-GPU host; one 400 Gb/s
  InfiniBand NIC per GPU between hosts, about 50 GB/s; HBM3 about 3.35 TB/s; dense bf16
  about 990 TFLOP/s (495 at float32 through TF32). NVIDIA's H100 datasheet and DGX H100
  reference architecture.
- Simulated CPU devices of this 2-core VM: one host; `dlrm-jax bench collectives` measured
  an all-to-all at 0.41-0.61 of an all-reduce's bandwidth, a single-threaded 64 MB copy runs
  6.7 GB/s (BENCHMARKS.md); about 0.05 TFLOP/s of float32 matmul on both cores.
- Efficiencies: 0.7 of link and memory bandwidth, 0.5 of peak FLOP/s (assumed; the dense
  kernels of criteo_kaggle and DLRM-DCNv2 on one H200 fit 0.5 once the per-layer cost below is
  added).
- Measured on one H200 (docs/benchmarks-log.md, 2026-12-04: criteo_kaggle and DLRM-DCNv2 at
  batch 65,536, one device, the fused sparse update; GPUs' default): the update costs about
  0.27 ns per lookup it sorts and sums, whether rows are 16 or 128 floats wide (0.46 ms for
  1.7M lookups, 3.85 ms for 14.0M), far from what its bytes take; and the dense part costs
  about 1.75 ns per sample and linear layer beyond its FLOPs (its bias, activation and
  gradient passes: 1.5 ms against 0.38 ms of FLOPs for criteo_kaggle's 8 layers). On an H100
  these are leads (the same compute, 0.7x the memory bandwidth).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from dlrm_jax.embedding.plan.embedding_plan import (
    DTYPE_BYTES,
    EmbeddingPlan,
)
from dlrm_jax.embedding.plan.part_kinds import (
    SPAN_HOST,
    SPAN_HOSTS,
    exchange_parts,
    part_kind,
    update_bytes_per_value,
)
from dlrm_jax.embedding.plan.stats import lower_bound_bytes


@dataclass(frozen=True)
class Cluster:
    """The machines a plan is priced for (``cluster.*`` config keys; see the module docstring
    for the sources). Bandwidths in GB/s per device and direction."""

    name: str
    devices_per_host: int
    intra_host_gbps: float
    inter_host_gbps: float
    hbm_gbps: float
    tflops: float  # dense matmul peak at bfloat16; float32 runs at half
    device_memory_gb: float  # 0: unknown (no budget from it)
    latency_us: float = 10.0
    link_efficiency: float = 0.7
    hbm_efficiency: float = 0.7
    flops_efficiency: float = 0.5
    # measured (module docstring); 0: priced by bytes and FLOPs alone
    update_ns_per_lookup: float = 0.0
    dense_layer_ns_per_sample: float = 0.0


PROFILES = {
    "h100": Cluster(
        "h100", 8, 450.0, 50.0, 3350.0, 990.0, 80.0, update_ns_per_lookup=0.27, dense_layer_ns_per_sample=1.75
    ),
    "cpu": Cluster("cpu", 64, 2.0, 2.0, 6.7, 0.1, 0.0, latency_us=200.0),
}


@dataclass(frozen=True)
class DenseWork:
    """What the data-parallel dense part costs per device: matmul FLOPs of forward and
    backward per sample, its parameters (all-reduced as float32 gradients every step) and the
    compute dtype."""

    flops_per_sample: float = 0.0
    params: int = 0
    bfloat16: bool = False
    layers: int = 0  # linear layers (and the dot interaction), each with passes of its own


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step of the busiest device, by phase, and the lower bound's
    exchange time (its bytes over the same links)."""

    phases: dict[str, float] = field(default_factory=dict)
    bound_exchange_s: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(self.phases.values())

    @property
    def embedding_s(self) -> float:
        """What the plan decides: everything but the dense part."""
        return sum(v for k, v in self.phases.items() if not k.startswith("dense"))


def link_split(kind: str, sent_bytes: float, n: int, devices_per_host: int) -> tuple[float, float]:
    """(bytes within a host, bytes between hosts) that one device sends in a collective of
    ``kind`` over ``n`` devices in hosts of ``devices_per_host`` (``sent_bytes`` as
    ``part_collective_bytes`` counts them): an all-reduce runs hierarchically, anything else
    sends each other device its share."""
    if n <= 1 or sent_bytes <= 0:
        return 0.0, 0.0
    g = min(n, devices_per_host)
    hosts = math.ceil(n / g)
    if kind == "all-reduce":
        buffer = sent_bytes * n / (2 * (n - 1))
        return 2 * (g - 1) / g * buffer, 2 * (hosts - 1) / hosts * buffer / g
    return sent_bytes * (g - 1) / (n - 1), sent_bytes * (n - g) / (n - 1)


def link_seconds(kind: str, sent_bytes: float, n: int, cluster: Cluster, latency: bool = True) -> float:
    """Seconds for a collective of ``kind`` that sends ``sent_bytes`` per device over ``n``
    devices (the bytes as ``part_collective_bytes`` counts them), its latency included unless
    it rides in another collective (``latency=False``)."""
    if n <= 1 or sent_bytes <= 0:
        return 0.0
    within, across = link_split(kind, sent_bytes, n, cluster.devices_per_host)
    within /= cluster.intra_host_gbps * 1e9 * cluster.link_efficiency
    across /= cluster.inter_host_gbps * 1e9 * cluster.link_efficiency
    latency = cluster.latency_us * 1e-6 if latency else 0.0
    return (within + across if kind == "all-reduce" else max(within, across)) + latency


def _span_devices(span: str, n: int, cluster: Cluster) -> tuple[int, int]:
    """(devices, devices a host) of a collective over the devices ``span`` names
    (stats.SPAN_*): all ``n``; one device per host; one host's devices."""
    g = min(n, cluster.devices_per_host)
    if span == SPAN_HOSTS:
        return math.ceil(n / g), 1
    if span == SPAN_HOST:
        return g, g
    return n, g


def _span_seconds(kind: str, sent: float, span: str, n: int, cluster: Cluster) -> float:
    devices, host_devices = _span_devices(span, n, cluster)
    return link_seconds(kind, sent, devices, replace(cluster, devices_per_host=host_devices))


def exchange_link_bytes(plan: EmbeddingPlan, cluster: Cluster, table_copies: int = 1) -> tuple[float, float]:
    """(within hosts, between hosts): the bytes one device sends per step in the embedding
    exchange (every part's collectives and the hot rows' all-reduce), by the links they take."""
    n, within, between = plan.num_devices, 0.0, 0.0
    for part in exchange_parts(plan):
        for kind, sent, span in part_kind(part).links(plan, part, table_copies):
            devices, host_devices = _span_devices(span, n * (table_copies if kind != "all-to-all" else 1), cluster)
            w, b = link_split(kind, sent, devices, host_devices)
            within, between = within + w, between + b
    if plan.hot_rows:
        w, b = link_split(
            "all-reduce", 2 * (n - 1) / n * plan.hot_rows * plan.tables[0].spec.dim * 4, n, cluster.devices_per_host
        )
        within, between = within + w, between + b
    return within, between


def bound_link_bytes(plan: EmbeddingPlan, cluster: Cluster) -> tuple[float, float]:
    """The lower bound's bytes (one all-to-all over every device) by the links they take."""
    return link_split("all-to-all", lower_bound_bytes(plan), plan.num_devices, cluster.devices_per_host)


def predict_step(
    plan: EmbeddingPlan, cluster: Cluster, dense: DenseWork | None = None, table_copies: int = 1
) -> StepTime:
    """The busiest device's step, by phase: ``lookup`` and ``update`` (device memory),
    ``exchange`` (all-to-alls and all-gathers of the embedding exchange), ``all-reduce``
    (replicated tables' and hot rows' gradients), ``dense`` (MLP FLOPs) and ``dense all-reduce``
    (their gradients)."""
    n = plan.num_devices
    hbm = cluster.hbm_gbps * 1e9 * cluster.hbm_efficiency
    phases = dict.fromkeys(("lookup", "exchange", "all-reduce", "update"), 0.0)
    for part in exchange_parts(plan):
        for kind, sent, span in part_kind(part).links(plan, part, table_copies):
            phases["all-reduce" if kind == "all-reduce" else "exchange"] += _span_seconds(
                kind, sent, span, n * (table_copies if kind != "all-to-all" else 1), cluster
            )
        kind = part_kind(part)
        lookup, update = kind.memory_traffic(plan, part)
        phases["lookup"] += lookup / hbm
        phases["update"] += _update_seconds(
            plan, kind.update_lookups(plan, part), part.group.width, update, cluster, hbm
        )
    if plan.hot_rows:
        dim = plan.tables[0].spec.dim
        # (XLA fuses it with the dense gradients' all-reduce: no latency of its own)
        phases["all-reduce"] += link_seconds(
            "all-reduce", 2 * (n - 1) / n * plan.hot_rows * dim * 4, n, cluster, latency=False
        )
        phases["update"] += plan.hot_rows * dim * (4 + 2 * DTYPE_BYTES[plan.dtype]) / hbm
    if dense is not None and dense.flops_per_sample:
        peak = cluster.tflops * 1e12 * cluster.flops_efficiency * (1.0 if dense.bfloat16 else 0.5)
        per_sample = dense.flops_per_sample / peak + dense.layers * cluster.dense_layer_ns_per_sample * 1e-9
        phases["dense"] = plan.global_batch / n * per_sample
        phases["dense all-reduce"] = link_seconds("all-reduce", 2 * (n - 1) / n * dense.params * 4, n, cluster)
    bound = link_seconds("all-to-all", lower_bound_bytes(plan), n, cluster)
    return StepTime(phases, bound)


def _update_seconds(
    plan: EmbeddingPlan, lookups: float, width: int, update_bytes: float, cluster: Cluster, hbm: float
) -> float:
    """A part's sparse update by its bytes (at ``hbm`` bytes/s); where the cluster has a
    measured rate per lookup, the sorted lookups' share of those bytes is priced at that rate
    instead (or by each lookup's float32 gradient read once, if that takes longer)."""
    if not (cluster.update_ns_per_lookup and lookups):
        return update_bytes / hbm
    rest = update_bytes - lookups * width * update_bytes_per_value(plan, width)
    return rest / hbm + max(lookups * cluster.update_ns_per_lookup * 1e-9, lookups * width * 4 / hbm)


def cluster_for(profile: str, overrides: dict, simulated: bool) -> Cluster:
    """The profile named (``auto``: ``cpu`` for simulated CPU devices, else ``h100``) with the
    config's non-zero ``cluster.*`` values over it."""
    name = ("cpu" if simulated else "h100") if profile == "auto" else profile
    return replace(PROFILES[name], **{k: v for k, v in overrides.items() if v})
