"""``dlrm-jax predict``: raw input files -> one probability a line, in input order."""

from __future__ import annotations

import glob
import itertools
import os
import re
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dlrm_jax import stopping
from dlrm_jax.data.preprocessing.criteo_preprocess import parse_block
from dlrm_jax.data.preprocessing.preprocess import DataFormatError, SkipLog, byte_progress, open_input
from dlrm_jax.data.sources.criteo import CriteoFormatError
from dlrm_jax.files import full_disk_as
from dlrm_jax.serving.model import ServingModel
from dlrm_jax.serving.rules import LAYOUT_LINES, criteo_labeled, parse_criteo

CHUNK_LINES = 1 << 16


@dataclass(frozen=True)
class PredictReport:
    lines: int
    scored: int
    skipped: str  # SkipLog's summary line ('' when nothing was skipped)
    seconds: float

    def summary(self, output: str) -> str:
        rate = self.lines / max(self.seconds, 1e-9)
        line = (
            f"predicted {self.scored} of {self.lines} lines to {output} in {self.seconds:.2f} s ({rate:,.0f} lines/s)"
        )
        return line + (f"\n{self.skipped} (scored nan)" if self.skipped else "")


def predict_files(
    model: ServingModel,
    inputs: Sequence[str],
    output: str | Path,
    *,
    batch_size: int = 4096,
    skip_bad_lines: bool = False,
    progress: bool = True,
    overwrite: bool = False,
) -> PredictReport:
    """Score every line of ``inputs`` (plain or gzipped, the training files' layout: Criteo TSV
    with the label first or absent, or a tabular schema's, one record a line) into ``output``,
    one probability a line (a record); a malformed line stops the run naming its file and line,
    or (``skip_bad_lines``) is scored nan. The paths are checked before any line is scored
    (:func:`check_paths`). A file ``output`` appears whole or not at all, and one that exists
    is replaced only with ``overwrite`` (a symbolic link's target, the link kept); ``-``, a pipe
    or a device (``/dev/stdout``) is written to as the lines are scored."""
    start, log = time.perf_counter(), SkipLog(skip_bad_lines, DataFormatError)
    output = Path(output)
    check_paths(inputs, output, model.folders)
    if writes_through(output):
        fd = open_descriptor(output)
        # (a full disk behind standard output was "[Errno 28] No space left on device", naming nothing)
        full = lambda: f"--output {output}: no space left on device while writing the scores: free space"
        with full_disk_as(full), open(output if fd is None else fd, "w", closefd=fd is None) as out:
            lines, scored = _write_scores(model, inputs, out, batch_size, log, progress)
        return PredictReport(lines, scored, log.summary(), time.perf_counter() - start)
    if output.exists() and not overwrite:
        raise FileExistsError(f"--output {output}: exists; pass --overwrite to replace it, or write to a new file")
    # A new file of its own beside the output ("x": never an existing one, such as an input),
    # renamed over the output (a link's target) once every line is scored.
    target = Path(os.path.realpath(output))
    remove_stale_partials(target)
    partial = target.with_name(f".{target.name}.{_this_process()}.partial")
    out = open(partial, "x")  # noqa: SIM115 - closed below, before the rename
    full = lambda: (
        f"--output {output}: no space left on device while writing the scores; "
        f"{'the file is as it was' if output.exists() else 'nothing was written'}: free space or write elsewhere"
    )
    try:
        with full_disk_as(full):
            with out:
                lines, scored = _write_scores(model, inputs, out, batch_size, log, progress)
            os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return PredictReport(lines, scored, log.summary(), time.perf_counter() - start)


def remove_stale_partials(target: Path) -> None:
    """The partial score files of ``target`` that killed runs left (SIGKILL, the OOM killer:
    no ``finally`` ran), each named by its host and process: removed once that process, on
    this host, has ended. They were hidden and kept for good (2.6 MB after 5 s of a 450k-line
    job); those of other hosts (a shared folder) are left to theirs."""
    host = _this_process().rsplit("-", 1)[0] + "-"
    for partial in target.parent.glob(f".{glob.escape(target.name)}.{glob.escape(host)}*.partial"):
        pid = partial.name[len(target.name) + 2 + len(host) : -len(".partial")]
        if pid.isdigit() and int(pid) != os.getpid() and stopping.ended(int(pid)):
            partial.unlink(missing_ok=True)


def _this_process() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def open_descriptor(output: str | Path) -> int | None:
    """The descriptor this process already has open that ``output`` names (``-``,
    ``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``, ``/proc/self/fd/N``), else None. Written
    through it, not opened again: reopening ``/dev/stdout`` where the shell redirected it to a
    file would truncate that file (``>>`` too) and write from its start."""
    name = str(output)
    if name == "-":
        return 1
    match = _DESCRIPTOR.fullmatch(os.path.abspath(name))
    if match is None:
        return None
    if match[1]:
        return {"stdout": 1, "stderr": 2}[match[1]]
    return int(match[2] or match[3])


_DESCRIPTOR = re.compile(r"/dev/(?:(stdout|stderr)|fd/(\d+))|/proc/self/fd/(\d+)")


def writes_through(output: str | Path) -> bool:
    """Whether ``output`` is written as lines are scored (``-``, a descriptor this process has
    open, a pipe, a device), not a file that appears whole (checked on the name as given:
    ``/dev/stdout`` redirected to a file is the file once its links are followed)."""
    return open_descriptor(output) is not None or (Path(output).exists() and not Path(output).is_file())


def _write_scores(model: ServingModel, inputs, out, batch_size: int, log: SkipLog, progress: bool) -> tuple[int, int]:
    """Every input line's score into ``out``: (lines, lines scored, not nan)."""
    lines = scored = 0
    with byte_progress(inputs, "predict", progress) as bar:
        for path in inputs:
            if model.rules.format == "tabular":
                for probs in _tabular(model, str(path), batch_size, log, bar):
                    out.write("\n".join(f"{p:.9g}" for p in probs.tolist()) + "\n")
                    lines, scored = lines + len(probs), scored + int((~np.isnan(probs)).sum())
                    stopping.raise_if_stopped()
                continue
            with open_input(path, CriteoFormatError) as (raw, f):
                lineno, read, labeled = 1, 0, None
                while chunk := list(itertools.islice(f, CHUNK_LINES)):
                    labeled = criteo_labeled(chunk) if labeled is None else labeled  # the file's first chunk's
                    probs = _score(model, chunk, batch_size, log, str(path), lineno, labeled)
                    out.write("\n".join(f"{p:.9g}" for p in probs.tolist()) + "\n")
                    lines, scored = lines + len(chunk), scored + int((~np.isnan(probs)).sum())
                    lineno += len(chunk)
                    bar.update(raw.tell() - read)
                    read = raw.tell()
                    stopping.raise_if_stopped()  # a stop signal kept while the chunk was scored
    return lines, scored


def check_paths(inputs: Sequence[str | Path], output: Path, protected: Sequence[Path] = ()) -> None:
    """Refuses, before anything is read or written: an input that is missing or not a file; an
    output that is a folder, lies in a missing folder, is one of the inputs (it would be
    replaced by their scores), or lies inside ``protected`` (the model's artifact and deltas,
    whose files it would replace)."""
    for path in map(Path, inputs):
        if not path.exists():
            raise FileNotFoundError(f"--input {path}: no such file")
        if path.is_dir():
            raise IsADirectoryError(f"--input {path}: a folder, not a file: give the files in it")
        if not path.is_file():  # (lines are read twice and sized on disk: a stream cannot be)
            raise ValueError(
                f"--input {path}: not a regular file (a pipe or device); save it to a file, gzipped or not"
            )
    if open_descriptor(output) is not None:  # standard output, or another open descriptor
        return
    if output.is_dir():
        raise IsADirectoryError(f"--output {output}: a folder; give the path of the file to write the scores to")
    if not output.parent.is_dir():
        missing = next((p for p in reversed(output.parents) if not p.is_dir()), output.parent)
        if missing.exists():  # (it said "its folder keep.txt does not exist" of a file)
            raise NotADirectoryError(f"--output {output}: {missing} is a file, not a folder")
        raise FileNotFoundError(f"--output {output}: its folder {output.parent} does not exist")
    target = Path(os.path.realpath(output))
    if not target.parent.is_dir():  # a link into a missing folder (the error named a temporary file)
        raise FileNotFoundError(f"--output {output}: a link to {target}, whose folder does not exist")
    same = [p for p in map(Path, inputs) if output.exists() and os.path.samefile(p, output)]
    if same:
        raise ValueError(
            f"--output {output} is also --input {same[0]}: the scores would replace the lines they come "
            f"from; write them to another file"
        )
    where = target.parent  # where the scores land: a link's target's folder
    for folder in protected:
        if where == Path(folder).resolve() or Path(folder).resolve() in where.parents:
            raise ValueError(
                f"--output {output} lies inside the serving artifact {folder}: the scores would replace "
                f"or add to its files; write them outside it"
            )


def _score(
    model: ServingModel, chunk: list[bytes], batch_size: int, log: SkipLog, path: str, lineno: int, labeled: bool
) -> np.ndarray:
    """Probabilities of a chunk of lines of a file with labels or without (nan for a bad line,
    which ``log`` records): pyarrow's reader when every line is valid (as preprocess reads),
    else the strict parser, which says what is wrong with each bad line."""
    given = chunk if labeled else [b"0\t" + line for line in chunk]  # a label to read by, not used
    fast = parse_block(b"".join(given))
    if fast is not None and fast.lines == len(chunk):
        return model.predict_values(fast.dense, fast.values, fast.empty, batch_size)
    parsed = parse_criteo(chunk, labeled, of_file=True)
    for bad in parsed.bad:
        log.record(path, lineno + bad.index, bad)
    probs = np.full(len(chunk), np.nan, np.float32)
    if len(parsed.rows):
        probs[parsed.rows] = model.predict_values(model.rules.dense(parsed), parsed.values, parsed.empty, batch_size)
    return probs


def _tabular(model: ServingModel, path: str, batch_size: int, log: SkipLog, bar) -> Iterator[np.ndarray]:
    """Per chunk of a tabular file's records, their probabilities in file order (nan: skipped)."""
    with open_input(path, DataFormatError) as (_, f):
        leading = list(itertools.islice(f, LAYOUT_LINES))
    with open_input(path, DataFormatError) as (raw, f):
        yield from model.score_records(model.rules.chunks(f, raw, path, leading, log, CHUNK_LINES, bar), batch_size)
