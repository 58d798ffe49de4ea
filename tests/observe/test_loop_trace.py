"""train.trace_steps: a trace of the training loop read back into where a step's time went;
the interval arithmetic against a brute-force count; host threads named for the OS."""

import json
import threading
import time
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_jax.observe.loop_trace import Event, LoopTrace, overlap_ns, summarize, union_ns
from dlrm_jax.observe.threads import name_os_thread
from dlrm_jax.train.trainer import train_and_evaluate
from tests.helpers import QUIET, examples, tiny_config

intervals = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)).map(lambda t: (t[0], t[0] + t[1])), max_size=12)


def covered(ivs) -> np.ndarray:
    at = np.zeros(100, bool)
    for s, e in ivs:
        at[s:e] = True
    return at


@settings(max_examples=examples(80))
@given(intervals, intervals)
def test_union_and_overlap_count_each_instant_once(a, b):
    assert union_ns(a) == covered(a).sum()
    assert overlap_ns(a, b) == sum((covered([iv]) & covered(b)).sum() for iv in a)


def test_a_gpu_traces_summary():
    """Three launches 10 us apart (each logs a nested event too): two steps of 10 us; kernels
    cover 12 of their 20 us, with a 3 us copy in, 2 us of it under a kernel."""
    launch = "PjitFunction(jit(_train_step))"
    host = {
        "python3": [e for t in (0, 10_000, 20_000) for e in (Event(launch, t, 500), Event(launch, t + 100, 300))]
        + [Event("CommonPjRtBuffer::Await", 1_000, 4_000)],
        "input_0": [Event("DevicePutWithSharding", 2_000, 1_000)],
        "XLAPool": [Event("something", 0, 30_000)],
    }
    stream = [
        Event("fusion_1", 1_000, 5_000),
        Event("MemcpyH2D", 4_000, 3_000),
        Event("gemm", 12_000, 7_000),
        Event("MemcpyD2H", 19_000, 10),
        Event("late_kernel", 25_000, 5_000),  # after the span
    ]
    planes = {"/host:CPU": host, "/device:GPU:0": {"Stream #14(Compute)": stream, "XLA Ops": []}}
    s = summarize(planes, steps=2)
    assert s["trace_steps"] == 2 and s["trace_step_ms"] == 0.01
    assert s["trace_launch_ms"] == 0.0005
    assert np.isclose(s["trace_device_busy_ms"], 0.006) and np.isclose(s["trace_device_idle_share"], 0.4)
    assert np.isclose(s["trace_h2d_ms"], 0.0015) and np.isclose(s["trace_h2d_under_kernels_share"], 2 / 3)
    assert s["trace_d2h_per_step"] == 0.5
    assert s["trace_threads_xla_ms"] == {"input_0": 0.0005}
    assert summarize({"/host:CPU": {"python3": []}}) == {}


def test_a_traced_step_holding_an_evaluation_is_left_out():
    """Before: the evaluation (and a save's state check) inside the traced span counted as
    step time: a smoke run's trace said 69.81 ms a step where its windows showed 5-16."""
    launch, evaluate = "PjitFunction(jit(_train_step))", "PjitFunction(jit(_eval_step))"
    host = {"python3": [Event(launch, t, 500) for t in (0, 10_000, 20_000, 90_000)] + [Event(evaluate, 25_000, 60_000)]}
    s = summarize({"/host:CPU": host})
    assert s["trace_steps"] == 2 and s["trace_step_ms"] == 0.01 and s["trace_launch_ms"] == 0.0005


def test_the_first_traced_step_follows_the_first_window():
    assert LoopTrace.first_step(0, 1000, 20, 50) == 51
    assert LoopTrace.first_step(100, 1000, 20, 0) == 111  # no log windows: after 10 steps
    assert LoopTrace.first_step(0, 30, 20, 50) == 11  # as late as leaves 20
    assert LoopTrace.first_step(0, 10, 20, 50) == 2  # never the compiling step


def test_a_run_logs_its_trace_and_result_waits(tmp_path):
    cfg = tiny_config("train.steps=12", "train.log_every=4", "train.trace_steps=3", "train.eval_every=0")
    train_and_evaluate(cfg, tmp_path / "run", **QUIET)
    events = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (trace,) = [e for e in events if e.get("event") == "trace"]
    assert trace["step"] == 7 and trace["trace_steps"] == 3  # steps 5-7, after the window ending at 4
    assert trace["trace_step_ms"] > trace["trace_launch_ms"] > 0
    assert Path(trace["trace_dir"]) == tmp_path / "run" / "trace" / "process_0"
    assert list(Path(trace["trace_dir"]).rglob("*.xplane.pb")) and list(
        Path(trace["trace_dir"]).rglob("*.trace.json.gz")
    )
    windows = [e for e in events if e.get("event") == "train"]
    assert all(e["result_wait_ms"] >= 0 for e in windows)
    # the reads' CPU is part of the thread's (within the same window), the rest the loop's own
    assert all(0 <= e["result_read_cpu_ms"] <= e["dispatch_ms"] for e in windows)
    # Resumed further in the same run dir, it traces again and reads its own session (before: a
    # second trace file there failed the run, 'too many values to unpack', after its traced steps).
    more = tiny_config("train.steps=24", "train.log_every=4", "train.trace_steps=3", "train.eval_every=0")
    train_and_evaluate(more, tmp_path / "run", **QUIET)
    events = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "trace"] == [7, 19]
    assert len(list(Path(trace["trace_dir"]).rglob("*.xplane.pb"))) == 2


def test_the_windows_leave_out_the_first_state_checks_compile(tmp_path, monkeypatch):
    """The first check of a state about to be saved compiles it and the eval step it runs
    (about 17 s in the last window of a 100-step run on 8 CPU devices with dynamic tables,
    which put the run's samples/s at 0.38x its windows'). Here that first call takes 3 s more:
    left out of the window as the train step's compile is, 4 tiny steps still run at well over
    256 samples in 3 s."""
    from dlrm_jax.train.step import StepFunctions

    calls = _first_call_slower(monkeypatch, StepFunctions, "state_check")
    summary, windows = _saving_every_4_of_8_steps(tmp_path)
    assert len(calls) == 2 and [e["step"] for e in windows] == [4, 8]
    assert windows[0]["samples_per_s"] > 4 * 64 / 3.0 and summary.samples_per_s > 8 * 64 / 3.0
    assert windows[0]["dispatch_ms"] < 3000 / 4  # (the sleep is no CPU; the compile's CPU is left out too)


def test_the_windows_leave_out_every_state_checks_run(tmp_path, monkeypatch):
    """Each check of a state about to be saved reads every table for non-finite values (about
    1 s a save for criteo_kaggle's tables on 4 CPU devices: the last window of a 24-step run
    read 1,045 samples/s against its others' 22,000): checkpointing's time, left out of the
    window's samples/s as the save is. Here each check's result takes 3 s more to read."""
    from dlrm_jax.train.watch import LossWatch

    calls, check = [], LossWatch.check_state

    def slow(self, *args):
        calls.append(1)
        time.sleep(3.0)
        return check(self, *args)

    monkeypatch.setattr(LossWatch, "check_state", slow)
    summary, windows = _saving_every_4_of_8_steps(tmp_path)
    assert len(calls) == 2 and [e["step"] for e in windows] == [4, 8]
    assert min(e["samples_per_s"] for e in windows) > 4 * 64 / 3.0 and summary.samples_per_s > 8 * 64 / 3.0


def test_a_tiered_runs_windows_leave_out_its_steps_compile(tmp_path, monkeypatch):
    """Tiered tables' step compiles on its first call (its cache fills' shapes come with the
    first planned batch): that call is left out of the window's samples/s, as the device
    step's compile before the loop is, and it is reported (a smoke run's first window read 312
    samples/s against 40,916 after, and its final line 618). Here the first call takes 3 s more."""
    from dlrm_jax.train.tier_runner import TierRunner
    from tests.embedding.tiered_configs import BASE, TIERED

    calls = _first_call_slower(monkeypatch, TierRunner, "train")
    logged = []
    summary, windows = _saving_every_4_of_8_steps(tmp_path, *BASE, *TIERED, log=logged.append)
    assert len(calls) == 8 and [e["step"] for e in windows] == [4, 8]
    assert windows[0]["samples_per_s"] > 4 * 32 / 3.0 and summary.samples_per_s > 8 * 32 / 3.0
    assert any(line.startswith("compiled the train step in ") for line in logged), logged


def _first_call_slower(monkeypatch, cls, name: str, seconds: float = 3.0) -> list:
    """``cls.name``'s first call takes ``seconds`` more; the list of its calls."""
    calls, method = [], getattr(cls, name)

    def slow_first(self, *args):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(seconds)
        return method(self, *args)

    monkeypatch.setattr(cls, name, slow_first)
    return calls


def _saving_every_4_of_8_steps(tmp_path, *sets, **kw):
    """A tiny run of 8 steps logging and saving every 4: its summary and window events."""
    cfg = tiny_config("train.steps=8", "train.log_every=4", "train.checkpoint_every=4", "train.eval_every=0", *sets)
    summary = train_and_evaluate(cfg, tmp_path / "run", **(QUIET | kw))
    events = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return summary, [e for e in events if e.get("event") in ("train", "eval")]


def test_threads_carry_their_names_to_the_os():
    got = []

    def work():
        name_os_thread()
        got.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    t = threading.Thread(target=work, name="input_7-and-a-long-tail")
    t.start()
    t.join()
    assert got == ["input_7-and-a-l"]  # cut to 15 bytes
