"""Bad input gives one clear line naming the file, flag or key : paths that are files,
truncated .gz inputs, malformed flags, NaN in JSON, SIGTERM before training, per-host plans."""

import gzip
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrm_jax.cli import build_parser
from dlrm_jax.config import ConfigError, load_config
from dlrm_jax.files import check_dir, json_text, make_dir
from tests.child_env import child_env, cli


def one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


# ---------------------------------------------------------------- folders that are files


def test_check_dir_names_the_file_in_the_way(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match=f"^run dir {tmp_path / 'f'} is a file, not a directory$"):
        make_dir(tmp_path / "f", "run dir")
    with pytest.raises(
        NotADirectoryError,
        match=f"^tier path {tmp_path / 'f' / 'a' / 'b'} cannot be created: "
        f"{tmp_path / 'f'} is a file, not a directory$",
    ):
        check_dir(tmp_path / "f" / "a" / "b", "tier path")
    assert make_dir(tmp_path / "new" / "deeper", "run dir").is_dir()
    assert check_dir(tmp_path / "later", "x") == tmp_path / "later" and not (tmp_path / "later").exists()


@pytest.mark.slow
def test_run_dir_that_is_a_file_is_one_line(tmp_path):
    """Before its fix: "[Errno 17] File exists: PATH"."""
    (tmp_path / "f").write_text("keep me")
    proc = cli("train", "--config", "smoke", "--run-dir", str(tmp_path / "f"))
    assert proc.returncode == 1
    assert one_line(proc.stderr) == f"dlrm-jax: error: run dir {tmp_path / 'f'} is a file, not a directory"
    assert (tmp_path / "f").read_text() == "keep me"


def test_run_dir_opened_directly_and_tier_paths_name_the_file(tiny, tmp_path):
    from dlrm_jax.embedding.tiers.store import TierStore
    from dlrm_jax.train.rundir import RunDir
    from dlrm_jax.train.wiring import tier_root

    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="run dir .* is a file, not a directory"):
        RunDir.open(tmp_path / "f", tiny())
    cfg = tiny(f"embedding.tier.path={tmp_path / 'f'}", "embedding.storage=tiered")
    with pytest.raises(NotADirectoryError, match=f"^embedding.tier.path {tmp_path / 'f'} is a file, not a directory"):
        tier_root(cfg, None)
    with pytest.raises(NotADirectoryError, match=f"tier path {tmp_path / 'f' / 'tier'} cannot be created: "):
        tier_root(tiny("embedding.storage=tiered"), tmp_path / "f")
    with pytest.raises(NotADirectoryError, match="^tier path .* is a file, not a directory"):
        TierStore.create(tmp_path / "f", {"t": (4, {"values": ((2,), "float32")})}, lambda *a: None)


def test_preprocess_output_under_a_file(tmp_path):
    from dlrm_jax.data.preprocessing.criteo_preprocess import preprocess_criteo
    from dlrm_jax.data.sources.criteo import write_criteo_tsv
    from dlrm_jax.data.sources.synthetic import SyntheticGenerator

    (tmp_path / "f").write_text("x")
    gen = SyntheticGenerator(
        seed=1, num_dense=13, table_rows=(20,) * 26, bag_sizes=(1,) * 26, zipf_exponent=1.1, positive_rate=0.3
    )
    write_criteo_tsv(tmp_path / "day.tsv", gen.raw(0, 0, 0, 50))
    with pytest.raises(
        NotADirectoryError, match=f"output {tmp_path / 'f' / 'out'} cannot be created: {tmp_path / 'f'} is a file"
    ):
        preprocess_criteo(
            [str(tmp_path / "day.tsv")], str(tmp_path / "f" / "out"), max_ind_range=10, workers=1, progress=False
        )


def test_a_validation_file_that_is_also_an_input_is_refused(tmp_path):
    from dlrm_jax.data.preprocessing.criteo_preprocess import preprocess_criteo
    from dlrm_jax.data.sources.criteo import write_criteo_tsv
    from dlrm_jax.data.sources.synthetic import SyntheticGenerator

    gen = SyntheticGenerator(
        seed=1, num_dense=13, table_rows=(20,) * 26, bag_sizes=(1,) * 26, zipf_exponent=1.1, positive_rate=0.3
    )
    write_criteo_tsv(tmp_path / "day.tsv", gen.raw(0, 0, 0, 50))
    (tmp_path / "alias.tsv").symlink_to(tmp_path / "day.tsv")  # the same file under another name
    with pytest.raises(ValueError, match=f"--val-input {tmp_path / 'alias.tsv'}: also an --input"):
        preprocess_criteo(
            [str(tmp_path / "day.tsv")],
            str(tmp_path / "out"),
            val_inputs=[str(tmp_path / "alias.tsv")],
            max_ind_range=10,
            workers=1,
            progress=False,
        )
    assert not (tmp_path / "out").exists()
    # Before: the same file twice in --input trained every row twice without a word.
    with pytest.raises(ValueError, match=f"--input {tmp_path / 'alias.tsv'}: given twice .{tmp_path / 'day.tsv'} is"):
        preprocess_criteo(
            [str(tmp_path / "day.tsv"), str(tmp_path / "alias.tsv")],
            str(tmp_path / "out"),
            max_ind_range=10,
            workers=1,
            progress=False,
        )
    assert not (tmp_path / "out").exists()


def small_tsv(path, lines=200):
    from dlrm_jax.data.sources.criteo import write_criteo_tsv
    from dlrm_jax.data.sources.synthetic import SyntheticGenerator

    gen = SyntheticGenerator(
        seed=1, num_dense=13, table_rows=(20,) * 26, bag_sizes=(1,) * 26, zipf_exponent=1.1, positive_rate=0.3
    )
    write_criteo_tsv(path, gen.raw(0, 0, 0, lines))
    return path


@pytest.mark.parametrize("dataset", ["criteo", "tabular"])
def test_a_missing_input_is_named_as_given(tmp_path, monkeypatch, capsys, dataset):
    """Before: `--input train.txt --output data/kaggle` said "No such file or directory: <abs>/data"."""
    from dlrm_jax.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["preprocess", dataset, *(["--schema", "avazu"] if dataset == "tabular" else []), "--no-progress"]
    assert main([*args, "--input", "train.txt", "--output", "data/kaggle"]) == 1
    err = one_line(capsys.readouterr().err)
    assert err == f"dlrm-jax: error: --input train.txt: no such file (looked for {tmp_path}/train.txt)"
    (tmp_path / "day.tsv").mkdir()
    assert main([*args, "--input", str(tmp_path / "day.tsv"), "--output", "o"]) == 1
    assert one_line(capsys.readouterr().err).endswith(f"--input {tmp_path}/day.tsv: a folder, not a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day.tsv"]


def test_preprocess_into_a_dataset_needs_overwrite(tmp_path):
    """Before: a second preprocess replaced the dataset with rc 0, and runs trained on the old
    one resumed on other rows."""
    from dlrm_jax.data.preprocessing.criteo_preprocess import preprocess_criteo

    day = small_tsv(tmp_path / "day.tsv")
    out = tmp_path / "ds"
    preprocess_criteo([str(day)], str(out), max_ind_range=10, workers=1, progress=False)
    meta = (out / "meta.json").read_text()
    proc = cli("preprocess", "criteo", "--input", str(day), "--output", str(out), "--max-ind-range", "20")
    assert proc.returncode == 1 and one_line(proc.stderr) == (
        f"dlrm-jax: error: --output {out}: holds a preprocessed dataset already (runs trained on it would resume "
        f"on other rows if it were replaced); choose a new folder, or pass --overwrite to replace it"
    )
    assert (out / "meta.json").read_text() == meta
    preprocess_criteo([str(day)], str(out), max_ind_range=20, workers=1, progress=False, overwrite=True)
    assert (out / "meta.json").read_text() != meta
    (tmp_path / "empty").mkdir()  # an empty folder is as good as a new one
    preprocess_criteo([str(day)], str(tmp_path / "empty"), max_ind_range=10, workers=1, progress=False)


def test_overwrite_replaces_a_dataset_folder_only_when_it_holds_nothing_else(tmp_path):
    """Before: --overwrite replaced the whole folder, deleting what else it held: the input
    lines kept beside the dataset and a README were gone."""
    from dlrm_jax.data.preprocessing.criteo_preprocess import preprocess_criteo

    out = tmp_path / "ds"
    preprocess_criteo([str(small_tsv(tmp_path / "day.tsv"))], str(out), max_ind_range=10, workers=1, progress=False)
    meta = (out / "meta.json").read_text()
    day = small_tsv(out / "raw.tsv")
    (out / "README").write_text("notes\n")
    proc = cli("preprocess", "criteo", "--input", str(day), "--output", str(out), "--overwrite")
    assert proc.returncode == 1 and one_line(proc.stderr) == (
        f"dlrm-jax: error: --output {out}: holds a preprocessed dataset and files that are not its own "
        f"(README, raw.tsv); not replacing it: move them out, or choose a new folder"
    )
    assert sorted(p.name for p in out.iterdir()) == ["README", "meta.json", "raw.tsv", "train", "val", "vocab"]
    assert (out / "meta.json").read_text() == meta and (out / "README").read_text() == "notes\n"


# ---------------------------------------------------------------- truncated .gz inputs


def truncated_gz(path, text: bytes):
    data = gzip.compress(text)
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.slow
def test_truncated_gz_tabular_input_is_one_line(tmp_path):
    """Before its fix: a 40-line traceback ending in EOFError (criteo's preprocess already said it)."""
    rows = "".join(f"{i % 7},{i % 3},{i % 2}\n" for i in range(20000))
    gz = truncated_gz(tmp_path / "t.csv.gz", ("a,b,y\n" + rows).encode())
    (tmp_path / "s.yaml").write_text("label: y\ncategorical: [a, b]\n")
    proc = cli(
        "preprocess",
        "tabular",
        "--schema",
        str(tmp_path / "s.yaml"),
        "--input",
        str(gz),
        "--output",
        str(tmp_path / "out"),
        "--no-progress",
    )
    assert proc.returncode == 1
    assert one_line(proc.stderr) == (
        f"dlrm-jax: error: {gz}: truncated or damaged gzip file (Compressed file "
        f"ended before the end-of-stream marker was reached)"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["truncated", "bad crc"])
def test_every_criteo_gz_reader_names_the_file(tmp_path, damage):
    from dlrm_jax.data.preprocessing.criteo_preprocess import preprocess_criteo
    from dlrm_jax.data.preprocessing.preprocess import SkipLog
    from dlrm_jax.data.sources.criteo import CriteoFormatError, iter_chunks, write_criteo_tsv
    from dlrm_jax.data.sources.synthetic import SyntheticGenerator

    gen = SyntheticGenerator(
        seed=1, num_dense=13, table_rows=(20,) * 26, bag_sizes=(1,) * 26, zipf_exponent=1.1, positive_rate=0.3
    )
    write_criteo_tsv(tmp_path / "day.tsv", gen.raw(0, 0, 0, 2000))
    gz = tmp_path / "day.gz"
    if damage == "truncated":
        truncated_gz(gz, (tmp_path / "day.tsv").read_bytes())
    else:
        data = bytearray(gzip.compress((tmp_path / "day.tsv").read_bytes()))
        data[-8] ^= 0xFF  # the CRC32 of the trailer
        gz.write_bytes(bytes(data))
    with pytest.raises(CriteoFormatError, match=f"^{gz}: truncated or damaged gzip file"):
        list(iter_chunks([str(gz)], 100, SkipLog(False, CriteoFormatError)))
    with pytest.raises(CriteoFormatError, match=f"^{gz}: truncated or damaged gzip file"):
        preprocess_criteo([str(gz)], str(tmp_path / "out"), max_ind_range=10, workers=1, progress=False)


# ---------------------------------------------------------------- flags

STRATS = "auto, replicated, table, row, column, host_row, host_column"


@pytest.mark.parametrize(
    "argv,flag,says",
    [
        (
            ["preprocess", "criteo", "--input", "x", "--output", "y", "--shard-mb", "0"],
            "--shard-mb",
            "expected a number > 0.001",
        ),
        (
            ["preprocess", "criteo", "--input", "x", "--output", "y", "--shard-mb", "-1"],
            "--shard-mb",
            "expected a number > 0.001",
        ),
        (["bench", "collectives", "--sizes-kib", "abc"], "--sizes-kib", "expected comma-separated integers, got 'abc'"),
        (["bench", "collectives", "--sizes-kib", "16,0"], "--sizes-kib", "expected values >= 1"),
        (["bench", "tiers", "--fractions", "0.5,x"], "--fractions", "expected comma-separated numbers"),
        (["bench", "hot", "--zipf", ","], "--zipf", "expected comma-separated numbers"),
        # Before: "preprocess_criteo: needs 0 <= val_fraction < 1", the Python function's name.
        (
            ["preprocess", "criteo", "--input", "x", "--output", "y", "--val-fraction", "1"],
            "--val-fraction",
            "expected a number < 1, got 1",
        ),
        (["profile", "--steps", "0"], "--steps", "expected an integer >= 1, got 0"),
        (["profile", "--warmup", "-1"], "--warmup", "expected an integer >= 0, got -1"),
        (["bench", "train", "--repeats", "2", "--steps", "x"], "--steps", "expected an integer, got 'x'"),
        # Before: '' measured nothing and exited 0; 'diagonal' was "'diagonal' is not a valid Strategy".
        (
            ["bench", "exchange", "--strategies", ""],
            "--strategies",
            f"expected comma-separated values of {STRATS}; got ''",
        ),
        (
            ["bench", "exchange", "--strategies", "row,diagonal"],
            "--strategies",
            f"expected comma-separated values of {STRATS}; got 'diagonal' in 'row,diagonal'",
        ),
        # Before: a case twice was measured twice (bench tiers built both in one tier folder),
        # and --zipf -1 was refused as a config key after the table's header.
        (["bench", "exchange", "--strategies", "row,row"], "--strategies", "expected distinct values, got 'row,row'"),
        (["bench", "tiers", "--fractions", "0.5,0.5"], "--fractions", "expected distinct values, got '0.5,0.5'"),
        (["bench", "hot", "--zipf", "-1"], "--zipf", "expected values >= 0, got '-1'"),
        (["bench", "tiers", "--zipf", "-1"], "--zipf", "expected a number >= 0, got -1"),
        (
            ["bench", "embedding", "--strategies", ","],
            "--strategies",
            f"expected comma-separated values of {STRATS}; got ','",
        ),
        (
            ["bench", "hot", "--row-layouts", "blocks"],
            "--row-layouts",
            "expected comma-separated values of auto, block, cyclic; got 'blocks'",
        ),
        (
            ["bench", "mlp-parallel", "--modes", ""],
            "--modes",
            "expected comma-separated values of data, tensor, pipeline; got ''",
        ),
        (
            ["bench", "tiers", "--policies", "fifo"],
            "--policies",
            "expected comma-separated values of lru, lfu, tinylfu; got 'fifo'",
        ),
        # Before: 30 'high <= 0' thread tracebacks and a -5 MiB probe in the JSON; a "large" case of
        # -1 GB; "range() arg 3 must not be zero" or the input blamed for "no training rows";
        # "max() arg is an empty sequence", and smoke,smoke collapsed to one result.
        (["bench", "tiers", "--disk-probe-mb", "-5"], "--disk-probe-mb", "expected an integer >= 0, got -5"),
        (["bench", "tiers", "--large-gb", "-1"], "--large-gb", "expected a number >= 0, got -1"),
        (["bench", "tiers", "--large-fraction", "0"], "--large-fraction", "expected a number > 0, got 0"),
        (
            ["preprocess", "criteo", "--input", "x", "--output", "y", "--block-mb", "0"],
            "--block-mb",
            "expected a number > 0",
        ),
        # Before: an OverflowError traceback (inf), "cannot convert float NaN to integer" naming no
        # flag, or a dataset whose window recorded "seconds": null that train crashed on.
        *(
            (
                ["preprocess", "criteo", "--input", "x", "--output", "y", flag, value],
                flag,
                f"expected a finite number, got {value}",
            )
            for flag, value in (("--block-mb", "inf"), ("--shard-mb", "nan"))
        ),
        (
            [
                "preprocess",
                "tabular",
                "--schema",
                "s",
                "--input",
                "x",
                "--output",
                "y",
                "--no-shuffle",
                "--window-seconds",
                "nan",
            ],
            "--window-seconds",
            "expected a finite number, got nan",
        ),
        (["bench", "hot", "--zipf", "1.1,inf"], "--zipf", "expected comma-separated finite numbers, got '1.1,inf'"),
        (["bench", "train", "--configs", ","], "--configs", "expected comma-separated config names or files, got ','"),
        (["bench", "mlp-parallel", "--configs", "smoke,smoke"], "--configs", "smoke is given twice"),
        # Before: the checkpoint at half of the steps was step 0, "no checkpoint at step 0" after training.
        (["bench", "serving", "--steps", "1"], "--steps", "expected an integer >= 2, got 1"),
    ],
)
def test_malformed_flags_are_named_by_argparse(capsys, argv, flag, says):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert f"argument {flag}: {says}" in capsys.readouterr().err


# Before: --rows -5 trained 72-row tables, a window smaller than a batch was "need at least one
# array to concatenate", one window reported a mean AUC of nan, and a missing --criteo file a
# bare "[Errno 2]".
@pytest.mark.parametrize(
    "argv,says",
    [
        (["--rows", "1.5"], "--rows 1.5: a whole number of rows (>= 1), or a fraction (< 1)"),
        (["--window-samples", "100"], "--window-samples 100: a window needs at least one batch (train.batch_size="),
        (["--windows", "1"], "--windows 1: at least 2 (each window is evaluated by the model trained on the ones"),
        (["--criteo", "nope.tsv"], "--criteo nope.tsv: no such file"),
        # (the maps' rows were --rows whatever the key said: refused, naming the flag that sets them)
        (
            ["--set", "embedding.dynamic.rows=0.5"],
            "embedding.dynamic.rows: bench stream gives every case's tables --rows",
        ),
        # (its cases are row-wise DLRMs on the devices: these were trained as one without a word)
        (
            ["--config", "wide_deep"],
            "model.kind=wide_deep: bench stream trains",
        ),
        (["--set", "embedding.storage=tiered"], "embedding.storage=tiered: bench stream trains each case as"),
        (["--set", "embedding.hot.rows=64"], "embedding.hot.rows=64: bench stream trains each case as"),
        (
            ["--config", "smoke", "--set", "embedding.sharding=table"],
            "embedding.sharding=table: bench stream trains each case as",
        ),
        # (it trained, then reported a mean AUC of nan over no windows and exited 0)
        (
            ["--criteo", "one.tsv", "--window-samples", "1024", "--windows", "4"],
            "one.tsv: holds 1 window of 1,024 lines",
        ),
    ],
)
def test_a_stream_that_cannot_be_measured_is_one_line_before_any_work(tmp_path, monkeypatch, capsys, argv, says):
    from dlrm_jax.cli import main

    monkeypatch.chdir(tmp_path)
    _criteo_lines(tmp_path / "one.tsv", 1500)
    assert main(["bench", "stream", "--set", "train.batch_size=256", *argv]) == 2  # a usage error, as a bad --set
    assert says in one_line(capsys.readouterr().err)


def _criteo_lines(path, n: int, bad: int = 0) -> None:
    from dlrm_jax.data.sources.criteo import write_criteo_tsv
    from dlrm_jax.data.sources.synthetic import SyntheticGenerator

    gen = SyntheticGenerator(
        seed=1, num_dense=13, table_rows=(50,) * 26, bag_sizes=(1,) * 26, zipf_exponent=1.1, positive_rate=0.3
    )
    write_criteo_tsv(path, gen.raw(0, 0, 0, n))
    if bad:
        with open(path, "a") as f:
            f.write("1\tnot a line\n" * bad)


def test_bench_streams_criteo_windows_skip_bad_lines_as_the_key_says(tmp_path):
    """``--set data.skip_bad_lines=true`` was dropped: the first bad line stopped the bench."""
    from dlrm_jax.data.preprocessing.preprocess import SkipLog
    from dlrm_jax.data.sources.criteo import CriteoFormatError, criteo_windows

    _criteo_lines(tmp_path / "bad.tsv", 1024, bad=3)
    with pytest.raises(CriteoFormatError, match="bad.tsv:1025: expected 40 tab-separated fields"):
        criteo_windows([str(tmp_path / "bad.tsv")], 512)
    log = SkipLog(True, CriteoFormatError)
    assert len(criteo_windows([str(tmp_path / "bad.tsv")], 512, 0, log)) == 2 and log.by_reason.total() == 3


def test_bench_stream_rows_and_dynamic_rows_refuse_nonsense(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "stream", "--rows", "-5"])
    assert "argument --rows: expected a number > 0, got -5" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"embedding.dynamic.rows=1.5: a whole number of rows \(>= 1\), or a"):
        load_config("stream", ["embedding.dynamic.rows=1.5"])


def test_list_flags_parse_to_lists():
    args = build_parser().parse_args(["bench", "collectives", "--sizes-kib", "16, 64,"])
    assert args.sizes_kib == [16, 64]
    assert build_parser().parse_args(["bench", "tiers"]).fractions == [1.0, 0.5, 0.2, 0.1, 0.05]
    assert build_parser().parse_args(["bench", "exchange", "--strategies", "row, auto"]).strategies == ["row", "auto"]


def test_bench_name_lists_allow_what_the_benches_run():
    from dlrm_jax.bench import exchange, hot, mlp_parallel
    from dlrm_jax.cli import args as cli_args

    assert cli_args.STRATEGIES == exchange.STRATEGIES
    assert (cli_args.HOT_LAYOUTS, cli_args.MLP_MODES) == (hot.LAYOUTS, mlp_parallel.MODES)
    args = build_parser().parse_args(["bench", "hot"])
    assert (args.layouts, args.row_layouts) == (list(hot.LAYOUTS), list(hot.ROW_LAYOUTS))


def test_profile_refuses_zero_steps_and_json_never_holds_nan(tiny, tmp_path):
    from dlrm_jax.bench.common import write_report
    from dlrm_jax.bench.profile import profile

    with pytest.raises(ValueError, match="steps >= 1"):
        profile(tiny(), tmp_path, steps=0)
    text = json_text({"a": math.nan, "b": [1.0, -math.inf], "c": {"d": math.inf}, "e": 2}, indent=1)
    assert json.loads(text) == {"a": None, "b": [1.0, None], "c": {"d": None}, "e": 2}
    write_report({"ms": math.nan}, str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text(), parse_constant=lambda c: pytest.fail(c)) == {"ms": None}


# ---------------------------------------------------------------- signals before the loop


@pytest.mark.slow
def test_sigterm_while_restoring_or_compiling_stops_cleanly_once_it_is_done(tmp_path):
    """Before its fixes: SIGTERM before the training loop ended the process by the default
    action without a word; then, raised into jaxlib's interruptible wait for a compile, it
    abandoned the compile and the exit segfaulted (rc -11) on a loaded machine."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dlrm_jax",
            "train",
            "--config",
            "smoke",
            "--set",
            "train.progress_bar=false",
            "--set",
            "mesh.devices=8",
            "--run-dir",
            str(tmp_path / "r"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(drop=()),
    )
    deadline = time.time() + 120
    for line in proc.stdout:  # the plan is printed just before the state is restored and the step compiles
        assert time.time() < deadline
        if line.startswith("plan: "):
            break
    proc.send_signal(signal.SIGTERM)  # restoring, then compiling (the compile alone: the test below)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    notice, end = err.strip().splitlines()
    assert end == "dlrm-jax: stopped by SIGTERM", err  # not "stopped by SIGTERM after step N"
    # "... once restoring the state and compiling the train step is done", or, a moment
    # earlier, "... once the run's start is done"
    assert notice.startswith("dlrm-jax: SIGTERM: stopping once ") and " is done " in notice, err


SWALLOWED_STOP = """
import os, signal, sys
from dlrm_jax import stopping
from dlrm_jax.train.stop_signals import StopSignals

stopping.stop_on_signals()

class Collected:
    def __del__(self):  # like JAX's gc callback: Python swallows what is raised in here
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(1000))  # the handler runs between these bytecodes

Collected()
print("went on", flush=True)
try:
    with StopSignals():
        print("trained", flush=True)
except stopping.Stopped as e:
    print("stopped", e.signum, flush=True)
"""


@pytest.mark.slow
def test_a_stop_swallowed_in_a_collection_callback_stops_the_loop_without_a_traceback():
    """CI saw SIGTERM during compiling land in JAX's gc callback: Python printed "Exception
    ignored in ... _xla_gc_callback", dropped the stop, and the run trained on to exit 0."""
    proc = subprocess.run(
        [sys.executable, "-c", SWALLOWED_STOP], capture_output=True, text=True, timeout=120, env=child_env(drop=())
    )
    assert proc.stdout.split("\n")[:2] == ["went on", f"stopped {int(signal.SIGTERM)}"], proc
    assert "Exception ignored" not in proc.stderr, proc.stderr


STOP_DURING_AN_EVALUATION = """
import os, signal, time
from dlrm_jax import stopping

stopping.stop_on_signals()
with stopping.deferred("the evaluation", keeps_nothing=True):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    print("evaluated", flush=True)
"""


def test_a_stop_during_eval_ends_it_at_once():
    """Before: eval kept the first SIGTERM until its evaluation ended (2 minutes and more),
    then exited 143 without a result: the wait bought nothing."""
    proc = subprocess.run(
        [sys.executable, "-c", STOP_DURING_AN_EVALUATION], capture_output=True, text=True, timeout=20, env=child_env()
    )
    assert proc.returncode == 128 + signal.SIGTERM and "evaluated" not in proc.stdout, proc
    assert proc.stderr.strip() == "dlrm-jax: stopped at once by SIGTERM: nothing to save", proc.stderr


STOP_DURING_COMPILE = """
import os, signal, sys, threading
import jax, jax.numpy as jnp
from dlrm_jax import stopping

stopping.stop_on_signals()

def slow_to_compile(x):  # about 1.2 s to compile with the tests' flags (60 steps: 0.14 s, under the timer)
    for i in range(600):
        x = jnp.sin(x) @ x + i
    return x

lowered = jax.jit(slow_to_compile).lower(jnp.ones((64, 64)))
threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
try:
    with stopping.deferred("compiling"):
        lowered.compile()
        print("compiled", flush=True)
except stopping.Stopped as e:
    print("stopped", flush=True)
    sys.exit(128 + e.signum)
"""


@pytest.mark.slow
def test_a_stop_during_a_compile_waits_for_it_and_never_crashes_the_exit():
    """jaxlib compiles on a thread pool and a signal interrupts the wait: the stop's exception
    abandoned the compile, and the exit then tore the runtime down under it (segfault, rc -11,
    in 5 of 5 SIGTERMs during a train run's start on a loaded machine). Deferred, the stop
    says at once that it waits, and comes once the compile has returned."""
    proc = subprocess.run(
        [sys.executable, "-c", STOP_DURING_COMPILE], capture_output=True, text=True, timeout=300, env=child_env()
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc
    assert proc.stdout.split() == ["compiled", "stopped"], proc  # not abandoned
    assert "dlrm-jax: SIGTERM: stopping once compiling is done" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- per-host plans


def test_per_host_plan_header_names_the_global_batch_and_the_hosts_share(tiny):
    from dlrm_jax.train.wiring import config_plan_report, plan_from_config

    cfg = tiny("train.batch_size=128", "mesh.devices=8", "mesh.hosts=2", "embedding.sync=per_host")
    header = config_plan_report(cfg, plan_from_config(cfg, 8, hosts=2)).splitlines()[0]
    assert header.endswith("global batch 128 (64 per host: the share of one host's 4 devices)"), header
    glob = tiny("train.batch_size=128", "mesh.devices=8")
    assert config_plan_report(glob, plan_from_config(glob, 8, hosts=1)).splitlines()[0].endswith("global batch 128")


# ---------------------------------------------------------------- the data a run reads
@pytest.mark.slow
@pytest.mark.parametrize(
    "settings,says",
    [
        (["data.path=DIR"], "data.source=synthetic generates its data and reads no path"),
        (["data.source=binary", "data.path=DIR/none"], "no such folder; data.source=binary reads a folder made by"),
        (["data.source=binary", "data.path=DIR/file.tsv"], "a file, and data.source=binary reads a folder"),
        (["data.source=binary", "data.path=DIR"], "no meta.json in this folder"),
        (["data.source=criteo", "data.path=DIR"], "a folder, and data.source=criteo reads Criteo text files"),
        (  # before: the second copy's held-out lines were trained on in the first
            ["data.source=criteo", "data.path=DIR/file.tsv,DIR/./file.tsv"],
            "data.path: the file DIR/./file.tsv: given twice (DIR/file.tsv is the same file): its rows would be read twice",
        ),
        (  # before: refused after "run dir: ..." was printed, naming no key
            ["data.source=criteo", "data.path=DIR/file.tsv", "data.cardinalities=[10,10]"],
            "data.source=criteo reads Criteo's 13 dense and 26 one-hot features; this config has data.num_dense=13, "
            "2 tables (data.cardinalities)",
        ),
    ],
)
def test_a_data_path_the_source_does_not_read_is_one_line_and_leaves_no_run_dir(tmp_path, settings, says):
    """A synthetic run never ignores a data.path; a path of the wrong kind is named with what
    the source expects, before any run dir is made."""
    (tmp_path / "file.tsv").write_text("1\t2\n")
    args = [a for s in settings for a in ("--set", s.replace("DIR", str(tmp_path)))]
    proc = cli("train", *args, "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 2 and says.replace("DIR", str(tmp_path)) in one_line(proc.stderr)
    assert not (tmp_path / "run").exists()


def test_explicit_features_that_disagree_with_a_binary_dataset_are_refused(tmp_path):
    """Before: the dataset's values replaced them without a word (config.yaml showed its)."""
    from dlrm_jax.config import ConfigError, load_config
    from dlrm_jax.data.preprocessing.criteo_preprocess import preprocess_criteo
    from dlrm_jax.data.sources import resolve_data_config

    def cfg(*overrides):
        return resolve_data_config(load_config(None, ["data.source=binary", f"data.path={ds}", *overrides]))

    ds = tmp_path / "ds"
    preprocess_criteo([str(small_tsv(tmp_path / "day.tsv"))], str(ds), max_ind_range=10, workers=1, progress=False)
    with pytest.raises(ConfigError) as e:
        cfg("data.num_dense=5")
    assert str(e.value) == (
        f"data.num_dense=5 disagrees with the dataset data.path={ds}, which has 13 dense features; binary data "
        f"takes the dataset's: remove the key or set data.num_dense=13"
    )
    with pytest.raises(ConfigError) as e:
        cfg(f"data.bag_sizes={[1] * 25 + [3]}")
    assert str(e.value) == (
        f"data.bag_sizes={[1] * 25 + [3]} disagrees with the dataset data.path={ds}, whose 26 features have bags of [1]; "
        f"binary data takes the dataset's: remove the key or set data.bag_sizes=[1]"
    )
    for agreeing in ([], ["data.num_dense=13", f"data.bag_sizes={[1] * 26}"]):  # defaults take the dataset's
        resolved = cfg(*agreeing)
        assert (resolved.data.num_dense, resolved.data.bag_sizes, resolved.num_features) == (13, (1,), 26)


@pytest.mark.slow
def test_preprocess_workers_end_with_their_parent_even_when_it_is_sigkilled(tmp_path):
    """Before its fix: SIGKILL of `preprocess` left its workers alive indefinitely (100-157 MB each)."""

    from dlrm_jax.data.sources.criteo import write_criteo_tsv
    from dlrm_jax.data.sources.synthetic import SyntheticGenerator

    gen = SyntheticGenerator(
        seed=1, num_dense=13, table_rows=(1000,) * 26, bag_sizes=(1,) * 26, zipf_exponent=1.1, positive_rate=0.3
    )
    for k in range(4):
        write_criteo_tsv(tmp_path / f"day{k}.tsv", gen.raw(0, k, 0, 40_000))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dlrm_jax",
            "preprocess",
            "criteo",
            "--input",
            *[str(tmp_path / f"day{k}.tsv") for k in range(4)],
            "--output",
            str(tmp_path / "out"),
            "--workers",
            "2",
            "--block-mb",
            "1",
            "--no-progress",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=child_env(drop=()),
    )

    _kill_once_two_workers_run_then_wait_for_them(proc)


_DRIVER_KILLED_BEFORE_ITS_WORKERS_ASK = """
import sys, time
from dlrm_jax.data.preprocessing import prep_pool

real = prep_pool.die_with_parent
def late(*args):  # the workers ask for their signal a second after they start
    time.sleep(1.0)
    real(*args)
prep_pool.die_with_parent = late
with prep_pool.worker_pool(2) as pool:
    print("started", flush=True)
    list(pool(time.sleep, [60, 60]))
"""


def test_preprocess_workers_end_with_their_parent_even_when_it_ended_before_they_asked(tmp_path):
    """The kernel's parent-death signal is sent only for a parent that ends after the child
    asks for it: a driver killed between its workers' start and their request left them
    alive for good (the race that made the test above fail one run in many). Here the
    workers ask a second late, after the driver is killed."""

    proc = subprocess.Popen(
        [sys.executable, "-c", _DRIVER_KILLED_BEFORE_ITS_WORKERS_ASK],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=child_env(drop=()),
    )
    assert proc.stdout.readline().strip() == b"started"
    _kill_once_two_workers_run_then_wait_for_them(proc)


def _kill_once_two_workers_run_then_wait_for_them(proc) -> None:
    """SIGKILL ``proc`` as soon as it has two children; each must then end within 10 s."""
    deadline = time.time() + 60
    while len(workers := _children(proc.pid)) < 2:
        assert proc.poll() is None and time.time() < deadline, "no workers started"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.time() + 10
    while alive := [w for w in workers if _running(w)]:
        assert time.time() < deadline, f"workers {alive} outlived their driver"
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    import os

    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv,says",
    [
        (["train", "--config", "criteo"], "shipped configs: criteo_kaggle, default, mlperf_dlrm_dcnv2"),
        (["train", "--set", "train.keep_best=true"], "train.keep_best: expected one of '', auc, logloss, got True"),
    ],
)
def test_config_mistakes_list_what_is_allowed(argv, says):
    proc = cli(*argv)
    assert proc.returncode == 2 and says in one_line(proc.stderr)


def test_version_and_plain_help(capsys):
    from dlrm_jax import __version__
    from dlrm_jax.cli import main

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"dlrm-jax {__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out  # no raw reStructuredText


@pytest.mark.slow
def test_a_gpu_asked_of_a_jax_without_cuda_is_one_line_saying_how_to_install():
    import jax

    if jax.default_backend() != "cpu" or "cuda" in {p.platform for p in jax.devices()}:
        pytest.skip("this JAX has a CUDA backend")
    env = child_env(drop=()) | {"JAX_PLATFORMS": "cuda"}
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_jax", "train", "--config", "smoke"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2 and 'pip install -e ".[cuda12]"' in one_line(proc.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--process-id"], ["--process-id", "x", "dlrm-jax"], ["--process-id", "0"]])
def test_a_cluster_launch_without_its_process_id_or_command_is_a_usage_line(argv):
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_jax.parallel.launch", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(drop=()),
    )
    assert proc.returncode == 2 and one_line(proc.stderr).startswith(
        "usage: python -m dlrm_jax.parallel.launch --process-id I"
    )


def test_processes_making_one_run_dir_at_once_all_see_a_folder(tmp_path):
    """Every process of a run makes the same run dir; one that looks while another creates
    it must see a folder, not 'a special file' (a check made of two looks saw neither)."""
    import threading

    from dlrm_jax.files import make_dir

    errors = []

    def make(path):
        try:
            make_dir(path, "run dir")
        except OSError as e:
            errors.append(e)

    for i in range(200):
        threads = [threading.Thread(target=make, args=(tmp_path / f"run{i}" / "x",)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[:3]


# ---------------------------------------------------------------- plan and train refuse alike


@pytest.mark.parametrize(
    "overrides,says",
    [
        (["mesh.model=3"], "mesh.model=3 must divide the 8 devices"),
        (["train.epochs=1"], "train.epochs, train.evals_per_epoch: synthetic data has no train split to count"),
        (["train.batch_size=100"], "train.batch_size=100 must be divisible by the 8 devices of the mesh"),
        # Before: trained with the flat exchange and said nothing (cpu profile: 64 devices a host)
        (
            ["embedding.ids_exchange=two_level"],
            "embedding.ids_exchange=two_level: the 8 devices fit one host of 64 (cluster.devices_per_host), the cpu "
            "profile's; two levels need 2 or more hosts of 2 or more devices; set cluster.devices_per_host to 2 "
            "or 4, or embedding.ids_exchange=auto (two levels where they can go) or flat",
        ),
        (  # before: "set cluster.devices_per_host to a divisor of 2 of at least 2 and at most 1"
            ["embedding.ids_exchange=two_level", "mesh.devices=2"],
            "embedding.ids_exchange=two_level: the 2 devices fit one host of 64 (cluster.devices_per_host); two levels "
            "need 2 or more hosts of 2 or more devices; 2 devices cannot make them: set embedding.ids_exchange=auto "
            "(two levels where they can go) or flat",
        ),
        (
            ["embedding.ids_exchange=two_level", "cluster.devices_per_host=3"],
            "embedding.ids_exchange=two_level: the 8 devices do not split into hosts of 3 (cluster.devices_per_host)",
        ),
    ],
)
def test_plan_refuses_what_train_refuses_and_train_leaves_no_run_dir(tmp_path, capsys, overrides, says):
    """Before: `plan` printed a plan for these, and `train` refused them after making its run dir."""
    from dlrm_jax.cli import main

    sets = [a for o in ["train.steps=1", *overrides] for a in ("--set", o)]
    for command in (["plan"], ["train", "--run-dir", str(tmp_path / "run")]):
        assert main([*command, "--config", "smoke", *sets]) == 2
        assert one_line(capsys.readouterr().err).startswith(f"dlrm-jax: config error: {says}")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "overrides,why",
    [
        (
            ["embedding.sharding=row", "embedding.table_storage=[cat_3=tiered]"],
            "the plan has tiered tables, whose device caches exchange flat",
        ),
        (
            ["embedding.sharding=column", "embedding.bag_exchange=ids"],
            "its column slices' rowwise_adagrad updates gather whole-row statistics flat",
        ),
    ],
)
def test_two_levels_asked_where_no_ids_part_can_take_them_says_why(capsys, overrides, why):
    """Before: 'no part of this plan's exchange sends ids to the tables' owners', under the
    report's own ids exchange (one tiered table turns two levels off for every table)."""
    from dlrm_jax.cli import main

    asked = ["mesh.devices=4", "cluster.devices_per_host=2", "embedding.ids_exchange=two_level", *overrides]
    assert main(["plan", "--config", "smoke", *(a for o in asked for a in ("--set", o))]) == 0
    assert f"embedding.ids_exchange=two_level: nothing goes in two levels: {why}" in capsys.readouterr().out


def test_tiered_tables_in_several_processes_are_a_config_error_before_the_run_dir(tiny):
    """Before: a plain error (exit 1) from building the step, after the run dir was announced
    (and on a tiered run dir, its changed settings logged); `train` checks this before a run
    dir is touched (check_runnable)."""
    from dlrm_jax.train.checks import check_runnable

    cfg = tiny("embedding.table_storage=[cat_2=tiered]")
    check_runnable(cfg, 4, 1, simulated=True)
    with pytest.raises(
        ConfigError,
        match=r"^embedding.storage / embedding.table_storage: tables in the disk tier \(cat_2\) train in one process for now, not 2",
    ):
        check_runnable(cfg, 4, 2, simulated=True)


def test_two_levels_that_no_part_can_take_are_said_in_the_plan(tiny):
    from dlrm_jax.train.checks import check_runnable
    from dlrm_jax.train.planning import plan_for_run, plan_summary, run_plan_report

    two = ("embedding.ids_exchange=two_level", "cluster.devices_per_host=4", "embedding.sharding=column")
    cfg = tiny(*two, "embedding.bag_exchange=pooled")
    check_runnable(cfg, 8, simulated=True)  # the mesh can: 2 hosts of 4
    plan = plan_for_run(cfg, 8, 1, None, True)
    says = "embedding.ids_exchange=two_level: no part of this plan's exchange sends ids to the tables' owners"
    assert run_plan_report(cfg, plan, True).splitlines()[-1].startswith(says)
    assert plan_summary(cfg, plan, True).splitlines()[-1].startswith(f"  {says}")
    # one-hot column slices send ids (bag_exchange=auto), flat for row-wise Adagrad: said so (it said
    # no part sent ids)
    ids = tiny(*two)
    why = "nothing goes in two levels: its column slices' rowwise_adagrad updates gather whole-row statistics flat"
    assert run_plan_report(ids, plan_for_run(ids, 8, 1, None, True), True).splitlines()[-1].endswith(why)
    row = tiny("embedding.ids_exchange=two_level", "cluster.devices_per_host=4", "embedding.sharding=row")
    assert says not in run_plan_report(row, plan_for_run(row, 8, 1, None, True), True)


def test_a_run_dir_made_by_a_refused_train_is_removed(tmp_path, capsys):
    """What only the plan can tell (here a memory budget) is refused after the run dir is made:
    the empty dir goes with the run; a dir that was there before stays."""
    from dlrm_jax.cli import main

    budget = ["--set", "embedding.memory_budget_gb=0.000001", "--set", "mesh.devices=2", "--set", "train.steps=1"]
    (tmp_path / "mine").mkdir()
    for run, kept in ((tmp_path / "new", False), (tmp_path / "mine", True)):
        assert main(["train", "--config", "smoke", *budget, "--run-dir", str(run)]) in (1, 2)
        assert "embedding.memory_budget_gb" in one_line(capsys.readouterr().err)
        assert run.exists() == kept


def test_a_pipe_given_as_input_is_named_as_a_pipe_not_a_folder(tmp_path):
    """``--input <(zcat day.gz)`` is a pipe: both commands read their inputs more than once or
    size them on disk, and said it was a folder."""
    import os

    from dlrm_jax.data.preprocessing.preprocess import check_input_files
    from dlrm_jax.serving.files import check_paths

    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(ValueError, match="pipe: not a regular file"):
        check_paths([tmp_path / "pipe"], tmp_path / "out.txt")
    with pytest.raises(FileNotFoundError, match="pipe: not a regular file"):
        check_input_files([str(tmp_path / "pipe")])


def test_a_benchmarks_output_is_checked_before_it_runs(capsys, tmp_path, monkeypatch):
    """Before: the benchmark ran to its end, then 'Is a directory' (its results lost), or it
    replaced a file that held earlier results."""
    (tmp_path / "old.json").write_text("{}")
    (tmp_path / "f").write_text("")
    (tmp_path / "locked").mkdir()
    writable = os.access  # (a read-only folder, as root sees one: a read-only disk)
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p).name != "locked" and writable(p, mode))
    for output, says in (
        (tmp_path, f"{tmp_path} is a folder; give a file in it"),
        (tmp_path / "old.json", f"{tmp_path / 'old.json'} exists; give a new file (a benchmark's results are not"),
        (tmp_path / "f" / "x.json", f"{tmp_path / 'f' / 'x.json'}: its folder {tmp_path / 'f'} does not exist"),
        (tmp_path / "no" / "x.json", f"{tmp_path / 'no' / 'x.json'}: its folder"),
        (
            tmp_path / "locked" / "x.json",
            f"{tmp_path / 'locked' / 'x.json'}: its folder {tmp_path / 'locked'} cannot be",
        ),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "collectives", "--output", str(output)])
        assert f"argument --output: {says}" in capsys.readouterr().err
    assert (tmp_path / "old.json").read_text() == "{}"


def test_bench_serving_keeps_out_of_a_workdir_that_holds_files(tmp_path):
    """Before: it wrote its sample over the folder's day.tsv, then failed naming --output (a
    flag the user never gave); a dataset there would have been replaced."""
    from dlrm_jax.cli import main

    (tmp_path / "day.tsv").write_text("mine")
    argv = ["bench", "serving", "--config", "smoke", "--workdir", str(tmp_path), "--lines", "2000", "--steps", "4"]
    assert main(argv) == 2
    assert (tmp_path / "day.tsv").read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["day.tsv"]
    assert main(["bench", "serving", "--config", "smoke", "--lines", "100"]) == 2  # fewer lines than a batch


def test_a_stop_during_the_exits_clean_up_ends_it_quietly():
    """Before: a second Ctrl-C 0.3 s after the first, in a launch whose processes had saved and
    were exiting, raised KeyboardInterrupt inside JAX's atexit clean-up (Python's handler was
    back by then): a traceback after the run's last line. Here a clean-up that takes its time
    gets SIGINT; the program ends at once with its status, and says nothing more."""
    script = """
import atexit, os, signal, sys, time
import dlrm_jax.cli as program
program._program = lambda: 130  # a run that stopped and saved
atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(20), print("cleaned up")))
sys.exit(program.run())
"""
    env = {**child_env(), "DLRM_JAX_HUGE_PAGES": "0"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 130 and proc.stderr == "" and proc.stdout == "", proc
    assert time.monotonic() - t0 < 15


def test_a_table_over_the_clusters_memory_names_the_key_that_set_the_budget(tiny):
    """Before: a budget from cluster.device_memory_gb (embedding.memory_budget_gb=0) was
    named as embedding.memory_budget_gb, the key that had not set it."""
    from dlrm_jax.embedding.plan.planner import PlanError
    from dlrm_jax.train.wiring import plan_from_config

    cfg = tiny("cluster.device_memory_gb=0.00001", "embedding.sharding=table")
    with pytest.raises(PlanError, match=r"\(0.9 x cluster.device_memory_gb, as embedding.memory_budget_gb=0\)"):
        plan_from_config(cfg, 2)
    with pytest.raises(PlanError, match=r"\(embedding.memory_budget_gb\)"):
        plan_from_config(tiny("embedding.memory_budget_gb=0.00001", "embedding.sharding=table"), 2)
