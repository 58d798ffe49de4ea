"""What ``scripts/gpu_bench.py`` measures: its configs, their variants (XLA flags and config
overrides, each run in a process of its own) and the settings every run shares; also read by
``scripts/gpu_compile.py``, which compiles the same steps without a GPU."""

from __future__ import annotations

import os
import sys
import tempfile

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
    # The fused update's row kernel uncapped, one program per 4 lookups, most of them idle (the
    # default until the forty-fifth session, the form the 2026-12-04 H200 run measured; now at
    # most 65,536, each taking distinct rows until they run out).
    "fused_programs_all": ("", ["embedding.sparse_update=fused", "embedding.fused_programs=0"]),
    "fused_again": (f"--xla_gpu_load_autotune_results_from={FUSED_AUTOTUNE_FILE}", ["embedding.sparse_update=fused"]),
    # Control flow on the device: XLA's GPU runtime reads a loop's predicate and a switch's
    # index on the host (a MemcpyD2H and a wait each time, the device idle meanwhile) unless
    # the loop or switch is recorded into a command buffer whole (CUDA graph conditional nodes:
    # by default switches whose branches hold no loop or collective; loops never). The
    # dynamic tables' step has a switch, conditionals and while loops (issue 49's 1.3 ms idle
    # a step on one H200); run it as ``device_control:criteo_kaggle_dynamic``.
    "device_control": ("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL", []),
    # The dynamic step's switch among prefix sizes of the batch's distinct ids on a GPU, nothing
    # else of the branches: work that follows the distinct ids rather than all N, the switch of
    # kernels decided on the device (on GPUs the default, ``auto``, since the forty-fifth session).
    "prefixes": ("", ["embedding.dynamic.control_flow=prefixes"]),
    # The dynamic step without the switch among sizes: all N ids' work, no switch but the
    # placement's rounds (on GPUs the default until the forty-fifth session).
    "one_path": ("", ["embedding.dynamic.control_flow=one_path"]),
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
    # Each low-rank cross layer's second product and elementwise work by one Pallas kernel
    # (model/cross_kernel.py): the product never written and read back (DLRM-DCNv2 only).
    "cross_fused": ("", ["model.cross_layers=fused"]),
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

# Overrides of this run for every config (``--set``; gpu_compile.py sets a variant's here).
EXTRA_OVERRIDES: list[str] = []


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
