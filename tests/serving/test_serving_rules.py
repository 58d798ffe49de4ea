"""The serving artifact's pieces without a trained model: int8 rows, raw values to ids."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dlrm_jax.serving.artifact import ArtifactError, dequantize_int8, quantize_int8
from dlrm_jax.serving.rules import IdRules, raw_rules
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


def test_a_dataset_numbered_from_1_is_exported_and_scored_by_its_own_ids(tmp_path):
    """Datasets preprocessed before 2026-11-25 (the same meta.json format) gave a vocabulary's
    values ids from 1, the unseen sharing 0 with the missing: their exports read them from 2
    (98% of a sample's ids other than training's, scores up to 0.33 away, without a word)."""
    from dlrm_jax.train.serving_rules import vocabulary_ids

    (tmp_path / "vocab").mkdir()
    np.save(tmp_path / "vocab" / "feature_0.npy", np.array([[70, 9], [5, 4], [12, 1]], np.uint64))
    assert vocabulary_ids(tmp_path, {"cardinalities": [5]}) == {"missing_id": 0, "oov_id": 1, "first_id": 2}
    older = vocabulary_ids(tmp_path, {"cardinalities": [4]})
    assert older == {"missing_id": 0, "oov_id": 0, "first_id": 1}
    with pytest.raises(ValueError, match="its vocabularies do not match its tables' rows"):
        vocabulary_ids(tmp_path, {"cardinalities": [9]})
    spec = {"kind": "vocabulary", "files": ["vocab/feature_0.npy"], "cardinalities": [4]}
    values = np.array([[70], [5], [12], [99], [0]], np.uint64)
    empty = np.array([[False], [False], [False], [False], [True]])
    assert IdRules(tmp_path, spec | older, [4]).ids(values, empty)[:, 0].tolist() == [1, 2, 3, 0, 0]
    with pytest.raises(ArtifactError, match="exported from a dataset preprocessed before 2026-11-25, whose ids"):
        IdRules(tmp_path, spec, [4])  # (an export that read them from 2: refused, not misread)


def test_dynamic_tables_exported_before_their_maps_kind_was_recorded_are_refused(tmp_path):
    """Before: read as maps of vocabulary ids, where preprocess --raw-values had given them raw
    values (every line scored up to 0.39 away, without a word)."""
    np.save(tmp_path / "v.npy", np.array([[70, 9]], np.uint64))
    manifest = {
        "features": [{"rows": 3}] * 26,
        "id_maps": {"cat_1": {}},
        "preprocessing": {"kind": "vocabulary", "format": "criteo", "files": ["v.npy"] * 26, "cardinalities": [3] * 26},
    }
    with pytest.raises(ArtifactError, match="dynamic tables exported by an older dlrm_jax, which did not record"):
        raw_rules(tmp_path, manifest)
    manifest["preprocessing"]["raw_values"] = False
    assert raw_rules(tmp_path, manifest).maps_values is False


def test_an_older_multi_hot_export_says_exporting_again_keeps_its_rule(tmp_path):
    """Exports before 2026-12-06 did not keep the bags' rule: refused, without the remedy."""
    why = "its bags were drawn by preprocess --multi-hot, whose rule is not kept"
    manifest = {"features": [{"rows": 3}] * 26, "preprocessing": {"kind": "none", "why": why}}
    with pytest.raises(ArtifactError, match="whose rule is not kept; exporting the run again with this version keeps"):
        raw_rules(tmp_path, manifest)
