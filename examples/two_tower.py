"""Two-tower retrieval on dlrm_jax's sharded embedding tables, in a jitted step of your own.

A user tower (user id, region, and the bag of items the user clicked before) and an item tower
(item id, topic), each a few embedding tables and a small Flax NNX MLP, trained with an
in-batch softmax on synthetic clicks. The embedding pieces are dlrm_jax's public ones:

    TableSpec             what each table is: rows, width, bag size, pooling
    plan_embeddings       where each table lives on the mesh (row-wise, small ones table-wise)
    EmbeddingCollection   the sharded lookup, and the sparse update of the looked-up rows

The whole step -- lookup, both towers forward and backward, optax on the towers, sparse Adagrad
on the tables' looked-up rows -- is one ``jax.jit`` over the mesh. Run it with

    python examples/two_tower.py [--steps 300] [--devices 8]

(8 simulated devices on a CPU-only machine; every GPU otherwise). It prints the plan, then the
loss and the in-batch recall@10 on held-out clicks (chance: 10 / batch size) as it trains.
"""

from __future__ import annotations

import dlrm_jax

dlrm_jax.request_cpu_devices(8)  # a CPU-only machine gets 8 simulated devices: before JAX starts

import argparse
import dataclasses
import time
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Settings:
    steps: int = 300
    batch_size: int = 256  # global: split over the devices
    devices: int = 0  # 0: every device
    seed: int = 0
    # data
    users: int = 5_000
    topics: int = 32
    items_per_topic: int = 250  # items: topics x items_per_topic
    regions: int = 128
    history: int = 6  # clicked items in a user's bag (fewer: padded)
    # model
    dim: int = 32  # every table's width
    hidden: int = 128
    out: int = 32  # the towers' shared space
    temperature: float = 0.05
    # optimizers
    dense_lr: float = 2e-3  # optax Adam on the towers
    sparse_lr: float = 0.05  # Adagrad on the looked-up rows
    sharding: str = "row"
    # evaluation
    eval_every: int = 50
    eval_batches: int = 4
    k: int = 10


# ----------------------------------------------------------------------------- tables
USER_TABLES = ("user_id", "user_region", "user_history")
ITEM_TABLES = ("item_id", "item_topic")


def table_specs(s: Settings) -> list[dlrm_jax.TableSpec]:
    """The user tower's tables first, then the item tower's; the batch's id columns follow
    this order (user_history takes ``s.history`` columns, the others one each)."""
    items = s.topics * s.items_per_topic
    return [
        dlrm_jax.TableSpec("user_id", s.users, s.dim),
        dlrm_jax.TableSpec("user_region", s.regions, s.dim),
        dlrm_jax.TableSpec("user_history", items, s.dim, bag_size=s.history, pooling="mean"),
        dlrm_jax.TableSpec("item_id", items, s.dim),
        dlrm_jax.TableSpec("item_topic", s.topics, s.dim),
    ]


def item_column(s: Settings) -> int:
    """The batch column holding the clicked item's id."""
    return 2 + s.history


def plan_tables(s: Settings, devices: int) -> dlrm_jax.EmbeddingPlan:
    """Large tables split by rows over every device, the two small ones whole on one device."""
    return dlrm_jax.plan_embeddings(
        table_specs(s),
        s.sharding,
        devices,
        "adagrad",
        s.batch_size,
        overrides={"user_region": "table", "item_topic": "table"},
    )


# ----------------------------------------------------------------------------- data
class Clicks:
    """Synthetic (user, clicked item) pairs. Each user has a hidden topic and clicks its items
    80% of the time, popular ones more often; item i's topic is i % topics, and a user's region
    tells its topic 70% of the time. Batch ``step`` is a pure function of (seed, step)."""

    def __init__(self, s: Settings):
        self.s = s
        rng = np.random.default_rng(s.seed)
        self.topic = rng.integers(0, s.topics, s.users)
        per_topic = s.regions // s.topics
        region = self.topic * per_topic + rng.integers(0, per_topic, s.users)
        self.region = np.where(rng.random(s.users) < 0.7, region, rng.integers(0, s.regions, s.users))

    def _clicked(self, rng: np.random.Generator, users: np.ndarray, n: int) -> np.ndarray:
        """n clicked items of each user: int [len(users), n]."""
        s = self.s
        own = rng.random((len(users), n)) < 0.8
        topic = np.where(own, self.topic[users, None], rng.integers(0, s.topics, (len(users), n)))
        rank = (s.items_per_topic * rng.random((len(users), n)) ** 3).astype(np.int64)  # popular first
        return rank * s.topics + topic

    def batch(self, step: int) -> np.ndarray:
        """ids int32 [B, 4 + history]: user, region, history bag (PAD_ID past its length), item, topic."""
        s = self.s
        rng = np.random.default_rng([s.seed, step])
        users = rng.integers(0, s.users, s.batch_size)
        clicked = self._clicked(rng, users, 1 + s.history)
        item, history = clicked[:, 0], clicked[:, 1:]
        length = rng.integers(1, s.history + 1, s.batch_size)
        history = np.where(np.arange(s.history) < length[:, None], history, dlrm_jax.PAD_ID)
        columns = [users[:, None], self.region[users, None], history, item[:, None], item[:, None] % s.topics]
        return np.concatenate(columns, axis=1).astype(np.int32)

    def held_out(self, i: int) -> np.ndarray:
        """Evaluation batches: steps training never reads."""
        return self.batch(10**9 + i)


# ----------------------------------------------------------------------------- model
class Tower(nnx.Module):
    """Pooled embeddings [B, F, D] -> unit vectors [B, out] through one hidden layer."""

    def __init__(self, features: int, s: Settings, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(features * s.dim, s.hidden, rngs=rngs)
        self.out = nnx.Linear(s.hidden, s.out, rngs=rngs)

    def __call__(self, pooled_bfd: jax.Array) -> jax.Array:
        x = self.out(nnx.relu(self.hidden(pooled_bfd.reshape(pooled_bfd.shape[0], -1))))
        return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


class TwoTower(nnx.Module):
    """The collection's pooled vectors [B, F, D] (user tables first) -> (user [B, K], item [B, K])."""

    def __init__(self, s: Settings, rngs: nnx.Rngs):
        self.user = Tower(len(USER_TABLES), s, rngs)
        self.item = Tower(len(ITEM_TABLES), s, rngs)

    def __call__(self, pooled_bfd: jax.Array) -> tuple[jax.Array, jax.Array]:
        u = len(USER_TABLES)
        return self.user(pooled_bfd[:, :u]), self.item(pooled_bfd[:, u:])


def in_batch_softmax_loss(user_bk, item_bk, item_b, temperature: float) -> jax.Array:
    """Each user's clicked item against the batch's other items: softmax cross-entropy over
    the [B, B] scores; other rows holding the same item are not counted as negatives."""
    logits = user_bk @ item_bk.T / temperature
    same = (item_b[:, None] == item_b[None, :]) & ~jnp.eye(item_b.shape[0], dtype=bool)
    logits = jnp.where(same, -1e9, logits)
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.arange(item_b.shape[0])).mean()


def recall_at_k(user_bk, item_bk, item_b, k: int) -> jax.Array:
    """The fraction of users whose clicked item is among the k best-scored distinct items of
    the batch (chance: about k / B)."""
    scores = user_bk @ item_bk.T
    other = item_b[None, :] != item_b[:, None]
    better = jnp.sum((scores > jnp.diagonal(scores)[:, None]) & other, axis=1)
    return jnp.mean((better < k).astype(jnp.float32))


def loss_fn(graphdef: nnx.GraphDef, s: Settings, params, pooled_bfd, ids_bs) -> jax.Array:
    """The model's loss from the looked-up vectors: what the step differentiates, w.r.t. the
    towers' ``params`` and ``pooled_bfd`` (never the tables themselves)."""
    user_bk, item_bk = nnx.merge(graphdef, params)(pooled_bfd)
    return in_batch_softmax_loss(user_bk, item_bk, ids_bs[:, item_column(s)], s.temperature)


# ----------------------------------------------------------------------------- training
class TrainState(NamedTuple):
    params: dict  # the towers' weights (replicated)
    opt_state: optax.OptState  # their Adam state (replicated)
    tables: dlrm_jax.EmbeddingState  # the tables and their Adagrad state, as the plan shards them


class Parts(NamedTuple):
    tables: dlrm_jax.EmbeddingCollection
    graphdef: nnx.GraphDef
    state: TrainState
    train_step: Callable  # (state, ids_bs) -> (state, loss); donates state
    eval_step: Callable  # (state, ids_bs) -> (loss, recall@k)


def dense_optimizer(s: Settings) -> optax.GradientTransformation:
    return optax.adam(s.dense_lr)


def build(s: Settings, mesh: jax.sharding.Mesh) -> Parts:
    """The tables on the mesh, the towers, the initial state and the two jitted steps."""
    plan = plan_tables(s, mesh.size)
    tables = dlrm_jax.EmbeddingCollection(plan, mesh)  # the plan's optimizer: Adagrad
    graphdef, params = nnx.split(TwoTower(s, nnx.Rngs(s.seed)), nnx.Param)
    tx = dense_optimizer(s)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(nnx.to_pure_dict(params), replicated)
    state = TrainState(params, jax.jit(tx.init, out_shardings=replicated)(params), tables.init(jax.random.key(s.seed)))

    def train_step(state: TrainState, ids_bs: jax.Array):
        pooled_bfd, res = tables.lookup(state.tables, ids_bs)  # all-to-all to the rows' owners and back
        loss, (grads, grad_bfd) = jax.value_and_grad(partial(loss_fn, graphdef, s), argnums=(0, 1))(
            state.params, pooled_bfd, ids_bs
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        emb = tables.apply_gradients(state.tables, res, grad_bfd, s.sparse_lr)  # looked-up rows only
        return TrainState(params, opt_state, emb), loss

    def eval_step(state: TrainState, ids_bs: jax.Array):
        pooled_bfd, _ = tables.lookup(state.tables, ids_bs)
        user_bk, item_bk = nnx.merge(graphdef, state.params)(pooled_bfd)
        item_b = ids_bs[:, item_column(s)]
        return (
            in_batch_softmax_loss(user_bk, item_bk, item_b, s.temperature),
            recall_at_k(user_bk, item_bk, item_b, s.k),
        )

    shardings = jax.tree.map(lambda x: x.sharding, state)  # the tables keep the plan's layout
    batch = tables.batch_sharding
    return Parts(
        tables,
        graphdef,
        state,
        jax.jit(train_step, in_shardings=(shardings, batch), out_shardings=(shardings, replicated), donate_argnums=0),
        jax.jit(eval_step, in_shardings=(shardings, batch), out_shardings=replicated),
    )


def evaluate(parts: Parts, state: TrainState, data: Clicks, s: Settings) -> tuple[float, float]:
    """(loss, recall@k) averaged over ``s.eval_batches`` held-out batches."""
    out = [
        parts.eval_step(state, jax.device_put(data.held_out(i), parts.tables.batch_sharding))
        for i in range(s.eval_batches)
    ]
    return tuple(float(np.mean([o[j] for o in out])) for j in range(2))


def train(s: Settings, log: Callable[[str], None] = print) -> list[dict]:
    """Trains for ``s.steps`` steps; returns the evaluations ({step, loss, recall})."""
    mesh = dlrm_jax.make_mesh(s.devices)
    parts = build(s, mesh)
    log(dlrm_jax.plan_report(parts.tables.plan))
    data, state, history = Clicks(s), parts.state, []
    chance = s.k / s.batch_size
    start = time.perf_counter()
    for step in range(s.steps + 1):
        if step % s.eval_every == 0 or step == s.steps:
            loss, recall = evaluate(parts, state, data, s)
            history.append({"step": step, "loss": loss, "recall": recall})
            log(f"step {step:5d}  held-out loss {loss:.4f}  recall@{s.k} {recall:.3f} (chance {chance:.3f})")
        if step < s.steps:
            state, _ = parts.train_step(state, jax.device_put(data.batch(step), parts.tables.batch_sharding))
    seconds = time.perf_counter() - start
    log(
        f"final step={s.steps} loss={loss:.6f} recall@{s.k}={recall:.4f} chance={chance:.4f} "
        f"devices={mesh.size} seconds={seconds:.1f}"
    )
    return history


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Settings):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    s = Settings(**vars(parser.parse_args(argv)))
    problem = settings_problem(s, len(jax.devices()))
    if problem:
        parser.error(problem)
    train(s)


def settings_problem(s: Settings, available: int) -> str:
    """What makes ``s`` untrainable here, in one line ('' if nothing)."""
    counts = ("steps", "batch_size", "users", "topics", "items_per_topic", "regions", "history", "dim", "hidden")
    small = [name for name in (*counts, "out", "eval_every", "eval_batches", "k") if getattr(s, name) < 1]
    devices = s.devices or available
    if small:
        return f"--{small[0].replace('_', '-')} {getattr(s, small[0])}: expected an integer >= 1"
    if not 0 <= s.devices <= available:
        return f"--devices {s.devices}: 0 (all) to the {available} devices here"
    if s.batch_size % devices:
        return f"--batch-size {s.batch_size}: a multiple of the {devices} devices"
    if s.k > s.batch_size:
        return f"--k {s.k}: at most --batch-size {s.batch_size} (recall@k ranks the batch's items)"
    if s.sharding not in ("row", "table", "column", "replicated"):
        return f"--sharding {s.sharding}: one of row, table, column, replicated"
    return ""


if __name__ == "__main__":
    main()
