"""``dlrm-jax plan``: the embedding sharding plan, without training."""

from __future__ import annotations

import dataclasses

from dlrm_jax.cli.args import POSITIVE, add_config_args
from dlrm_jax.cli.runtime import devices_for, log, start_jax
from dlrm_jax.config import load_config, validated
from dlrm_jax.parallel.mesh import MAX_SIMULATED_DEVICES

NAME = "plan"
HELP = "print the embedding sharding plan without training"


def add_arguments(p) -> None:
    add_config_args(p)
    p.add_argument(
        "--num-processes",
        dest="planned_processes",
        type=POSITIVE,
        default=1,
        metavar="N",
        help="plan a run over N processes (train's checks of how the devices and per-host tables split "
        "over them; the plan itself runs in this one process; default 1)",
    )


def run(args) -> int:
    processes = args.planned_processes
    cfg = load_config(args.config, args.overrides)
    if processes > 1 and cfg.embedding.tables_per_host and not cfg.mesh.hosts:  # one host per process, as train
        cfg = validated(dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, hosts=processes)))
    from dlrm_jax.data.sources import cap_note, make_source, resolve_data_config
    from dlrm_jax.train.planning import plan_for_run, run_plan_report

    hosts = cfg.mesh.hosts or 1
    devices = devices_for(cfg)
    simulated = devices <= MAX_SIMULATED_DEVICES and not _gpu_plugin_installed()
    from dlrm_jax.train.checks import check_runnable

    cfg = resolve_data_config(cfg)  # binary data's features, checked against the config's
    check_runnable(cfg, devices, processes, simulated=simulated)  # train's checks: a plan only for a config that trains
    if cfg.embedding.tables_per_host:
        print(
            f"embedding.sync={cfg.embedding.sync}: every host holds its own set of tables; the plan of one "
            f"host's {devices // hosts} devices (mesh.hosts={hosts}; 0 is one host per process, planned for "
            "--num-processes, 1 unless given)"
        )
    if cfg.embedding.hot.rows == 0 and not _tiered(cfg):
        # The plan training makes: buckets measured on the same first batches, no devices, no JAX.
        if cap_note(cfg):
            print(cap_note(cfg))
        source = make_source(cfg, trains=True) if cfg.embedding.capacity_from == "measured" else None
        plan = plan_for_run(cfg, devices, hosts, source, simulated)
        print(run_plan_report(cfg, plan, simulated))
        return 0
    # Hot rows are chosen from the data, priced with the engine's own bucket measurement;
    # tiered tables' fill sizes and hit rates are predicted from the first batches.
    start_jax(devices, args)
    from dlrm_jax.train.build import build, mesh_from_config

    plan, _ = build(cfg, mesh_from_config(cfg), make_source(cfg), log=log)
    print(run_plan_report(cfg, plan, simulated))
    return 0


def _tiered(cfg) -> bool:
    return cfg.embedding.storage == "tiered" or any(item.endswith("=tiered") for item in cfg.embedding.table_storage)


def _gpu_plugin_installed() -> bool:
    """Whether JAX would find a GPU plugin (cluster.profile=auto prices simulated CPU devices
    otherwise), without importing JAX."""
    import importlib.util

    return any(importlib.util.find_spec(name) for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm_plugin"))
