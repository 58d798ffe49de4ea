"""The run directory: one writer at a time, a config checked before anything changes in it.

Layout: ``config.yaml`` (resolved config), ``plan.txt`` / ``plan.json`` (the embedding plan),
``metrics.jsonl``, ``checkpoints/``, ``.lock``. Only process 0 writes here; in a multi-process
run every process must be given the same directory (see :func:`agree_on_run_dir`).

Resuming needs the same state layout and math: the keys of :func:`state_keys` must match what
the directory was started with. Everything else (steps, logging, learning rate, sharding,
device count) may change on a resume; changes are reported.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

from dlrm_jax.config import Config, ConfigError, config_from_dict, dump_config, load_raw, with_absolute_paths
from dlrm_jax.config_doc import schema_keys
from dlrm_jax.data.sources import data_identity
from dlrm_jax.files import FolderLock, full_disk_as, make_dir, new_run_dir, numbered_folders, written_whole
from dlrm_jax.observe.metrics import recorded_events
from dlrm_jax.parallel.coordination import check_same_everywhere, outcome_of_process_0
from dlrm_jax.wording import run_dir_flag, said, setting

# Keys that decide the shapes of the saved state or the model it computes: a run dir started
# with other values cannot resume. (Table rows come from data.cardinalities after the
# data.max_rows cap, and the resolved config stores binary datasets' cardinalities.)
STATE_KEYS = (
    "model.kind",
    "model.wide.optimizer",
    "model.embedding_dim",
    "model.bottom_mlp",
    "model.top_mlp",
    "model.interaction",
    "model.dcn_layers",
    "model.dcn_rank",
    "train.optimizer",
    "embedding.optimizer",
    "embedding.dtype",
    "embedding.sync",
    "data.num_dense",
    "data.cardinalities",
    "data.max_rows",
    "data.bag_sizes",
    "data.pooling",
)
# What dynamic tables' saved maps mean: an id's shard and probes, the rows, the counters'
# kind (recency or frequency), the admission sketch. Changed, the maps would be read as other
# maps (fewer probes: ids placed further along found nowhere, silently).
DYNAMIC_STATE_KEYS = (
    "embedding.ids",
    "embedding.table_ids",
    "embedding.dynamic.rows",
    "embedding.dynamic.policy",
    "embedding.dynamic.probes",
    "embedding.dynamic.vshards",
    "embedding.dynamic.admit",
    "embedding.dynamic.sketch_width",
)


GIVEN_SOURCE = "given_source.json"  # a run trained on a data source given in Python: its type
DATASET = "dataset.json"  # the data a run trained on (data.sources.data_identity)


def given_source(run_dir: str | Path) -> str:
    """The type of the data source given in Python that ``run_dir`` trained on ("": its
    config's data)."""
    try:
        return str(json.loads((Path(run_dir) / GIVEN_SOURCE).read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def state_keys(old: Config, new: Config) -> tuple[str, ...]:
    """The keys that must match for ``new`` to resume (or read) ``old``'s saved state."""
    return STATE_KEYS + (DYNAMIC_STATE_KEYS if old.dynamic_tables or new.dynamic_tables else ())


def state_differences(old: Config, new: Config) -> list[tuple[str, object, object]]:
    """What differs between ``old`` (a run's saved config) and ``new`` that changes what its
    saved state means (:func:`config_differences` over :func:`state_keys`): the dynamic tables
    as the tables they name (``embedding.ids`` and ``embedding.table_ids`` written another way,
    reordered or with ``=vocab`` entries, name the same ones: they were refused), and what
    their maps are given, raw values or the data's ids (a dataset with the other kind read
    through the maps found almost nothing, silently)."""
    keys = [k for k in state_keys(old, new) if k not in ("embedding.ids", "embedding.table_ids")]
    changed = config_differences(old, new, keys)
    if old.dynamic_tables != new.dynamic_tables:
        names = lambda cfg: [f"cat_{t}" for t in cfg.dynamic_tables]
        changed.append(("dynamic tables (embedding.ids, embedding.table_ids)", names(old), names(new)))
    if old.dynamic_tables and new.dynamic_tables:
        from dlrm_jax.data.sources import dynamic_input

        given = dynamic_input(old), dynamic_input(new)
        if None not in given and given[0] != given[1]:
            changed.append(("what the dynamic tables' maps take (data.path: preprocess --raw-values or not)", *given))
    return changed


class RunDirError(ValueError):
    """A run directory that this run may not use; the message says why and what to do."""


def _get(cfg_dict: dict, key: str):
    value = cfg_dict
    for name in key.split("."):
        value = value.get(name) if isinstance(value, dict) else None
    return list(value) if isinstance(value, (list, tuple)) else value


def config_differences(old: Config, new: Config, keys=None) -> list[tuple[str, object, object]]:
    """(key, old value, new value) for every differing key (all keys when ``keys`` is None)."""
    a, b = old.to_dict(), new.to_dict()
    a["data"]["max_rows"], b["data"]["max_rows"] = old.row_cap, new.row_cap  # auto compared as the cap it is
    # every leaf key of the schema (``embedding.dynamic.new_rows``, not the whole
    # ``embedding.dynamic`` section in a change's line)
    keys = keys or [k.key for k in schema_keys()]
    return [(k, _get(a, k), _get(b, k)) for k in keys if _get(a, k) != _get(b, k)]


def describe_changes(changed: list[tuple[str, object, object]]) -> str:
    """``key old -> new; ...`` of :func:`config_differences`, a long list by the entries that
    differ (26 cardinalities twice made a 700-character line)."""
    return "; ".join(_change(*c) for c in changed)


def _unread(cfg: Config) -> set[str]:
    """Keys the run derives instead of reading (train.steps from train.epochs, train.eval_every
    from train.evals_per_epoch): a change to them means nothing; the change that made them
    unread is said (a resume switched to epochs was told 'train.steps 8 -> 1000 ... now at this
    version's default' and the --set to undo it)."""
    t = cfg.train
    return {key for key, derived in (("train.steps", t.epochs), ("train.eval_every", t.evals_per_epoch)) if derived}


def _default_note(changed: list[tuple[str, object, object]]) -> str:
    """Where a change is to this version's default (a key the command may never have named: a
    run of an older version resumed, whose defaults differed): how to go on as the run trained."""
    defaults = Config().to_dict()
    keep = [(k, old) for k, old, new in changed if _get(defaults, k) == new and not isinstance(old, list)]
    if not keep:
        return ""
    sets = said(" ", ", ").join(  # (--set a=1 --set b=2; the override 'a=1', the override 'b=2')
        setting(k, "null" if old is None else str(old).lower() if isinstance(old, bool) else old) for k, old in keep
    )
    return (
        f" (of these, {', '.join(k for k, _ in keep)} now at this version's default: unless this command set "
        f"them so, the run's earlier commands set them otherwise or the default changed since; to go on as the "
        f"run trained: {sets})"
    )


def _change(key: str, old, new) -> str:
    if not (isinstance(old, list) and isinstance(new, list) and max(len(old), len(new)) > 4):
        return f"{key} {old} -> {new}"
    if len(old) != len(new):
        return f"{key} {len(old)} entries -> {len(new)}"
    at = [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b]
    more = f" and {len(at) - 3} more" if len(at) > 3 else ""
    return f"{key}[{'], ['.join(map(str, at[:3]))}]{more} of {len(old)}: " + ", ".join(
        f"{old[i]} -> {new[i]}" for i in at[:3]
    )


def _step_first(name: str) -> tuple[int, str]:
    """Sort key of ``damaged/`` entries, ``<step>-<time>``: by step, then time."""
    step = name.split("-")[0]
    return (int(step) if step.isdigit() else -1, name)


def data_change(run_dir: Path, now: dict | None) -> str:
    """'run dir R trained on other data (...) than data.path gives now (...)' where the data
    ``now`` (:func:`~dlrm_jax.data.sources.data_identity`) is not what the run recorded in
    ``dataset.json``; '' where it is, or where either is unknown (data made on the fly, a run
    from before the record). Content, not place: a dataset moved, or preprocessed again the
    same way from inputs elsewhere, is the same (records from before ``content_sha256``
    compare ``meta.json``, which names its inputs' folders)."""
    try:
        was = json.loads((Path(run_dir) / DATASET).read_text())
    except (OSError, ValueError):
        return ""
    if now is None or not isinstance(was, dict):
        return ""
    key = "content_sha256" if "content_sha256" in was else "meta_sha256"
    if was.get(key) == now.get(key):
        return ""
    return f"run dir {run_dir} trained on other data ({_described(was)}) than data.path gives now ({_described(now)})"


def _described(identity: dict) -> str:
    if "train_rows" in identity:
        return f"{identity['path']}: {identity['train_rows']:,} train and {identity['val_rows']:,} val rows"
    return f"{identity.get('path')}: {identity.get('bytes', 0):,} bytes"


def _atomic_write(path: Path, text: str) -> None:
    """Write via a temporary file and a rename: a crash leaves the old file or the new one; a
    full disk is one line naming the file (and the old file stays)."""
    with _disk_full_names(path), written_whole(path) as f:
        f.write(text)


def _disk_full_names(path: Path):
    """ENOSPC (which names no file) as one line naming ``path`` and the free space."""

    def message():
        free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
        return f"{path}: no space left on device ({free / 2**20:,.1f} MiB free); free space or pass another {run_dir_flag()}"

    return full_disk_as(message)


class RunDir:
    """An open run directory (``path`` None: a run that writes nothing).

    ``open`` takes the lock and checks ``config.yaml`` against the new config; :meth:`record`
    writes the config and plan once the run's state is restored (a run refused before that,
    here or by its checkpoint, leaves them as they were, and a directory it made, none). Use as
    a context manager; the lock is released on exit, and by the kernel if the process dies.
    """

    def __init__(self, path: Path | None, writer: bool):
        self.path, self.writer, self._lock = path, writer, None
        self._config_text = ""
        self.resumed_config: Config | None = None  # the config its checkpoints were saved with
        self._made = False  # this run made the directory: it goes again if the run leaves it empty
        self._dataset: dict | None = None  # the data it trains on (data.sources.data_identity)

    @classmethod
    def open(
        cls, path: str | Path | None, cfg: Config, *, writer: bool = True, log=print, source_given: bool = False
    ) -> RunDir:
        """In a multi-process run process 0 (the writer) opens the directory and every other
        process learns the outcome: all go on, or all raise the same RunDirError at once.
        ``source_given``: the run trains on a data source given in Python, not its config's."""
        rd = cls(Path(path) if path else None, writer and path is not None)
        refusal = ""
        if rd.writer:
            rd._made = not rd.path.exists()
            make_dir(rd.path, "run dir")
            try:
                rd._take_lock()
                rd._check_set_aside()
                rd._check_config(cfg, log, source_given)
            except RunDirError as e:
                refusal = str(e)
            except BaseException:
                rd.close()
                raise
        if rd.path is not None:
            refusal = outcome_of_process_0(refusal)
        if refusal:
            rd.close()
            raise RunDirError(refusal)
        return rd

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ lock
    def _take_lock(self) -> None:
        """The run dir's lock (:class:`~dlrm_jax.files.FolderLock`): one run at a time."""
        lock = FolderLock(self.path)
        with _disk_full_names(lock.path):
            self._lock = lock.take(
                lambda holder: RunDirError(
                    f"run dir {self.path} is in use by {holder}; wait for that run to end or pass another {run_dir_flag()}"
                )
            )

    def close(self) -> None:
        """Release the lock; a directory this run made and left empty (refused by its data or
        plan before anything was recorded) is removed."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None
            if self._made:
                with contextlib.suppress(OSError):  # rmdir: only if empty
                    self.path.rmdir()

    # ------------------------------------------------------------ checkpoints and config
    def _check_set_aside(self) -> None:
        """Refuses to start over where every checkpoint was set aside as damaged: a resume
        that silently began at step 0 would overwrite the run's metrics and, later, its steps."""
        damaged = self.path / "damaged"
        kept = sorted((p.name for p in damaged.iterdir()), key=_step_first) if damaged.is_dir() else []
        if kept and not numbered_folders(self.path / "checkpoints"):
            raise RunDirError(
                f"run dir {self.path} has no checkpoint to resume, but {damaged} holds {len(kept)} checkpoints set "
                f"aside as damaged ({', '.join(kept)}): move one back to resume from it (mv {damaged / kept[-1]} "
                f"{self.path / 'checkpoints' / kept[-1].split('-')[0]}), or pass a new {run_dir_flag()} to start fresh"
            )

    def _check_config(self, cfg: Config, log, source_given: bool = False) -> None:
        cfg = with_absolute_paths(cfg)  # as recorded: eval and export read it from any directory
        saved = self.path / "config.yaml"
        resumes = bool(numbered_folders(self.path / "checkpoints"))  # (a run killed before its first: none)
        if resumes and (given := given_source(self.path)) and not source_given:
            raise RunDirError(
                f"run dir {self.path} was trained on data given in Python ({given}), not its config's "
                f"data.source={cfg.data.source}: resume it from Python with that data "
                f"(train_and_evaluate(cfg, run_dir, source=...)), or pass a new {run_dir_flag()}"
            )
        if saved.exists() and resumes:
            try:
                old = config_from_dict(load_raw(saved))  # (strict YAML; a problem in one line)
            except ConfigError as e:
                raise RunDirError(f"{e}; use another {run_dir_flag()}") from None
            self.resumed_config = old
            blocking = state_differences(old, cfg)
            if blocking:
                what = describe_changes(blocking)
                raise RunDirError(
                    f"run dir {self.path} was started with another model: {what}. These "
                    f"change the saved state, so it cannot resume; pass a new {run_dir_flag()} "
                    f"to start fresh (or remove {self.path})"
                )
            epochs = cfg.train.epochs or cfg.train.evals_per_epoch  # steps that follow from the batch size
            if epochs and old.train.batch_size != cfg.train.batch_size:
                raise RunDirError(
                    f"run dir {self.path} counts its epochs in steps of train.batch_size={old.train.batch_size}: "
                    f"with {cfg.train.batch_size} its step numbers would mean other samples (4 epochs at twice "
                    f"the batch end at the step 2 epochs reached); resume with train.batch_size="
                    f"{old.train.batch_size}, or pass a new {run_dir_flag()}"
                )
            changed = [c for c in config_differences(old, cfg) if c[0] not in _unread(old) | _unread(cfg)]
            if changed:
                log("resuming with changed settings: " + describe_changes(changed) + _default_note(changed))
        self._dataset = None if source_given else data_identity(cfg)
        if resumes and not (self.path / DATASET).exists():  # (a run from before the record: its data unknown,
            self._dataset = None  # not recorded as what it trained on)
        if resumes:
            self._check_dataset(cfg, log)
        self._config_text = dump_config(cfg)

    def _check_dataset(self, cfg: Config, log) -> None:
        """A resumed run over other data than it trained on (:func:`data_change`): refused
        where the run counts epochs (its steps follow from the rows), else said."""
        what = data_change(self.path, self._dataset)
        if not what:
            return
        if cfg.train.epochs or cfg.train.evals_per_epoch:
            raise RunDirError(
                f"{what}: a run counted in epochs (train.epochs, train.evals_per_epoch) cannot go on over it, its "
                f"steps following from the rows; give it the data it trained on, or pass a new {run_dir_flag()}"
            )
        log(f"warning: {what}: the run goes on over it, and its evaluations score its val split")

    def record(self, report: str, plan_json: str, fresh: bool = False, log=print, given_source: str = "") -> None:
        """Write ``config.yaml`` (the config ``open`` checked) and the plan: the run goes on.
        ``fresh``: it starts from step 0, and an earlier run's record there is kept aside.
        ``given_source``: the type of a data source given in Python, not the config's (recorded:
        evaluating the run on its config's data would score other data)."""
        if self.writer:
            if fresh:
                self._keep_earlier(log)
            _atomic_write(self.path / "config.yaml", self._config_text)
            _atomic_write(self.path / "plan.txt", report + "\n")
            _atomic_write(self.path / "plan.json", plan_json + "\n")
            if given_source:
                _atomic_write(self.path / GIVEN_SOURCE, json.dumps({"source": given_source}) + "\n")
            else:
                (self.path / GIVEN_SOURCE).unlink(missing_ok=True)
            if self._dataset is not None:
                _atomic_write(self.path / DATASET, json.dumps(self._dataset) + "\n")
            else:
                (self.path / DATASET).unlink(missing_ok=True)

    def _keep_earlier(self, log) -> None:
        """A run starting from step 0 where an earlier one left a record (its checkpoints removed,
        or it was killed before its first): that run's metrics.jsonl, TensorBoard events, config
        and plan are moved to ``earlier/TIME/``, not written over."""
        metrics = self.path / "metrics.jsonl"
        if not (self.path / "config.yaml").exists() and (not metrics.exists() or not metrics.stat().st_size):
            return
        target = self.path / "earlier" / time.strftime("%Y%m%d-%H%M%S")
        target.mkdir(parents=True, exist_ok=True)
        moved = []
        for name in ("metrics.jsonl", "tensorboard", "config.yaml", "plan.txt", "plan.json", GIVEN_SOURCE, DATASET):
            if (self.path / name).exists():
                shutil.move(str(self.path / name), target / name)
                moved.append(name)
        # (what was there: a run stopped before its first step has no metrics.jsonl, which the line named)
        log(
            f"no checkpoint to resume in {self.path / 'checkpoints'}: training from step 0; the earlier "
            f"run's {', '.join(moved)} moved to {target}"
        )

    @property
    def metrics_path(self) -> Path | None:
        return self.path / "metrics.jsonl" if self.writer else None

    @property
    def checkpoint_dir(self) -> Path | None:
        return self.path / "checkpoints" if self.path else None

    def recorded_final(self, step: int, evaluates: bool = True, log=print) -> dict | None:
        """The last train and eval events at ``step`` from metrics.jsonl, merged; None if the
        file does not record the run's end there: an evaluation, or where the run never
        evaluates (``evaluates=False``), its final event (the one with ``run_samples_per_s``)."""
        file = self.path / "metrics.jsonl" if self.path else None
        if file is None or not file.exists():
            return None
        events = [e for _, e in recorded_events(file, file.read_text(errors="replace").splitlines(), log)]
        at_step = [e for e in events if e.get("step") == step]
        ended = (lambda e: e.get("event") == "eval") if evaluates else (lambda e: "run_samples_per_s" in e)
        if not any(ended(e) for e in at_step):
            return None
        merged = {}
        for e in at_step:
            merged.update(e)
        return merged


def agree_on_run_dir(run_dir: str | None) -> str:
    """The run dir every process of a multi-process run uses: the one given, or process 0's
    ``runs/<time>``. Processes given different ones (as folders: a relative path is read from
    each one's working directory), or one given to some only, are refused
    on every process at once, in one line: each would wait for the others in a different run
    dir (a late failure, or a hang where one process waits for a choice the others never make)."""
    import jax

    if jax.process_count() == 1:
        return run_dir or new_run_dir()
    # as folders, not as typed: one relative path from two working directories is two run dirs
    given = str(Path(run_dir).absolute()) if run_dir else "(not given)"
    check_same_everywhere({run_dir_flag(): given}, what=f"{run_dir_flag()} arguments")
    return run_dir or outcome_of_process_0(new_run_dir() if jax.process_index() == 0 else "")
