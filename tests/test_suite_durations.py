"""scripts/suite_durations.py, which .ci/run runs after the suite: the JSON it writes from a small
hand-written JUnit XML in pytest's form (xdist's included: one suite, classnames from node ids)."""

import importlib.metadata
import importlib.util
import json

from tests.helpers import REPO

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests">
  <testsuite name="pytest" errors="1" failures="1" skipped="1" tests="6" time="125.5"
             timestamp="2026-11-28T09:00:00.000000+00:00" hostname="ci">
    <testcase classname="tests.embedding.test_tiered" name="test_resume[8]" time="60.25" />
    <testcase classname="tests.embedding.test_tier_io" name="test_reads" time="1.5">
      <failure message="assert 1 == 2">AssertionError</failure>
    </testcase>
    <testcase classname="tests.train.test_train" name="test_trains" time="30.0" />
    <testcase classname="tests.test_docs" name="test_links" time="0.5">
      <skipped type="pytest.skip" message="no network">skipped</skipped>
    </testcase>
    <testcase classname="tests.test_docs.TestReadme" name="test_first_line" time="2.0">
      <error message="failed on teardown">OSError</error>
    </testcase>
    <testcase classname="tests.train.test_train" name="test_bf16" time="3.0" />
  </testsuite>
</testsuites>
"""


def load_script():
    spec = importlib.util.spec_from_file_location("suite_durations", REPO / "scripts" / "suite_durations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_durations_from_a_junit_file(tmp_path, capsys):
    script = load_script()
    (tmp_path / "junit.xml").write_text(JUNIT)
    assert script.main([str(tmp_path / "junit.xml")]) == 0  # the JSON beside the XML by default
    got = json.loads((tmp_path / "durations.json").read_text())
    assert got["date"] == "2026-11-28T09:00:00.000000+00:00" and got["wall_s"] == 125.5
    assert (got["tests"], got["passed"], got["failed"], got["error"], got["skipped"]) == (6, 3, 1, 1, 1)
    assert got["seconds_by_folder"] == {"tests/embedding": 61.75, "tests/train": 33.0, "tests": 2.5}
    assert list(got["seconds_by_folder"]) == ["tests/embedding", "tests/train", "tests"]  # slowest first
    assert got["slowest"][:3] == [
        {"test": "tests/embedding/test_tiered.py::test_resume[8]", "seconds": 60.25, "outcome": "passed"},
        {"test": "tests/train/test_train.py::test_trains", "seconds": 30.0, "outcome": "passed"},
        {"test": "tests/train/test_train.py::test_bf16", "seconds": 3.0, "outcome": "passed"},
    ]
    assert got["slowest"][3] == {
        "test": "tests/test_docs.py::TestReadme::test_first_line",
        "seconds": 2.0,
        "outcome": "error",
    }
    assert len(got["slowest"]) == 6 and got["machine"]["cpus"] >= 1 and got["python"].count(".") == 2
    assert got["jax"] == importlib.metadata.version("jax")
    said = capsys.readouterr().out
    assert said.startswith("6 tests (3 passed, 1 failed, 1 errors, 1 skipped) in 2:05 on ")
    assert "tests/embedding 1:01" in said and "tests/embedding/test_tiered.py::test_resume[8] 60 s" in said


def test_an_explicit_output_path_and_a_bare_testsuite_root(tmp_path):
    """Older pytest wrote the <testsuite> as the root; the output's folders are made."""
    script = load_script()
    (tmp_path / "junit.xml").write_text(JUNIT.split("\n", 2)[2].replace("</testsuites>", "").strip())
    out = tmp_path / "ci" / "figures.json"
    script.main([str(tmp_path / "junit.xml"), str(out)])
    assert json.loads(out.read_text())["tests"] == 6


def test_the_slow_list_holds_the_tests_at_or_over_the_limit_and_conftest_marks_them(tmp_path):
    """--slow-list writes the node ids of the tests at or over --slow-seconds, sorted, under a
    header; conftest reads such a file and marks those tests slow (the committed list's
    entries are real node ids of the suite)."""
    script = load_script()
    (tmp_path / "junit.xml").write_text(JUNIT)
    listed = tmp_path / "slow.txt"
    assert (
        script.main(
            [str(tmp_path / "junit.xml"), str(tmp_path / "d.json"), "--slow-list", str(listed), "--slow-seconds", "3"]
        )
        == 0
    )
    lines = listed.read_text().splitlines()
    assert lines[0].startswith("# Tests of 3 s or more in the full run of 2026-11-28 (6 tests")
    assert [line for line in lines if not line.startswith("#")] == [
        "tests/embedding/test_tiered.py::test_resume[8]",
        "tests/train/test_train.py::test_bf16",
        "tests/train/test_train.py::test_trains",
    ]
    from tests import conftest

    assert conftest.measured_slow() and all("::" in n and n.startswith("tests/") for n in conftest.measured_slow())


def test_conftest_drops_compiled_programs_between_tests_past_half_the_mapping_limit(monkeypatch):
    """Each loaded XLA:CPU executable holds memory mappings of its own; a worker whose caches
    reached vm.max_map_count died in its next compile. conftest drops the compile memo and
    jit's caches between tests once the process holds more than half the limit, not before."""
    import jax
    import jax.numpy as jnp

    from tests import conftest

    double = jax.jit(lambda x: 2 * x + 1)
    double(jnp.ones(13))
    assert conftest._mapping_count() > 0 and double._cache_size() == 1
    memo = len(conftest._EXECUTABLES)
    monkeypatch.setattr(conftest, "_MAPPINGS_HIGH", 10**9)
    conftest.pytest_runtest_teardown(None, None)
    assert double._cache_size() == 1 and len(conftest._EXECUTABLES) == memo
    monkeypatch.setattr(conftest, "_MAPPINGS_HIGH", 0)
    conftest.pytest_runtest_teardown(None, None)
    assert double._cache_size() == 0 and not conftest._EXECUTABLES
