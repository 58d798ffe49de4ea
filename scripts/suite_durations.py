"""The test suite's durations as data: reads the JUnit XML of a pytest run and writes a JSON
file with the run's wall time, its counts, the seconds each folder of tests/ took, the slowest
tests, and the machine and versions it ran on; prints a short summary.

    python scripts/suite_durations.py test-results/junit.xml test-results/durations.json

``.ci/run`` runs it after the suite (pytest writes the XML there through PYTEST_ADDOPTS).
The standard library only: it runs wherever the XML is, JAX's version read from the installed
package's metadata (none where JAX is not installed).

Fields: ``wall_s`` is the pytest session from start to end (the XML's suite time);
``seconds_by_folder`` and ``slowest`` are each test's setup, call and teardown added up, so with
several workers (``-n 2``) the folders add up to about the workers times the wall time.

``--slow-list tests/measured_slow.txt`` also writes the tests of 3 s or more (``--slow-seconds``)
of a full run, which ``tests/conftest.py`` marks slow: the fast lane's rule kept as data.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SLOWEST = 30
TOP = "tests"  # the key of the test modules at the top of tests/


def node_id(classname: str, name: str) -> str:
    """pytest's node id back from JUnit's dotted classname: ``tests.embedding.test_tiered`` and
    ``test_x[8]`` give ``tests/embedding/test_tiered.py::test_x[8]`` (a test class after the
    module stays a ``::`` part); a classname without a ``test_`` module is kept as it is."""
    parts = classname.split(".")
    module = next((i for i, p in enumerate(parts) if p.startswith("test_")), None)
    if module is None:
        return f"{classname}::{name}"
    return "::".join(["/".join(parts[: module + 1]) + ".py", *parts[module + 1 :], name])


def folder(classname: str) -> str:
    """The top-level folder of tests/ a test is in: ``tests/embedding``, or ``tests`` for the
    modules at the top (folders' names do not start with ``test``, modules' do)."""
    parts = classname.split(".")
    if len(parts) >= 3 and parts[0] == "tests" and not parts[1].startswith("test"):
        return f"tests/{parts[1]}"
    return TOP


def outcome(case: ET.Element) -> str:
    """failed, error, skipped or passed: a teardown error on a passed test counts as an error."""
    for tag, said in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        if case.find(tag) is not None:
            return said
    return "passed"


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def durations(junit: Path) -> dict:
    """The figures of the run in ``junit`` (pytest's XML, one or more test suites)."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    cases = [c for s in suites for c in s.iter("testcase")]
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    by_folder: dict[str, float] = {}
    timed = []
    for case in cases:
        classname, seconds = case.get("classname", ""), float(case.get("time", 0) or 0)
        said = outcome(case)
        counts[said] += 1
        by_folder[folder(classname)] = by_folder.get(folder(classname), 0.0) + seconds
        timed.append((seconds, node_id(classname, case.get("name", "")), said))
    timed.sort(key=lambda t: (-t[0], t[1]))
    started = next((s.get("timestamp") for s in suites if s.get("timestamp")), None)
    return {
        "date": started or datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "wall_s": round(sum(float(s.get("time", 0) or 0) for s in suites), 2),
        "tests": len(cases),
        **counts,
        "seconds_by_folder": {k: round(v, 2) for k, v in sorted(by_folder.items(), key=lambda kv: -kv[1])},
        "slowest": [{"test": t, "seconds": round(s, 2), "outcome": o} for s, t, o in timed[:SLOWEST]],
        "machine": {
            "cpu": cpu_model() or platform.processor() or None,
            "cpus": os.cpu_count(),
            "system": platform.platform(),
        },
        "python": platform.python_version(),
        "jax": version("jax"),
        "jaxlib": version("jaxlib"),
    }


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def summary(d: dict) -> str:
    lines = [
        f"{d['tests']} tests ({d['passed']} passed, {d['failed']} failed, {d['error']} errors, "
        f"{d['skipped']} skipped) in {minutes(d['wall_s'])} on {d['machine']['cpus']} x {d['machine']['cpu']}",
        "by folder (summed over workers): " + ", ".join(f"{k} {minutes(v)}" for k, v in d["seconds_by_folder"].items()),
        "slowest: " + ", ".join(f"{s['test']} {s['seconds']:.0f} s" for s in d["slowest"][:5]),
    ]
    return "\n".join(lines)


def slow_list(junit: Path, seconds: float, d: dict) -> str:
    """``tests/measured_slow.txt``: the node id of every test of the run in ``junit`` that took
    ``seconds`` or more (setup, call and teardown), sorted, under a header naming the run."""
    root = ET.parse(junit).getroot()
    slow = sorted(
        node_id(c.get("classname", ""), c.get("name", ""))
        for c in root.iter("testcase")
        if float(c.get("time", 0) or 0) >= seconds
    )
    header = (
        f"# Tests of {seconds:g} s or more in the full run of {d['date'][:10]} ({d['tests']} tests in "
        f"{minutes(d['wall_s'])} on {d['machine']['cpus']} x {d['machine']['cpu']}): tests/conftest.py marks them\n"
        f"# slow, so the fast lane (-m 'not slow') leaves them out. Written by scripts/suite_durations.py --slow-list.\n"
    )
    return header + "".join(f"{n}\n" for n in slow)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", type=Path, help="pytest's --junitxml file")
    parser.add_argument("output", type=Path, nargs="?", help="the JSON to write (default: beside the XML)")
    parser.add_argument(
        "--slow-list", type=Path, help="also write the tests that took --slow-seconds or more (tests/measured_slow.txt)"
    )
    parser.add_argument("--slow-seconds", type=float, default=3.0, help="the fast lane's limit per test (default 3)")
    args = parser.parse_args(argv)
    d = durations(args.junit)
    if args.slow_list:
        args.slow_list.write_text(slow_list(args.junit, args.slow_seconds, d), encoding="utf-8")
    output = args.output or args.junit.with_name("durations.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(d, indent=2) + "\n", encoding="utf-8")
    print(f"{summary(d)}\n(written to {output})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
