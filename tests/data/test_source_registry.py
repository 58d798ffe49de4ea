"""Data sources enter by their registries: ``choices.DATA_SOURCES`` (the config's values) and
``data.sources.SOURCES`` (how each is made and checked). A toy source added here, in this file
only, is accepted by the config, checked and read by a training run."""

import numpy as np
import pytest

from dlrm_jax.choices import DATA_SOURCES
from dlrm_jax.config import ConfigError
from dlrm_jax.data import sources
from dlrm_jax.data.batch import Batch
from dlrm_jax.train.trainer import train_and_evaluate
from tests.helpers import QUIET, losses, tiny_config


def test_every_data_source_is_made_by_a_registered_kind():
    assert set(DATA_SOURCES) == set(sources.SOURCES)


class Parity:
    """Label = parity of feature 0's id; dense features are noise. ``reads`` counts the
    batches it served."""

    reads: list = []

    def __init__(self, cfg, process_index, process_count):
        self.rows, self.batch = cfg.table_rows, cfg.train.batch_size // process_count
        self.num_dense, self.seed = cfg.data.num_dense, cfg.train.seed + process_index

    def _batch(self, key: int) -> Batch:
        rng = np.random.default_rng([self.seed, key])
        ids = np.stack([rng.integers(0, r, self.batch) for r in self.rows], axis=1).astype(np.int32)
        dense = rng.normal(size=(self.batch, self.num_dense)).astype(np.float32)
        return Batch(dense, ids, (ids[:, 0] % 2).astype(np.float32))

    def train_batch(self, step):
        Parity.reads.append(step)
        return self._batch(step)

    def train_ids(self, step):
        return self._batch(step).ids

    def eval_batches(self):
        return iter([self._batch(10**6 + i) for i in range(2)])

    def skip_report(self):
        return ""


@pytest.mark.slow
def test_a_toy_source_is_configured_checked_and_read_from_its_registry_rows(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="data.source"):
        tiny_config("data.source=parity")

    def no_path(cfg):
        if cfg.data.path:
            raise ConfigError(f"data.path={cfg.data.path}: data.source=parity reads no files")

    monkeypatch.setitem(DATA_SOURCES, "parity", "labels from the parity of the first feature's id")
    monkeypatch.setitem(sources.SOURCES, "parity", sources.SourceKind(Parity, check_path=no_path))
    with pytest.raises(ConfigError, match="reads no files"):
        sources.resolve_data_config(tiny_config("data.source=parity", "data.path=somewhere"))
    Parity.reads.clear()
    cfg = tiny_config("data.source=parity", "mesh.devices=2")
    train_and_evaluate(cfg, tmp_path, **QUIET)
    assert sorted(set(Parity.reads)) == list(range(cfg.train.steps))
    assert len(losses(tmp_path)) == 3 and all(np.isfinite(losses(tmp_path)))
