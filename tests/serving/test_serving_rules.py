"""The serving artifact's pieces without a trained model: int8 rows, raw values to ids."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dlrm_jax.serving.artifact import dequantize_int8, quantize_int8
from dlrm_jax.serving.rules import IdRules
from tests.helpers import examples

ROWS = hnp.arrays(
    np.float32, st.tuples(st.integers(1, 20), st.integers(1, 16)), elements=st.floats(-100, 100, width=32)
)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a range that underflows once gave 0/0
@settings(max_examples=examples(60))
@given(ROWS)
def test_int8_rows_come_back_within_half_a_step_of_their_range(values):
    q, scale_offset = quantize_int8(values)
    back = dequantize_int8(q, scale_offset)
    step = (values.max(axis=1) - values.min(axis=1)) / 255
    assert q.dtype == np.int8 and scale_offset.shape == (len(values), 2)
    assert np.all(np.abs(back - values) <= step[:, None] / 2 + 1e-5 * (1 + np.abs(values)))


def test_vocabulary_and_compact_ids_as_preprocessing_gives_them(tmp_path):
    # vocabulary: (value, count) by id from 2; missing 0; unseen 1; a capped table wraps
    np.save(tmp_path / "v.npy", np.array([[70, 9], [5, 4], [12, 1]], np.uint64))
    rules = IdRules(tmp_path, {"kind": "vocabulary", "files": ["v.npy"], "cardinalities": [5]}, [4])
    values = np.array([[70], [5], [12], [99], [0]], np.uint64)
    empty = np.array([[False], [False], [False], [False], [True]])
    assert rules.ids(values, empty)[:, 0].tolist() == [2, 3, 4 % 4, 1, 0]
    # compact: value % M ranked among the kept hashed values; unseen ones to the last (OOV) row
    np.save(tmp_path / "c.npy", np.array([[0, 3], [4, 2], [7, 1], [0, 0]], np.uint64))
    spec = {"kind": "compact", "files": ["c.npy"], "max_ind_range": 10, "oov_rows": [3], "cardinalities": [4]}
    got = IdRules(tmp_path, spec, [4]).ids(np.array([[10], [14], [27], [3]], np.uint64), np.zeros((4, 1), bool))
    assert got[:, 0].tolist() == [0, 1, 2, 3]
    spec["oov_rows"] = [None]  # every value counted in training (--vocab-from all): hashed 0's row
    np.save(tmp_path / "c.npy", np.array([[0, 3], [4, 2], [7, 1]], np.uint64))
    assert IdRules(tmp_path, spec, [3]).ids(np.array([[3]], np.uint64), np.zeros((1, 1), bool))[0, 0] == 0
