"""``dlrm-jax export --serving``: a trained run as one self-contained serving artifact.

The dense part is exported with ``jax.export`` for CPU and CUDA, with a symbolic batch size,
taking the dense parameters, the dense features and the *pooled* vectors of every feature (and
of each extra sparse part's, such as Wide&Deep's wide part): lookups stay outside it, so tables larger than a device (or a host's
memory) are served from the host behind a row cache, and the function is the same small
program whatever the plan trained the tables with. The function is the eval step's own
forward: the same graph, with the parameters as arguments, so scores match ``eval``'s.

``--since STEP`` writes a delta: the rows whose stored values differ from the checkpoint of
STEP (compared here, at export time: training tracks nothing), and the dense part whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dlrm_jax.data.sources import data_identity
from dlrm_jax.embedding.exchange.relayout import tables_on_host
from dlrm_jax.files import check_new_folder, new_folder
from dlrm_jax.jax_settings import with_library_settings
from dlrm_jax.model.parts import PartInputs
from dlrm_jax.serving.artifact import (
    FORMAT_VERSION,
    FUNCTION_FILE,
    PARAMS_FILE,
    TABLE_DTYPES,
    ArtifactError,
    TableWriter,
    encode_rows,
    write_manifest,
)
from dlrm_jax.serving.id_maps import write_maps
from dlrm_jax.train.checkpoint_reader import reading
from dlrm_jax.train.export import RestoredRun, as_evaluated, check_outside_run, id_maps, restore_run, tier_snapshot
from dlrm_jax.train.restore import read_checkpoint, saved_run_config
from dlrm_jax.train.rundir import data_change
from dlrm_jax.train.serving_rules import dense_transform, rules, vocabularies
from dlrm_jax.train.wiring import model_entry

EXPORT_PLATFORMS = ("cpu", "cuda")
ROWS_PER_WRITE = 1 << 16


@with_library_settings  # (whatever JAX settings the process has: see jax_settings)
def export_serving(
    run_dir: str | Path,
    dest: str | Path,
    overrides: list[str] = (),
    step: int | str | None = None,
    tables: str = "float32",
    since: int | None = None,
    log=print,
) -> int:
    """Write the serving artifact of ``run_dir``'s checkpoint at ``step`` (default: the newest
    intact; ``best``: train.keep_best's) to ``dest``, a new folder; ``tables``: float32,
    bfloat16 or int8 (per-row scale and offset); ``since``: a delta against that step's
    checkpoint. Returns the step exported. ``log=None``: no lines."""
    log = log or (lambda *_: None)  # (None raised TypeError after the artifact was written)
    if tables not in TABLE_DTYPES:
        raise ValueError(f"--tables {tables}: one of {', '.join(TABLE_DTYPES)}")
    dest = Path(dest)
    check_new_folder(dest, "export")
    cfg = saved_run_config(Path(run_dir), overrides)
    vocabularies(cfg)  # (one gone is named as such, not as other data)
    # (Criteo text's rules hash the values: nothing is read from the data, whatever it holds now)
    changed = data_change(Path(run_dir), data_identity(cfg)) if cfg.data.source == "binary" else ""
    if changed:  # (its rules, the vocabularies, would map raw values to other rows than the model learned)
        raise ValueError(
            f"{changed}: the serving rules are read from the data, and these would map raw values to other "
            f"rows than the model learned; export with data.path set to the data it trained on"
        )
    with reading(Path(run_dir) / "checkpoints"):  # kept from the run's rotation: tiers' snapshots are read last
        run = restore_run(run_dir, overrides, step, log)
        check_outside_run(dest, run_dir, run.cfg)
        if since is not None and since >= run.step:
            raise ValueError(f"--since {since}: must be an earlier step than the one exported ({run.step})")
        base = None  # (a delta's base: its tables as the exported state's are, one set, not one per host)
        if since is not None:
            base = as_evaluated(run.steps, read_checkpoint(Path(run_dir), run.cfg, run.steps, since, log)[1])
        with new_folder(dest, "export") as work:
            _write_artifact(work, run, run_dir, tables, base, since)
    what = f"delta since step {since}" if since is not None else f"{len(run.plan.tables)} tables ({tables})"
    log(f"exported the serving model of step {run.step} to {dest}: {what}")
    return run.step


def _write_artifact(work: Path, run: RestoredRun, run_dir, tables: str, base, since: int | None) -> None:
    features, parts = _write_tables(work, run, run_dir, tables, base, since)
    _write_function(work, run)
    manifest = {
        "format_version": FORMAT_VERSION,
        "kind": "delta" if since is not None else "full",
        "base_step": since,
        "step": run.step,
        # Which trained state this is, and (a delta) which one it applies to: a delta from
        # another run with the same shapes and steps is refused, not applied.
        "state": state_fingerprint(run, run.state),
        "base_state": state_fingerprint(run, base) if base is not None else None,
        "model": _model_section(run.cfg),
        "num_dense": run.cfg.data.num_dense,
        "features": features,
        "parts": parts,
        "tables_dtype": tables,
        "preprocessing": rules(work, run.cfg) if since is None else None,  # a delta's are its base's
        "id_maps": _id_maps(work, run, run_dir),  # a delta's too: its step's maps, whole
        "dense_transform": dense_transform(run.cfg),
        "evaluation": _evaluation(Path(run_dir), run.step),
        "function": {
            "file": FUNCTION_FILE,
            "params": PARAMS_FILE,
            "platforms": list(EXPORT_PLATFORMS),
            "inputs": ["params", "dense float32 [b, num_dense]", "pooled float32 [b, F, D]"]
            + [f"{name} float32 [b, F, {entries[0]['dim']}]" for name, entries in parts.items()],
            "output": "probabilities float32 [b]",
        },
    }
    write_manifest(work, manifest)


def _id_maps(work: Path, run: RestoredRun, run_dir) -> dict:
    """The dynamic tables' maps at the exported step (dlrm_jax.serving.id_maps)."""
    return write_maps(work, {name: (spec, m._asdict()) for name, (spec, m) in id_maps(run, run_dir).items()})


def _model_section(cfg) -> dict:
    m = cfg.model
    return {
        "kind": m.kind,
        "interaction": m.interaction,
        "embedding_dim": m.embedding_dim,
        "bottom_mlp": list(m.bottom_mlp),
        "top_mlp": list(m.top_mlp),
        "compute_dtype": cfg.train.compute_dtype,
    }


def _table_chunks(run: RestoredRun, run_dir, collection, emb, step: int) -> Iterator[tuple[int, int, Iterator]]:
    """Per table of ``collection``: (index, its rows, chunks of (start, float32 values)) of
    ``emb`` (or, tiered, of the tier's snapshot of ``step``: every row the tier holds; the
    collection's own table is the devices' cache of it)."""
    tiered = tier_snapshot(run, run_dir, step) if collection.tiered_tables else None
    on_host = tables_on_host(collection, emb, frozenset(collection.tiered_tables))  # (in order, the tiered left out)
    try:
        for t, tp in enumerate(collection.plan.tables):
            if t in collection.tiered_tables:
                rows = tiered.store.rows(tp.spec.name)
                yield t, rows, _tier_chunks(tiered.store, tp.spec.name, rows)
            else:
                _, values, _ = next(on_host)
                yield t, len(values), _array_chunks(values)
    finally:
        if tiered is not None:
            tiered.close()


def _array_chunks(v: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    for s in range(0, len(v), ROWS_PER_WRITE):
        yield s, v[s : s + ROWS_PER_WRITE]


def _tier_chunks(store, table: str, rows: int) -> Iterator[tuple[int, np.ndarray]]:
    for s in range(0, rows, ROWS_PER_WRITE):
        yield s, store.read(table, np.arange(s, min(s + ROWS_PER_WRITE, rows)))["values"].astype(np.float32)


def _write_tables(work: Path, run: RestoredRun, run_dir, dtype: str, base, since) -> tuple[list, dict]:
    """Every table (and each extra sparse part's, always float32, named as its part's plan names
    them, ``<part>_<feature>``, as ``dlrm-jax export`` writes them),
    whole or (``base``) the rows that differ from it; the manifest's feature entries and each
    part's."""
    parts = [("", run.steps.collection, run.state.emb, dtype, None if base is None else base.emb)]
    for name, part in run.steps.parts.items():
        base_tables = None if base is None else part.tables(base.parts[name])
        parts.append((name, part.collection, part.tables(run.state.parts[name]), "float32", base_tables))
    entries = {name: [] for name, *_ in parts}
    for part_name, collection, emb, dt, base_emb in parts:
        olds = _table_chunks(run, run_dir, collection, base_emb, since) if base_emb is not None else None
        for t, rows, chunks in _table_chunks(run, run_dir, collection, emb, run.step):
            old_chunks = next(olds)[2] if olds is not None else None  # the same table, in lockstep
            spec = collection.plan.tables[t].spec
            name = spec.name  # (a part's are its own: wide_<feature>)
            entries[part_name].append(
                {
                    "name": name,
                    "table": name,
                    "rows": rows,
                    "dim": spec.dim,
                    "bag_size": spec.bag_size,
                    "pooling": str(spec.pooling),
                    "dtype": dt,
                }
            )
            if old_chunks is None:
                writer = TableWriter(work / "tables" / name, rows, spec.dim, dt)
                for start, v in chunks:
                    writer.write(start, v)
                continue
            changed_rows, changed = [], []
            for (start, v), (_, old) in zip(chunks, old_chunks, strict=True):
                new_f, old_f = encode_rows(v, dt), encode_rows(old, dt)
                diff = np.zeros(len(v), bool)
                for k in new_f:  # compared as stored: a change that rounds away is no change
                    diff |= np.any((new_f[k] != old_f[k]).reshape(len(v), -1), axis=1)
                changed_rows.append(start + np.flatnonzero(diff))
                changed.append(v[diff])
            changed_at = np.concatenate(changed_rows)
            entries[part_name][-1]["rows_changed"] = int(len(changed_at))
            writer = TableWriter(work / "tables" / name, len(changed_at), spec.dim, dt, with_rows=True)
            if len(changed_at):
                writer.write(0, np.concatenate(changed), changed_at)
    return entries.pop(""), entries


def _dense_leaves(run: RestoredRun, state) -> tuple[list[np.ndarray], object]:
    """The dense parameters of ``state`` as the function takes them (each extra sparse part's
    dense weights last, in the parts' order), and the treedef of the model's own."""
    leaves, treedef = jax.tree.flatten(jax.device_get(run.steps.checkpoint_form(state)["params"]))
    for name, part in run.steps.parts.items():
        leaves = [*leaves, jax.device_get(part.dense_arrays(state.parts[name])["values"])]
    return [np.asarray(x) for x in leaves], treedef


def state_fingerprint(run: RestoredRun, state) -> str:
    """sha256 of ``state``'s dense parameters (shapes, dtypes and bytes, in order): names one
    trained state; two runs part in their dense parameters from the first step."""
    h = hashlib.sha256()
    for x in _dense_leaves(run, state)[0]:
        h.update(f"{x.dtype}{x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def _write_function(work: Path, run: RestoredRun) -> None:
    """The eval step's forward as a jax.export for CPU and CUDA, and its parameters."""
    steps, cfg = run.steps, run.cfg
    leaves, treedef = _dense_leaves(run, run.state)
    parts = list(steps.parts.values())
    n_dense = len(leaves) - len(parts)

    graphdef = _portable_graphdef(cfg)

    def serve(leaves, dense, pooled, *parts_pooled):
        logits = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves[:n_dense]))(dense, pooled)
        for part, part_pooled, weights in zip(parts, parts_pooled, leaves[n_dense:], strict=True):
            logits = logits + part.logits(PartInputs(part_pooled, weights), dense)
        return jax.nn.sigmoid(logits)

    (b,) = jax.export.symbolic_shape("b")
    F, D = cfg.num_features, cfg.model.embedding_dim
    args = [
        [jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) for x in leaves],
        jax.ShapeDtypeStruct((b, cfg.data.num_dense), jnp.float32),
        jax.ShapeDtypeStruct((b, F, D), jnp.float32),
    ]
    for part in parts:
        args.append(jax.ShapeDtypeStruct((b, F, part.collection.plan.tables[0].spec.dim), jnp.float32))
    exported = jax.export.export(jax.jit(serve), platforms=EXPORT_PLATFORMS)(*args)
    (work / FUNCTION_FILE).parent.mkdir(parents=True, exist_ok=True)
    (work / FUNCTION_FILE).write_bytes(exported.serialize())
    with open(work / PARAMS_FILE, "wb") as f:
        np.savez(f, *[np.asarray(x) for x in leaves])


def _portable_graphdef(cfg):
    """The run's dense model with XLA's dot pairs and cross layers, the same parameters: the
    fused forms' Pallas kernels size their tiles from the batch, which the exported function
    leaves symbolic ('unsupported operand type(s) for &: _DimExpr', and no artifact, for every
    run trained with model.dot_pairs or model.cross_layers fused); they agree to rounding."""
    model = dataclasses.replace(cfg.model, dot_pairs="xla", cross_layers="xla")
    plain = dataclasses.replace(cfg, model=model)
    dense = nnx.eval_shape(lambda: model_entry(plain).dense(plain, nnx.Rngs(0)))
    return nnx.split(dense, nnx.Param)[0]


def _evaluation(run_dir: Path, step: int) -> dict | None:
    """The run's evaluation of ``step`` (metrics.jsonl), if it made one."""
    found = None
    try:
        with open(run_dir / "metrics.jsonl") as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("step") == step and e.get("auc") is not None:
                    found = {k: e[k] for k in ("auc", "logloss", "eval_samples") if k in e}
    except FileNotFoundError:
        return None
    return found


__all__ = ["ArtifactError", "export_serving"]
