"""The hang watch's decisions (PeerWatchdog._check_progress) against a fake coordination
service: no processes, so the timing is the test's own."""

import pytest

from dlrm_jax.parallel import watchdog as mesh


class FakeClient:
    def __init__(self):
        self.kv = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


class Exited(Exception):
    pass


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(mesh.time, "monotonic", lambda: now[0])
    return now


def watchdog(me, timeout_s=10.0):
    w = mesh.PeerWatchdog(2, me)
    w.hang_timeout_s = timeout_s

    def exit_(why):
        raise Exited(why)

    w._exit = exit_
    return w


def test_a_stall_past_the_timeout_exits_naming_every_process(clock):
    client, w0, w1 = FakeClient(), watchdog(0), watchdog(1)
    w0.progress(12, "train step")
    w1.progress(11, "reading input")
    w0._check_progress(client)
    w1._check_progress(client)
    clock[0] += 9
    w1._check_progress(client)  # within the timeout
    clock[0] += 2
    with pytest.raises(
        Exited,
        match=r"no progress for 11 s \(reading input at step 11; .*process 0: "
        r"train step at step 12; process 1: reading input at step 11",
    ):
        w1._check_progress(client)


def test_compiling_is_not_timed_for_the_compiler_nor_for_peers_waiting_on_it(clock):
    client, w0, w1 = FakeClient(), watchdog(0), watchdog(1)
    w0.progress(0, "compiling the train step", timed=False)
    w1.progress(1, "train step")  # compiled quickly: waits for process 0 in the step's collectives
    w0._check_progress(client)
    for _ in range(30):  # 60 s of compiling, checked every 2 s as the thread does
        clock[0] += 2
        w0._check_progress(client)
        w1._check_progress(client)
    w0.progress(1, "train step")  # done compiling; its watchdog publishes at its next poll
    clock[0] += 2
    w1._check_progress(client)  # the peer's last compiling report excuses up to now
    w0._check_progress(client)
    clock[0] += 7  # then nobody moves for longer than the timeout: that is a hang
    w1._check_progress(client)
    clock[0] += 2
    with pytest.raises(Exited, match=r"no progress for 1\d s \(train step at step 1"):
        w1._check_progress(client)


def test_no_timeout_means_no_check(clock):
    client, w = FakeClient(), watchdog(0, timeout_s=0)
    w.progress(3, "reading input")
    clock[0] += 10_000
    w._check_progress(client)


def test_a_lost_peers_advice_promises_a_resume_only_with_a_checkpoint(tmp_path, monkeypatch, capsys):
    """Before: 'the newest checkpoint is intact' was said of a run that had saved none (a peer
    lost before the first checkpoint, or a run without a run dir)."""
    monkeypatch.setattr(mesh.os, "_exit", lambda status: (_ for _ in ()).throw(Exited(status)))
    monkeypatch.setattr(mesh, "_checkpoints", None)  # (restored after: other tests' state)
    w = mesh.PeerWatchdog(2, 0)
    with pytest.raises(Exited):  # not told yet (planning): neither promised
        w._exit("lost process(es) 1 of 2")
    line = capsys.readouterr().err
    assert mesh.PEER_LOST_ADVICE in line and "intact" not in line and "start again" not in line, line
    for folder, saved in [(None, False), (tmp_path / "checkpoints", False), (tmp_path / "checkpoints", True)]:
        if saved:
            (tmp_path / "checkpoints" / "20").mkdir(parents=True)
        with mesh.saves_checkpoints_in(folder), pytest.raises(Exited):
            w._exit("lost process(es) 1 of 2")
        line = capsys.readouterr().err
        assert mesh.PEER_LOST_ADVICE in line, line  # (what the launch supervisor reads)
        assert ("the newest checkpoint is intact" in line) == saved, line
        assert ("no checkpoint was saved yet" in line) != saved, line
    # A training that ended well leaves the advice untold for the process's next command (before:
    # an eval after it was advised from that training's checkpoints)
    with mesh.saves_checkpoints_in(tmp_path / "checkpoints"):
        pass
    assert mesh._checkpoints is None
    # A process that found its own error first says its line alone, with its status: a lost peer
    # found meanwhile says nothing and ends nothing (before: a second line, a lost peer's, and
    # os._exit(1) over the status)
    w.failed = 2  # (as failing() sets it)
    w._exit("lost process(es) 1 of 2")
    assert capsys.readouterr().err == ""
