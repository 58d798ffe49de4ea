"""What a run shows while it trains: a progress bar on a terminal, plain lines otherwise.

On process 0 only. With ``train.progress_bar`` and a terminal on stderr, a tqdm bar (epoch,
loss, samples/s as its postfix); without a terminal (a log file, a cluster job, the launch
supervisor) or with the bar off, one line per ``train.log_every`` steps: step, epoch, loss,
samples/s and the time left, so a job's log shows progress without carriage-return frames.
"""

from __future__ import annotations

import sys

from tqdm import tqdm


class StepDisplay:
    """``update`` after every step, ``window`` at each logged step, ``write`` for other lines."""

    def __init__(
        self,
        total: int,
        start: int,
        *,
        bar: bool,
        shown: bool,
        batch: int,
        epoch_rows: int | None,
        log=print,
        stream=None,
    ):
        stream = stream or sys.stderr
        self.total, self.batch, self.epoch_rows, self.log, self.shown = total, batch, epoch_rows, log, shown
        self.tty = shown and bar and stream.isatty()
        # (no bar made without a terminal: tqdm's, even disabled, fixed the process's multiprocessing
        # start method, a notebook's set_start_method("spawn") then refused, and left a monitor thread)
        self.bar = tqdm(total=total, initial=start, unit="step", file=stream, dynamic_ncols=True) if self.tty else None

    def update(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def window(self, step: int, loss: float, samples_per_s: float, seconds_per_step: float) -> None:
        """A logged step: the bar's postfix, or one plain line."""
        epoch = f"{step * self.batch / self.epoch_rows:.2f}" if self.epoch_rows else None
        if self.tty:
            self.bar.set_postfix(
                **({"epoch": epoch} if epoch else {}), loss=f"{loss:.4f}", samples_per_s=f"{samples_per_s:,.0f}"
            )
        elif self.shown:
            left = (self.total - step) * seconds_per_step
            self.log(
                f"step {step}/{self.total}"
                + (f" epoch {epoch}" if epoch else "")
                + f" loss {loss:.4f} samples/s {samples_per_s:,.0f} left {_duration(left)}"
            )

    def write(self, line: str) -> None:
        if self.tty:
            self.bar.write(line)
        elif self.shown:
            self.log(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
