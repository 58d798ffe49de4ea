"""``dlrm-jax bench stream``: the same model trained on the same time-ordered stream (the
drifting synthetic stream, data/sources/drifting.py) with three ways of turning raw ids into
rows, at equal table rows, judged by progressive validation: each window is scored before it
is trained on.

- ``dynamic``: each table's id map (embedding/dynamic): a row per id while it is live,
  evicted by the policy, admitted after ``admit`` sightings;
- ``hashed``: row = raw id mod rows (unrelated ids share rows);
- ``vocab``: the first window's ``rows - 1`` most frequent ids of each feature get rows, every
  other id the out-of-vocabulary row (a vocabulary counted once, before training).

The report: per case and window its AUC and logloss, the mean AUC over the last half of the
windows, training samples/s, and (dynamic) ids admitted and rows evicted; the ground truth's
AUC per window (the stream's true probabilities: no model does better).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dlrm_jax.bench.common import machine_description, write_report
from dlrm_jax.data.sources.drifting import DriftingStream
from dlrm_jax.embedding.dynamic.idmap import MapSpec, split_ids
from dlrm_jax.embedding.exchange.collection import EmbeddingCollection
from dlrm_jax.embedding.exchange.dynamic_tables import DynamicTables
from dlrm_jax.embedding.plan.planner import plan_embeddings
from dlrm_jax.embedding.plan.specs import TableSpec
from dlrm_jax.model.dlrm import DLRMDense, bce_loss
from dlrm_jax.observe.metrics import roc_auc
from dlrm_jax.train.build import mesh_from_config
from dlrm_jax.train.wiring import sparse_optimizer_from_config

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

    def __init__(self, kind: str, cfg, stream: DriftingStream, rows: int, map_spec: MapSpec, mesh):
        self.kind, self.rows, self.stream = kind, rows, stream
        n = mesh.size
        specs = [TableSpec(f"cat_{f}", rows, cfg.model.embedding_dim, 1) for f in range(stream.features)]
        plan = plan_embeddings(specs, "row", n, cfg.embedding.optimizer, cfg.train.batch_size)
        self.coll = EmbeddingCollection(plan, mesh, sparse_optimizer_from_config(cfg))
        self.dyn = (
            DynamicTables(self.coll, dict.fromkeys(range(stream.features), map_spec)) if kind == "dynamic" else None
        )
        m = cfg.model
        model = DLRMDense(
            num_dense=stream.num_dense,
            num_features=stream.features,
            embedding_dim=m.embedding_dim,
            bottom_mlp=m.bottom_mlp,
            top_mlp=m.top_mlp,
            interaction=m.interaction,
            rngs=nnx.Rngs(cfg.train.seed),
        )
        self.graphdef, params = nnx.split(model, nnx.Param)
        self.params = nnx.to_pure_dict(params)
        self.tx = optax.adam(cfg.train.learning_rate)
        self.opt_state = self.tx.init(self.params)
        self.key = jax.random.key(cfg.train.seed)
        self.emb = self.coll.init(self.key)
        self.maps = self.dyn.init_maps() if self.dyn else {}
        self.emb_lr = jnp.float32(cfg.embedding_learning_rate)
        self.vocab = None
        self.train_step, self.scores = jax.jit(self._train_step, donate_argnums=(0, 1, 2)), jax.jit(self._scores)

    def _rows(self, emb, maps, hi, lo, ids, step, learn):
        stats = {}
        if self.dyn is not None:
            raw = {
                f: (hi[:, f : f + 1], lo[:, f : f + 1], jnp.ones_like(hi[:, f : f + 1], bool))
                for f in range(hi.shape[1])
            }
            emb, maps, ids, stats = self.dyn.resolve(emb, maps, raw, ids, step, self.key, learn)
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
        return jax.nn.sigmoid(self._logits(params, dense, self.coll.lookup(emb, ids)[0]))

    def host_ids(self, ids: np.ndarray) -> np.ndarray:
        """The collection's ids of raw ids [n, F] (dynamic: placeholders the maps fill in)."""
        if self.kind == "hashed":
            return (ids % np.uint64(self.rows)).astype(np.int32)
        if self.kind == "vocab":
            if self.vocab is None:  # the first window it sees: the vocabulary, counted once
                self.vocab = [_vocabulary(ids[:, f], self.rows) for f in range(ids.shape[1])]
            return np.stack([_vocab_rows(ids[:, f], v) for f, v in enumerate(self.vocab)], axis=1)
        return np.zeros(ids.shape, np.int32)

    def batches(self, window, batch: int):
        ids = self.host_ids(window.ids)
        hi, lo = split_ids(window.ids)
        put = lambda x: jax.device_put(x, self.coll.batch_sharding)
        for s in range(0, len(ids) - batch + 1, batch):
            part = slice(s, s + batch)
            yield tuple(put(x[part]) for x in (window.dense, hi, lo, ids, window.labels))


def _logloss(labels: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p.astype(np.float64), 1e-7, 1 - 1e-7)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


def bench_stream(cfg, stream: DriftingStream, rows: int, map_spec: MapSpec, cases=CASES, output=None, log=print):
    """Each case of ``cases`` trained on ``stream`` with ``rows`` rows per table (progressive
    validation); the report as JSON (``output``: written there too)."""
    mesh = mesh_from_config(cfg)
    batch = cfg.train.batch_size
    windows = [stream.window(t) for t in range(stream.windows)]
    truth = [roc_auc(w.labels, w.p) for w in windows[1:]]
    distinct = sum(len(np.unique(np.concatenate([w.ids[:, f] for w in windows]))) for f in range(stream.features))
    report = {
        "machine": machine_description(),
        "stream": {k: getattr(stream, k) for k in stream.__dataclass_fields__},
        "rows_per_table": rows,
        "distinct_ids": distinct,
        "distinct_ids_per_row": distinct / (rows * stream.features),
        "map": {**map_spec._asdict(), "bytes_per_row": map_spec.bytes_per_row()},
        "ground_truth_auc": float(np.mean(truth[len(truth) // 2 :])),
        "ground_truth_windows": [{"window": t + 1, "auc": a} for t, a in enumerate(truth)],
        "cases": [],
    }
    for kind in cases:
        case = _Case(kind, cfg, stream, rows, map_spec, mesh)
        out, trained, train_s, step, counts = [], 0, 0.0, 0, {"admitted": 0, "evicted": 0}
        for t, window in enumerate(windows):
            if t:  # scored before it is trained on
                scores = [
                    np.asarray(case.scores(case.params, case.emb, case.maps, *b[:4]))
                    for b in case.batches(window, batch)
                ]
                p = np.concatenate(scores)
                labels = window.labels[: len(p)]
                out.append({"window": t, "auc": roc_auc(labels, p), "logloss": _logloss(labels, p)})
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
        log(
            f"{kind:8s} mean AUC over the last {len(last)} windows {row['mean_auc_last_half']:.4f} "
            f"(ground truth {report['ground_truth_auc']:.4f}), {row['samples_per_s']:,.0f} samples/s"
        )
    log(write_report(report, output) if output else "")
    return report
