"""Stop signals during training: SIGINT, SIGTERM and SIGHUP set a flag the loop reads after
each step (the processes of a run agree on it), say at once what will happen, and a second one
stops at once; :class:`Interrupted` is what the run raises once it has stopped (and saved)."""

from __future__ import annotations

import signal
import threading

import jax

from dlrm_jax import stopping
from dlrm_jax.parallel.coordination import outcomes_of_every_process

# Several processes agree on a stop signal every this many steps (a round trip to the
# coordinator); the step they stop at is the first such one after the signal.
STOP_AGREE_EVERY = 10


class Interrupted(Exception):  # noqa: N818 - a control-flow signal, not an error
    """SIGINT/SIGTERM arrived; the state at ``step`` was checkpointed (if the run has a dir)."""

    def __init__(self, signum: int, step: int, saved: bool):
        self.signum, self.step, self.saved = signum, step, saved
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")

    def __reduce__(self):  # (pickled by a process pool: rebuilt from its own arguments, not its message)
        return type(self), (self.signum, self.step, self.saved)


class StopSignals:
    """SIGINT/SIGTERM set a flag the loop reads after each step, and say at once what will
    happen; a second one stops at once (``stopping.exit_now``). ``saves``: the run has a run dir to save to;
    ``agree_every``: steps between the processes' agreements on stopping (several processes)."""

    def __init__(self, saves: bool = True, agree_every: int = 1):
        self.signum, self._old = None, {}
        self.saves, self.agree_every = saves, agree_every

    def __enter__(self):
        stopping.raise_if_stopped()  # a signal before the loop whose exception was swallowed
        if threading.current_thread() is threading.main_thread():
            for sig in stopping.STOP_SIGNALS:  # SIGHUP: the terminal closed
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        diverted_now = stopping.divert_if_orphaned()  # SIGTERM from a launch supervisor's death: its pipes are gone
        if self.signum is not None and stopping.repeats_parent_death(signum):
            if diverted_now:  # the first notice went to the dead supervisor's pipe: say it where it is read
                stopping.say(self.notice(self.signum))
            return
        if self.signum is not None:  # asked twice: do not wait for the step (or the save)
            stopping.exit_now(signum)
        self.signum = signum
        stopping.say(self.notice(signum))

    def notice(self, signum: int) -> str:
        """The line a first stop signal prints (an evaluation or a save can take minutes, and
        a user who sees nothing presses again and loses the steps since the last save)."""
        name, again = stopping.signal_words(signum)
        when = (
            "after the current step"
            if self.agree_every == 1
            else f"at the next step that is a multiple of {self.agree_every} (the processes agree on it)"
        )
        then = "saves a checkpoint and stops" if self.saves else "stops (no run dir: nothing is saved)"
        return (
            f"dlrm-jax: {name}: the run finishes what it is doing (a step, an evaluation or a save), "
            f"{then} {when}; {again} to stop at once without saving"
        )

    def requested(self, step: int) -> int | None:
        """The signal to stop on, agreed by every process (checked every ``agree_every`` steps
        when there are several, since agreeing is a round trip to the coordinator). Agreed
        through the coordination service's key-value store, not a device program: it needs no
        device time, and a program with collectives that does not depend on the train state
        would still run on devices whose step failed when a peer died."""
        if jax.process_count() == 1:
            return self.signum
        if step % self.agree_every:
            return None
        return max(map(int, outcomes_of_every_process(str(self.signum or 0)))) or None

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
