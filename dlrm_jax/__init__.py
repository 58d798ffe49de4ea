"""dlrm_jax: DLRM training in JAX/Flax with embedding tables sharded over a device mesh.

Notebook use::

    import dlrm_jax
    dlrm_jax.request_cpu_devices(8)          # only on a CPU-only machine, before JAX starts
    cfg = dlrm_jax.load_config("smoke", ["train.steps=100"])
    summary = dlrm_jax.train_and_evaluate(cfg, "runs/notebook")
    print(summary.auc)

Attributes are imported on first use, so ``import dlrm_jax`` does not start JAX.

Configuration: :func:`load_config` (overrides as ``["train.steps=100"]`` or ``{"train.steps": 100}``),
:func:`with_overrides` (a changed copy of a config), :class:`Config`, :class:`ConfigError`,
:func:`resolve_data_config` (a config for ``data.source=binary`` given the dataset's features
and table sizes: before building a :class:`BinarySource` or :func:`build` of your own).
Training: :func:`train_and_evaluate` (``source=``: data of your own, e.g. :class:`ArraySource`
over numpy arrays), :func:`evaluate_run`, :class:`RunSummary`, :func:`build`; it raises
:class:`Interrupted` (SIGINT/SIGTERM, after saving) and :class:`TrainingDiverged`.
Devices: :func:`request_cpu_devices`, :func:`make_mesh`, :func:`mesh_from_config` (the mesh a config asks for).
Embeddings: :class:`TableSpec`, :func:`specs_from_config`, :func:`plan_embeddings`,
:class:`PlanOptions` (its options as one record; ``cluster=``: a :class:`Cluster`, e.g.
``cluster_for("h100", {"devices_per_host": 4}, simulated=False)``, which ``auto`` prices plans
for and ``host_row`` / ``host_column`` split tables within the hosts of), :class:`PlanRequest` (a
plan asked for, as one record: ``request.plan()``), :func:`plan_from_config`,
:func:`plan_report`, :class:`EmbeddingPlan`, :class:`PlanError`,
:class:`EmbeddingCollection` (lookups and sparse updates inside a jitted step of your own; its
state is an :class:`EmbeddingState`), :func:`sparse_optimizer` (:class:`SparseOptimizer`;
its ``update`` takes a batch's :class:`Lookups` and the pooled gradients they point at),
:class:`HostTables` (a set of the tables on each host, around a collection),
``PAD_ID`` (an empty slot of a multi-hot bag)::

    specs = [dlrm_jax.TableSpec("user_id", 100_000, 32), dlrm_jax.TableSpec("item_id", 50_000, 32)]
    plan = dlrm_jax.plan_embeddings(specs, "row", 8, "adagrad", global_batch=1024)
    tables = dlrm_jax.EmbeddingCollection(plan, dlrm_jax.make_mesh(8))
    emb = tables.init(jax.random.key(0))
    pooled_bfd, res = tables.lookup(emb, ids_bs)             # inside your jax.jit step
    emb = tables.apply_gradients(emb, res, grad_bfd, lr)     # grad_bfd: d loss / d pooled_bfd

``examples/two_tower.py`` trains a two-tower retrieval model this way.
Models: ``MODELS`` (``model.kind`` -> :class:`ModelEntry`: the dense module and any extra
sparse parts, each a :class:`SparsePart` whose logits are added, as Wide&Deep's wide part;
:class:`PartInputs` is what a part's loss differentiates; docs/models.md, "Adding a model").
Hot rows: :class:`HotPlan` (in a plan), :class:`RowCounts` (lookup statistics),
:func:`choose_hot_rows` (the cost model), :class:`HotSchedule` (counting and refreshes);
``EmbeddingCollection.refresh`` changes the hot set of a state.
Tiered tables: :class:`TierPlan` (in a plan), :class:`TierStore` (the disk tier),
:class:`TieredTables` (disk tier, DRAM caches and device-cache fills of a run),
:class:`TierRunner` (train steps over them), :func:`export_run` (a checkpoint's tables as
tensorstore arrays).
Dynamic tables (``embedding.ids=dynamic``; docs/dynamic-tables.md): :class:`MapSpec` (one
table's id map: rows, shards, probes, eviction, admission), :class:`DynamicTables` (raw ids
resolved to rows inside a step, over a collection).
Data: :class:`Batch`, :class:`RawBatch` (with raw 64-bit ids for dynamic tables),
:class:`SyntheticSource`, :class:`BinarySource`, :class:`CriteoTSVSource`, :class:`ArraySource`,
:func:`preprocess_criteo`; other datasets (MovieLens, Avazu, Taobao, Yelp, or any CSV /
JSON-lines file) through a schema: :func:`load_schema`, :func:`preprocess_tabular`::

    report = dlrm_jax.preprocess_tabular(
        "movielens_1m", ["ml-1m/ratings.dat"], "data/ml1m",
        joins={"users": "ml-1m/users.dat", "movies": "ml-1m/movies.dat"})
    cfg = dlrm_jax.load_config("smoke", ["data.source=binary", "data.path=data/ml1m"])

Serving: :func:`export_serving` (a checkpoint as a self-contained artifact: the dense part as a
``jax.export`` function, the tables, the raw-value rules), :func:`load_serving` (the same as
``dlrm_jax.serving.load``, which needs only numpy, jax and tensorstore) -> :class:`ServingModel`
with ``predict(dense, ids)`` and ``predict_raw(lines)``; delta exports (``since=STEP``) load on
top of their base.
Metrics: :func:`roc_auc`, :func:`log_loss` (of probabilities), :func:`log_loss_of_logits` (of
logits, as evaluation scores them).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import signal
import threading

__version__ = "0.1.0"

_EXPORTS = {
    "Config": "dlrm_jax.config",
    "ConfigError": "dlrm_jax.config",
    "load_config": "dlrm_jax.config",
    "with_overrides": "dlrm_jax.config",
    "resolve_data_config": "dlrm_jax.data.sources",
    "request_cpu_devices": "dlrm_jax.parallel.mesh",
    "make_mesh": "dlrm_jax.parallel.mesh",
    "train_and_evaluate": "dlrm_jax.train.trainer",
    "Interrupted": "dlrm_jax.train.stop_signals",
    "TrainingDiverged": "dlrm_jax.train.watch",
    "evaluate_run": "dlrm_jax.train.saved_run",
    "RunSummary": "dlrm_jax.train.evaluate",
    "build": "dlrm_jax.train.build",
    "mesh_from_config": "dlrm_jax.train.build",
    "TableSpec": "dlrm_jax.embedding.plan.specs",
    "specs_from_config": "dlrm_jax.train.wiring",
    "plan_embeddings": "dlrm_jax.embedding.plan.planner",
    "PlanOptions": "dlrm_jax.embedding.plan.planner",
    "PlanRequest": "dlrm_jax.embedding.plan.planner",
    "Cluster": "dlrm_jax.embedding.plan.cost",
    "cluster_for": "dlrm_jax.embedding.plan.cost",
    "plan_from_config": "dlrm_jax.train.wiring",
    "plan_report": "dlrm_jax.embedding.plan.stats",
    "PlanError": "dlrm_jax.embedding.plan.planner",
    "EmbeddingPlan": "dlrm_jax.embedding.plan.embedding_plan",
    "EmbeddingCollection": "dlrm_jax.embedding.exchange.collection",
    "HostTables": "dlrm_jax.embedding.exchange.host_tables",
    "MODELS": "dlrm_jax.train.wiring",
    "ModelEntry": "dlrm_jax.train.wiring",
    "SparsePart": "dlrm_jax.model.parts",
    "PartInputs": "dlrm_jax.model.parts",
    "EmbeddingState": "dlrm_jax.embedding.exchange.collection",
    "sparse_optimizer": "dlrm_jax.embedding.exchange.optimizers",
    "SparseOptimizer": "dlrm_jax.embedding.exchange.optimizers",
    "Lookups": "dlrm_jax.embedding.exchange.row_grads",
    "PAD_ID": "dlrm_jax.ids",
    "HotPlan": "dlrm_jax.embedding.plan.embedding_plan",
    "RowCounts": "dlrm_jax.embedding.hot.counts",
    "HotSchedule": "dlrm_jax.embedding.hot.schedule",
    "choose_hot_rows": "dlrm_jax.embedding.hot.choice",
    "TierPlan": "dlrm_jax.embedding.plan.embedding_plan",
    "TierStore": "dlrm_jax.embedding.tiers.store",
    "TieredTables": "dlrm_jax.embedding.tiers.tables",
    "TierRunner": "dlrm_jax.train.tier_runner",
    "export_run": "dlrm_jax.train.export",
    "export_serving": "dlrm_jax.train.serving_export",
    "ServingModel": "dlrm_jax.serving.model",
    "load_serving": "dlrm_jax.serving.model",
    "MapSpec": "dlrm_jax.embedding.dynamic.idmap",
    "DynamicTables": "dlrm_jax.embedding.exchange.dynamic_tables",
    "Batch": "dlrm_jax.data.batch",
    "RawBatch": "dlrm_jax.data.batch",
    "SyntheticSource": "dlrm_jax.data.sources.synthetic",
    "BinarySource": "dlrm_jax.data.sources.binary",
    "ArraySource": "dlrm_jax.data.sources.arrays",
    "CriteoTSVSource": "dlrm_jax.data.sources.criteo",
    "preprocess_criteo": "dlrm_jax.data.preprocessing.criteo_preprocess",
    "preprocess_tabular": "dlrm_jax.data.preprocessing.tabular",
    "load_schema": "dlrm_jax.data.preprocessing.tabular_schema",
    "roc_auc": "dlrm_jax.observe.metrics",
    "log_loss": "dlrm_jax.observe.metrics",
    "log_loss_of_logits": "dlrm_jax.observe.metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        with _interrupts_after():
            value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    # A subpackage or module by its attribute (``dlrm_jax.serving.load``), as after ``import
    # dlrm_jax.serving``: only the name asked for is imported.
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        with _interrupts_after():
            return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'dlrm_jax' has no attribute {name!r}")


@contextlib.contextmanager
def _interrupts_after():
    """A Ctrl-C during the ``with`` body delivered when it ends. The first attribute used
    imports JAX, which takes seconds: interrupted half-way, JAX stayed half-imported
    ("partially initialized module 'jax' has no attribute 'version'") until the kernel restarted.
    In the main thread only (where signals are handled)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # (None: a handler not set from Python, which could not be put back)
        return
    asked = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: asked.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        if asked:
            signal.raise_signal(signal.SIGINT)  # (to the handler that was there: a notebook's, Python's)


def __dir__():
    return __all__
