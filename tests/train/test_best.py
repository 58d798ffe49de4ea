"""Keep-best and early stop: the best evaluation's checkpoint outlives rotation and eval / export
pick it by name; train.target_auc and train.early_stop_evals end a run cleanly at the right
step, and a re-run of a stopped run does not train further unless its config lets it."""

import json
import math

import pytest

from dlrm_jax.train.checkpoint_reader import saved_steps
from dlrm_jax.train.export import export_run
from dlrm_jax.train.progress import Evaluation, Progress, auc_note
from dlrm_jax.train.saved_run import evaluate_run
from dlrm_jax.train.trainer import train_and_evaluate
from tests.helpers import QUIET, tiny_config

# Two held-out batches a tiny evaluation: its AUC peaks early and wanders (step 4 here).
BASE = ("train.steps=24", "train.eval_every=2", "train.checkpoint_every=4", "mesh.devices=2")


def events(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """An uninterrupted run without early stop: (run dir, summary, every evaluation)."""
    run = tmp_path_factory.mktemp("full") / "run"
    summary = train_and_evaluate(tiny_config(*BASE), run, **QUIET)
    evals = [Evaluation(e["step"], e["auc"], e["logloss"]) for e in events(run) if e["event"] == "eval"]
    return run, summary, evals


def first_best(evals, metric="auc"):
    best = evals[0]
    for e in evals[1:]:
        if e.better_than(best, metric):
            best = e
    return best


def test_the_summary_and_final_event_show_the_best_beside_the_last(full_run):
    run, summary, evals = full_run
    best = first_best(evals)
    assert best.step < 20 and best != evals[-1]  # the run peaked early
    assert summary.best == best and (summary.step, summary.auc, summary.logloss) == (
        24,
        evals[-1].auc,
        evals[-1].logloss,
    )
    assert summary.best_line() == f"best step={best.step} auc={best.auc:.6f} logloss={best.logloss:.6f}"
    final = events(run)[-1]
    assert (final["best_step"], final["best_auc"], final["best_logloss"]) == (best.step, best.auc, best.logloss)
    assert "stop_reason" not in final and summary.stop_reason == ""
    # Without train.keep_best the best step's checkpoint was rotated out: --step best says so.
    with pytest.raises(FileNotFoundError, match=f"step {best.step}.*no checkpoint left.*keep_best"):
        evaluate_run(run, step="best", **QUIET)


@pytest.mark.slow
def test_keep_best_outlives_rotation_and_eval_and_export_pick_it(tiny, tmp_path, full_run):
    _, _, evals = full_run
    best = first_best(evals)
    run = tmp_path / "run"
    summary = train_and_evaluate(tiny(*BASE, "train.keep_checkpoints=1", "train.keep_best=auc"), run, **QUIET)
    assert summary.best == best
    assert saved_steps(run / "checkpoints") == [best.step, 24]  # the newest one, and the best
    scored = evaluate_run(run, step="best", **QUIET)
    assert scored.step == best.step and scored.auc == pytest.approx(best.auc, rel=1e-9)
    assert evaluate_run(run, **QUIET).step == 24  # default: the newest
    assert export_run(run, tmp_path / "tables", step="best", **QUIET) == best.step
    assert (tmp_path / "tables" / "cat_0" / "values").is_dir()
    # an export inside the run's checkpoints was taken for a damaged checkpoint and moved aside
    with pytest.raises(ValueError, match="^dest .*checkpoints/99: inside .*checkpoints, which the run manages"):
        export_run(run, run / "checkpoints" / "99", **QUIET)
    assert saved_steps(run / "checkpoints") == [best.step, 24]
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 8; saved steps \[\d+, 24\]"):
        evaluate_run(run, step=8, **QUIET)
    # Turned off on resume, the best's checkpoint goes with the rotation, and the run says so
    # (before: nothing was said, or that the best 'is kept as the one to beat').
    logs = []
    train_and_evaluate(tiny(*BASE, "train.steps=26", "train.keep_checkpoints=1"), run, log=logs.append)
    assert f"train.keep_best is off: step {best.step}'s checkpoint, the best evaluation so far, is no longer kept" in (
        "\n".join(logs)
    )
    assert saved_steps(run / "checkpoints") == [26]


def test_keep_best_by_logloss_keeps_the_lowest(tiny, tmp_path, full_run):
    _, _, evals = full_run
    run = tmp_path / "run"
    cfg = tiny(*BASE, "train.steps=12", "train.keep_checkpoints=1", "train.keep_best=logloss")
    summary = train_and_evaluate(cfg, run, **QUIET)
    best = first_best(evals[:6], "logloss")
    assert summary.best == best and best.step in saved_steps(run / "checkpoints")


def expected_stop(evals, n):
    best, since = evals[0], 0
    for e in evals[1:]:
        best, since = (e, 0) if e.better_than(best, "auc") else (best, since + 1)
        if since >= n:
            return e.step
    return None


def test_early_stop_evals_stops_at_the_right_step_and_stays_stopped(tiny, tmp_path, full_run):
    _, full, evals = full_run
    stop = expected_stop(evals, 3)
    assert stop is not None and stop < 24
    run, logs = tmp_path / "run", []
    cfg = tiny(*BASE, "train.early_stop_evals=3")
    summary = train_and_evaluate(cfg, run, log=logs.append)
    assert summary.step == stop and summary.best == first_best([e for e in evals if e.step <= stop])
    assert "3 evaluations without a better auc" in summary.stop_reason
    assert [line for line in logs if line.startswith("early stop")] == [
        f"early stop at step {stop}: {summary.stop_reason}"
    ]
    assert saved_steps(run / "checkpoints")[-1] == stop  # the final checkpoint
    assert events(run)[-1]["stop_reason"] == summary.stop_reason
    # The same command again: stopped it stays, and it says so.
    logs.clear()
    assert train_and_evaluate(cfg, run, log=logs.append) == summary
    assert any(f"run stopped early at step {stop}" in line and "not trained further" in line for line in logs)
    assert saved_steps(run / "checkpoints")[-1] == stop
    # A config that does not stop there trains on, as if the run had never stopped.
    logs.clear()
    on = train_and_evaluate(tiny(*BASE), run, log=logs.append)
    assert any("trains on to step 24" in line for line in logs)
    assert (on.step, on.auc, on.logloss, on.best) == (full.step, full.auc, full.logloss, full.best)


def test_target_auc_stops_at_the_first_evaluation_that_reaches_it(tiny, tmp_path, full_run):
    _, _, evals = full_run
    target = sorted(e.auc for e in evals)[-3]  # reached, but not by the first evaluation
    stop = next(e.step for e in evals if e.auc >= target)
    summary = train_and_evaluate(tiny(*BASE, f"train.target_auc={target!r}"), tmp_path / "run", **QUIET)
    assert summary.step == stop and summary.stop_reason.endswith(f"reached train.target_auc={target:g}")
    assert saved_steps(tmp_path / "run" / "checkpoints")[-1] == stop
    # Without a run dir the run stops the same way, nothing saved.
    assert train_and_evaluate(tiny(*BASE, f"train.target_auc={target!r}"), None, **QUIET).step == stop


def test_a_stop_at_an_evaluations_step_evaluates_first_so_the_resumed_run_decides_as_the_uninterrupted(
    tmp_path, monkeypatch, full_run
):
    """A stop signal agreed at step 6, an evaluation's step: the evaluation ran not, the
    checkpoint saved without it and the resumed run went on from step 7, so that evaluation was
    lost for good (with two processes every stop lands on a multiple of 10: an early stop or a
    best checkpoint moved to the next evaluation)."""
    import signal

    from dlrm_jax.train import stop_signals

    _, _, evals = full_run
    monkeypatch.setattr(stop_signals.StopSignals, "requested", lambda self, step: signal.SIGINT if step == 6 else None)
    with pytest.raises(stop_signals.Interrupted, match="after step 6"):
        train_and_evaluate(tiny_config(*BASE), tmp_path / "run", **QUIET)
    monkeypatch.undo()
    train_and_evaluate(tiny_config(*BASE), tmp_path / "run", **QUIET)
    got = [Evaluation(e["step"], e["auc"], e["logloss"]) for e in events(tmp_path / "run") if e["event"] == "eval"]
    assert got == evals


def test_progress_record_round_trips_and_never_prefers_nan():
    p = Progress(loss_reference=0.7, metric="logloss")
    for step, auc, ll in [(2, math.nan, 0.9), (4, 0.6, math.nan), (6, 0.55, 0.5), (8, 0.7, 0.6)]:
        p = p.evaluated(Evaluation(step, auc, ll))
    assert p.best.step == 6 and p.last.step == 8 and p.evals_since_best == 1
    back = Progress.from_json(json.loads(json.dumps(p.to_json())))
    assert back == p
    assert Progress().evaluated(Evaluation(2, math.nan, 0.5)).evaluated(Evaluation(4, 0.6, 0.6)).best.step == 4
    # A split of one class (every AUC NaN): no best, and nothing counted against one. Before: step
    # 2 became the best and early stopping stopped at step 4 'without a better auc than nan'.
    one_class = Progress().evaluated(Evaluation(2, math.nan, 0.5)).evaluated(Evaluation(4, math.nan, 0.4))
    assert one_class.best is None and one_class.evals_since_best == 0 and one_class.last.step == 4
    assert one_class.stop_reason(tiny_config("train.early_stop_evals=1", "train.eval_every=2").train) == ""
    assert auc_note(math.nan, 0.4, 100) == "auc undefined: every one of the 100 scored samples has the same label"
    assert auc_note(math.nan, math.nan, 100) == auc_note(0.5, 0.4, 100) == ""
    assert p.tracking("auc", log=lambda _: None).best is None  # another metric, no best saved: afresh
    # The best's checkpoint kept: it stays the one to beat (it was rotated out, though better
    # by the new metric too than what came after), judged by the new metric from here.
    logged = []
    kept = p.tracking("auc", log=logged.append, saved=[6, 8])
    assert kept.best.step == 6 and kept.metric == "auc" and kept.evals_since_best == 0
    assert logged == [
        "train.keep_best: the best evaluation is now chosen by auc, not logloss; step 6's (auc 0.550000) stays "
        "the one to beat"
    ]
    assert kept.evaluated(Evaluation(10, 0.54, 0.4)).best.step == 6
    assert kept.evaluated(Evaluation(10, 0.56, 0.9)).best.step == 10


@pytest.mark.slow
def test_keep_best_keeps_the_tier_snapshot_of_tiered_tables(tiny, tmp_path):
    """Tiered tables live in the disk tier's snapshots: the best step's stays with its checkpoint."""
    from tests.embedding.tiered_configs import BASE as TIER_BASE
    from tests.embedding.tiered_configs import TIERED

    run = tmp_path / "run"
    cfg = tiny(
        *TIER_BASE,
        *TIERED,
        "mesh.devices=4",
        "embedding.sharding=row",
        "train.steps=12",
        "train.eval_every=2",
        "train.checkpoint_every=4",
        "train.keep_checkpoints=1",
        "train.keep_best=auc",
    )
    summary = train_and_evaluate(cfg, run, **QUIET)
    best = summary.best
    assert best.step < 8  # rotated out without keep_best
    assert saved_steps(run / "checkpoints") == [best.step, 12]
    assert best.step in [int(p.name) for p in (run / "tier" / "snapshots").iterdir()]
    assert evaluate_run(run, step="best", **QUIET).auc == pytest.approx(best.auc, rel=1e-9)


def test_a_step_given_as_text_is_its_number(full_run):
    """From Python, step="24" said "no checkpoint at step 24; saved steps [..., 24]"."""
    run, summary, _ = full_run
    assert evaluate_run(run, step="24", **QUIET).step == evaluate_run(run, step=24, **QUIET).step == 24
    with pytest.raises(
        ValueError, match=r"step must be a checkpoint's step number, 'best' or None \(the newest\), got 2.5"
    ):
        evaluate_run(run, step=2.5, **QUIET)


def test_step_best_where_no_evaluation_had_a_metric_says_why(monkeypatch, tmp_path):
    """A run whose val split has one label: every AUC NaN, so none is the best. Before (once
    NaN evaluations stopped being the best): 'no evaluation recorded', though each was."""
    from dlrm_jax.train import progress as progress_module

    p = Progress().evaluated(Evaluation(2, math.nan, 0.5)).evaluated(Evaluation(4, math.nan, 0.4))
    monkeypatch.setattr(progress_module, "saved_steps", lambda _: [2, 4])
    monkeypatch.setattr(progress_module, "newest_progress", lambda _: (4, p))
    with pytest.raises(
        FileNotFoundError, match=r"no evaluation has a defined auc to choose the best by \(the last, step 4: auc nan"
    ):
        progress_module.checkpoint_step(tmp_path, "best")
    assert auc_note(math.nan, math.inf, 8) != ""  # (an infinite logit: the logloss is inf, no score NaN)
