"""The plans of the shipped configs, held as files: a planner change shows as a diff of
``tests/golden/plans/<config>.txt`` in review. After a deliberate change, rewrite them with
``DLRM_UPDATE_GOLDEN=1 pytest tests/embedding/test_golden_plans.py`` and read the diff."""

import os

import pytest

from dlrm_jax.config import load_config
from dlrm_jax.data.sources import make_source, resolve_data_config
from dlrm_jax.train.planning import plan_for_run, run_plan_report
from tests.helpers import TESTS

GOLDEN = TESTS / "golden" / "plans"
CONFIGS = ["default", "smoke", "criteo_kaggle", "mlperf_dlrm_v1", "mlperf_dlrm_dcnv2", "wide_deep"]


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_config_plans_as_recorded(name):
    cfg = resolve_data_config(load_config(name))
    source = make_source(cfg, trains=True) if cfg.embedding.capacity_from == "measured" else None
    devices = cfg.mesh.devices or 8
    report = run_plan_report(cfg, plan_for_run(cfg, devices, cfg.mesh.hosts or 1, source, True), True) + "\n"
    file = GOLDEN / f"{name}.txt"
    if os.environ.get("DLRM_UPDATE_GOLDEN") == "1":
        file.write_text(report)
    assert file.exists(), f"{file}: missing; write it with DLRM_UPDATE_GOLDEN=1"
    assert report == file.read_text(), f"{name}'s plan changed: rewrite {file} with DLRM_UPDATE_GOLDEN=1 if meant"
