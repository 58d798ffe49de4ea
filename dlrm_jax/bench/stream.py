"""``dlrm-jax bench stream``: the same model trained on the same time-ordered stream (the
drifting synthetic stream, data/sources/drifting.py, or Criteo-format text read in the order it
was written, ``criteo.criteo_windows``) with three ways of turning raw ids into rows, at equal
table rows, judged by progressive validation: each window is scored before it is trained on.

- ``dynamic``: each table's id map (embedding/dynamic): a row per id while it is live,
  evicted by the policy, admitted after ``admit`` sightings;
- ``hashed``: row = raw id mod rows (unrelated ids share rows);
- ``vocab``: the first window's ``rows - 1`` most frequent ids of each feature get rows, every
  other id the out-of-vocabulary row (a vocabulary counted once, before training).

The report: per case and window its AUC and logloss, the mean AUC over the last half of the
windows, training samples/s, and (dynamic) ids admitted and rows evicted; the ground truth's
AUC per window (the synthetic stream's true probabilities: no model does better).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.bench import check_stream_config
from dlrm_jax.bench.common import each_case, machine_description, write_report
from dlrm_jax.data.sources.drifting import StreamWindow
from dlrm_jax.embedding.dynamic.idmap import MapSpec, split_ids
from dlrm_jax.embedding.exchange.collection import EmbeddingCollection
from dlrm_jax.embedding.exchange.dynamic_tables import DynamicTables
from dlrm_jax.embedding.plan.planner import plan_embeddings
from dlrm_jax.embedding.plan.specs import TableSpec
from dlrm_jax.model.dlrm import bce_loss
from dlrm_jax.observe.metrics import log_loss_of_logits, roc_auc
from dlrm_jax.train.build import mesh_from_config
from dlrm_jax.train.optimizer_setup import dense_optimizer, sparse_optimizer_from_config
from dlrm_jax.train.wiring import dlrm_from_config, map_fields

CASES = ("dynamic", "hashed", "vocab")


def _vocabulary(ids: np.ndarray, rows: int) -> np.ndarray:
    """The ``rows - 1`` most frequent ids of one feature, sorted (row k + 1 for the k-th)."""
    values, counts = np.unique(ids, return_counts=True)
    return np.sort(values[np.argsort(-counts, kind="stable")[: rows - 1]])


def _vocab_rows(ids: np.ndarray, vocab: np.ndarray) -> np.ndarray:
    at = np.clip(np.searchsorted(vocab, ids), 0, len(vocab) - 1)
    return np.where(vocab[at] == ids, at + 1, 0).astype(np.int32)


class _Case:
    """One way of ids to rows: the tables, the dense model and the jitted steps."""

    def __init__(self, kind: str, cfg, shape: tuple[int, int], maps: list[MapSpec], mesh):
        features, num_dense = shape
        self.kind, self.rows = kind, np.array([m.rows for m in maps], np.uint64)
        n = mesh.size
        specs = [TableSpec(f"cat_{f}", m.rows, cfg.model.embedding_dim, 1) for f, m in enumerate(maps)]
        e = cfg.embedding  # (its tables' and exchange's keys as training takes them)
        plan = plan_embeddings(
            specs,
            "row",
            n,
            e.optimizer,
            cfg.train.batch_size,
            dtype=e.dtype,
            exchange_dtype=e.exchange_dtype,
            capacity_factor=e.capacity_factor,
            bag_exchange=e.bag_exchange,
        )
        self.coll = EmbeddingCollection(plan, mesh, sparse_optimizer_from_config(cfg))
        new_rows = cfg.embedding.dynamic.new_rows
        self.dyn = DynamicTables(self.coll, dict(enumerate(maps)), new_rows) if kind == "dynamic" else None
        model = dlrm_from_config(cfg, nnx.Rngs(cfg.train.seed), num_dense, features)
        self.graphdef, params = nnx.split(model, nnx.Param)
        # committed to the mesh as the step returns them: else the second step compiles again
        everywhere = NamedSharding(mesh, P())
        self.params = jax.device_put(nnx.to_pure_dict(params), everywhere)
        self.tx = dense_optimizer(cfg, optax.constant_schedule(cfg.train.learning_rate))
        self.opt_state = jax.device_put(self.tx.init(self.params), everywhere)
        self.key = jax.random.key(cfg.train.seed)
        self.emb = self.coll.init(self.key)
        self.maps = self.dyn.init_maps() if self.dyn else {}
        self.emb_lr = jnp.float32(cfg.embedding_learning_rate)
        self.vocab = None
        self.train_step, self.scores = jax.jit(self._train_step, donate_argnums=(0, 1, 2)), jax.jit(self._scores)

    def _rows(self, emb, maps, hi, lo, ids, step, learn):
        stats = {}
        if self.dyn is not None:
            raw = (hi, lo, jnp.ones_like(hi, bool))  # every feature's table is dynamic, one slot each
            emb, maps, ids, stats, *_ = self.dyn.resolve(emb, maps, raw, ids, step, self.key, learn)
        return emb, maps, ids, stats

    def _logits(self, params, dense, pooled):
        return nnx.merge(self.graphdef, params)(dense, pooled)

    def _train_step(self, params, opt_state, emb, maps, dense, hi, lo, ids, labels, step):
        emb, maps, ids, stats = self._rows(emb, maps, hi, lo, ids, step, True)
        pooled, res = self.coll.lookup(emb, ids)
        loss_fn = lambda p, pooled: jnp.mean(bce_loss(self._logits(p, dense, pooled), labels))
        loss, (g_params, g_pooled) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, pooled)
        updates, opt_state = self.tx.update(g_params, opt_state, params)
        emb = self.coll.apply_gradients(emb, res, g_pooled, self.emb_lr)
        totals = {k: sum(s[k] for s in stats.values()) for k in ("admitted", "evicted")} if stats else {}
        return optax.apply_updates(params, updates), opt_state, emb, maps, loss, totals

    def _scores(self, params, emb, maps, dense, hi, lo, ids):
        _, _, ids, _ = self._rows(emb, maps, hi, lo, ids, 0, False)
        return self._logits(params, dense, self.coll.lookup(emb, ids)[0])  # (scored as evaluation scores them)

    def host_ids(self, ids: np.ndarray) -> np.ndarray:
        """The collection's ids of raw ids [n, F] (dynamic: placeholders the maps fill in)."""
        if self.kind == "hashed":
            return (ids % self.rows).astype(np.int32)
        if self.kind == "vocab":
            if self.vocab is None:  # the first window it sees: the vocabulary, counted once
                self.vocab = [_vocabulary(ids[:, f], int(self.rows[f])) for f in range(ids.shape[1])]
            return np.stack([_vocab_rows(ids[:, f], v) for f, v in enumerate(self.vocab)], axis=1)
        return np.zeros(ids.shape, np.int32)

    def batches(self, window, batch: int):
        ids = self.host_ids(window.ids)
        hi, lo = split_ids(window.ids)
        put = lambda x: jax.device_put(x, self.coll.batch_sharding)
        for s in range(0, len(ids) - batch + 1, batch):
            part = slice(s, s + batch)
            yield tuple(put(x[part]) for x in (window.dense, hi, lo, ids, window.labels))


def stream_maps(cfg, windows: list[StreamWindow], rows: float) -> list[MapSpec]:
    """Each feature's table for every case: ``rows`` rows (>= 1) or that fraction of the
    feature's distinct ids over the whole stream (< 1), rounded up to whole shards of its map
    (``embedding.dynamic``'s policy, probes, shards and admission)."""
    distinct = [len(np.unique(np.concatenate([w.ids[:, f] for w in windows]))) for f in range(windows[0].ids.shape[1])]
    return [MapSpec.sized(n, rows, cfg.embedding.dynamic.vshards, **map_fields(cfg)) for n in distinct]


def bench_stream(cfg, windows: list[StreamWindow], rows: float, cases=CASES, output=None, about=None, log=print):
    """Each case of ``cases`` trained on ``windows`` in order with the tables of
    :func:`stream_maps` (progressive validation); the report as JSON (``output``: written
    there too). ``about``: what the windows are, for the report."""
    check_stream_config(cfg)
    mesh = mesh_from_config(cfg)
    batch = cfg.train.batch_size
    maps = stream_maps(cfg, windows, rows)
    table_rows = sum(m.rows for m in maps)
    truth = [roc_auc(w.labels, w.p) for w in windows[1:]] if windows[0].p is not None else []
    distinct = sum(len(np.unique(np.concatenate([w.ids[:, f] for w in windows]))) for f in range(len(maps)))
    report = {
        "machine": machine_description(),
        "stream": about or {},
        "windows": len(windows),
        "window_samples": len(windows[0].labels),
        "rows_per_table": [m.rows for m in maps],
        "distinct_ids": distinct,
        "distinct_ids_per_row": distinct / table_rows,
        "map": {
            **maps[0]._asdict(),
            "rows": None,
            "bytes_per_row": maps[0].bytes_per_row(),
            "new_rows": cfg.embedding.dynamic.new_rows,
        },
        "ground_truth_auc": float(np.mean(truth[len(truth) // 2 :])) if truth else None,
        "ground_truth_windows": [{"window": t + 1, "auc": a} for t, a in enumerate(truth)],
        "cases": [],
    }
    shape = (len(maps), windows[0].dense.shape[1])
    for kind in each_case(cases):
        case = _Case(kind, cfg, shape, maps, mesh)
        out, trained, train_s, step, counts = [], 0, 0.0, 0, {"admitted": 0, "evicted": 0}
        for t, window in enumerate(each_case(windows)):
            if t:  # scored before it is trained on
                scores = [
                    np.asarray(case.scores(case.params, case.emb, case.maps, *b[:4]))
                    for b in case.batches(window, batch)
                ]
                z = np.concatenate(scores)
                labels = window.labels[: len(z)]
                out.append({"window": t, "auc": roc_auc(labels, z), "logloss": log_loss_of_logits(labels, z)})
            for b in case.batches(window, batch):
                start = time.perf_counter()
                case.params, case.opt_state, case.emb, case.maps, loss, totals = case.train_step(
                    case.params, case.opt_state, case.emb, case.maps, *b, step
                )
                float(loss)  # the step done
                if step:  # the first step compiles
                    train_s += time.perf_counter() - start
                    trained += batch
                counts = {k: counts[k] + int(totals.get(k, 0)) for k in counts}
                step += 1
        last = out[len(out) // 2 :]
        row = {
            "ids": kind,
            "windows": out,
            "mean_auc_last_half": float(np.mean([w["auc"] for w in last])),
            "samples_per_s": trained / train_s if train_s else float("nan"),
            **(counts if kind == "dynamic" else {"evicted": 0, "admitted": 0}),
        }
        report["cases"].append(row)
        truth_note = f" (ground truth {report['ground_truth_auc']:.4f})" if truth else ""
        log(
            f"{kind:8s} mean AUC over the last {len(last)} windows {row['mean_auc_last_half']:.4f}"
            f"{truth_note}, {row['samples_per_s']:,.0f} samples/s"
        )
    write_report(report, output)
    return report
