"""The optimizers a config asks for: the tables' sparse optimizer (and the wide part's), the
dense part's optax optimizer, the learning-rate schedule they share, and the warning when a
resume with another ``train.steps`` moves that schedule. Part of the edge (setup wing): the
run wing takes what these make, never the config."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dlrm_jax.config import Config, ConfigError
from dlrm_jax.embedding.exchange.optimizers import SparseOptimizer, sparse_optimizer_taking


def sparse_optimizer_from_config(cfg: Config) -> SparseOptimizer:
    """The tables' optimizer: ``embedding.optimizer`` with its ``embedding.adagrad_*`` settings,
    ``embedding.deterministic``, ``embedding.sparse_update`` and ``embedding.fused_programs``."""
    e = cfg.embedding
    optimizer = sparse_optimizer_taking(e.optimizer, _sparse_settings(cfg) | {"kernel": fused_sparse_update(cfg)})
    return optimizer._replace(kernel_programs=e.fused_programs)


def fused_sparse_update(cfg: Config) -> bool:
    """Whether the tables' update runs the fused Pallas kernels: ``embedding.sparse_update``,
    where ``auto`` means on GPUs (where they were measured faster; off GPUs Pallas only
    interprets them)."""
    choice = cfg.embedding.sparse_update
    return choice == "fused" or (choice == "auto" and jax.default_backend() == "gpu")


def wide_optimizer_from_config(cfg: Config) -> SparseOptimizer:
    """The wide part's optimizer (model.kind=wide_deep): model.wide.optimizer."""
    return sparse_optimizer_taking(cfg.model.wide.optimizer, _sparse_settings(cfg))


def _sparse_settings(cfg: Config) -> dict:
    """Every sparse optimizer's settings in the config; each takes those it names."""
    e, m = cfg.embedding, cfg.model
    return dict(
        eps=e.adagrad_eps,
        initial_accumulator=e.adagrad_initial_accumulator,
        l1=m.wide.l1,
        l2=m.wide.l2,
        exact_sums=e.deterministic,
    )


def learning_rate_schedule(cfg) -> optax.Schedule:
    """Linear warmup (step k of ``warmup_steps``, from 1, at k / warmup_steps of the rate),
    constant, then polynomial decay to 0 over ``decay_steps`` from ``decay_start`` (0: the
    run's last steps). Its steps are counted from 0: the rate of step k is the schedule's at
    k - 1."""
    t = cfg.train
    lr = t.learning_rate
    pieces, boundaries = [], []
    if t.warmup_steps > 1:  # (a warmup of one step is at the full rate)
        pieces.append(optax.linear_schedule(lr / t.warmup_steps, lr, t.warmup_steps - 1))
        boundaries.append(t.warmup_steps)
    pieces.append(optax.constant_schedule(lr))
    if t.decay_steps:
        boundaries.append(t.decay_start or t.steps - t.decay_steps)
        pieces.append(optax.polynomial_schedule(lr, 0.0, t.decay_power, t.decay_steps))
    return optax.join_schedules(pieces, boundaries) if boundaries else pieces[0]


def adagrad(schedule: optax.Schedule, eps: float = 1e-8) -> optax.GradientTransformation:
    """Adagrad as torch's, the MLPerf references' and the tables' (``exchange.optimizers``):
    each step ``g / (sqrt(sum of squares) + eps)``, the sums from 0. ``optax.adagrad`` adds
    ``eps`` inside the root, which damped gradients below about sqrt(eps) = 1e-4 (a third of
    the dense weights' first updates at under 0.9 of the rate). Its state is optax's
    ``ScaleByRssState``, as ``optax.adagrad``'s was: earlier checkpoints restore."""

    def init(params):
        return optax.ScaleByRssState(sum_of_squares=jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        sums = jax.tree.map(lambda g, a: a + g * g, updates, state.sum_of_squares)
        return jax.tree.map(lambda g, a: g / (jnp.sqrt(a) + eps), updates, sums), optax.ScaleByRssState(sums)

    return optax.chain(optax.GradientTransformation(init, update), optax.scale_by_learning_rate(schedule))


DENSE_OPTIMIZERS = {  # train.optimizer's values (the schema lists the same names)
    "sgd": optax.sgd,
    "adagrad": adagrad,
    "adam": optax.adam,
}


def dense_optimizer(cfg, schedule: optax.Schedule) -> optax.GradientTransformation:
    """The dense part's optax optimizer (``train.optimizer``); another name is a ConfigError,
    not a silent Adam."""
    make = DENSE_OPTIMIZERS.get(cfg.train.optimizer)
    if make is None:
        raise ConfigError(f"train.optimizer={cfg.train.optimizer!r} is not one of {', '.join(DENSE_OPTIMIZERS)}")
    return make(schedule)


def decay_moved(old, new, start: int) -> str:
    """A warning where a run resumed at ``start`` with ``train.steps`` changed (``old`` ->
    ``new`` config) trained its steps so far at rates the new schedule would not have given:
    the decay (``train.decay_steps``) is at a run's end, so raising or lowering the end moves
    it, and the resumed run no longer equals one of the new length from the start; '' where
    the rates so far agree (the decay had not begun)."""
    keys = ("learning_rate", "warmup_steps", "decay_steps", "decay_start", "decay_power")
    if old.train.steps == new.train.steps or any(getattr(old.train, k) != getattr(new.train, k) for k in keys):
        return ""  # (a change of the rate itself is named among the changed settings)
    counts = np.arange(start)
    was, now = (np.asarray(learning_rate_schedule(c)(counts)) for c in (old, new))
    differ = np.flatnonzero(~np.isclose(was, now, rtol=1e-6, atol=0))
    if not len(differ):
        return ""
    first = int(differ[0]) + 1
    return (
        f"warning: train.steps {old.train.steps} -> {new.train.steps} moves the learning rate's decay "
        f"(train.decay_steps={new.train.decay_steps}, over a run's last steps): steps {first}-{start} trained at "
        f"the rates of a {old.train.steps}-step run ({was[-1]:.4g} at step {start}), and this run goes on at a "
        f"{new.train.steps}-step run's ({float(learning_rate_schedule(new)(start)):.4g} at step {start + 1}): it "
        f"will not equal a run of {new.train.steps} steps from the start"
    )
