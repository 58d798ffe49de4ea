"""The divergence check: per-step losses read on the host, and states scored before a save."""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np

from dlrm_jax.embedding.dynamic.idmap import STATS
from dlrm_jax.parallel.mesh import host_scalar


def read_back(metrics: dict) -> jax.Array:
    """uint32 [k]: what the host reads of every train step (:meth:`LossWatch.add`) in one array,
    so one transfer and one wait a step, not one per scalar (on GPUs each is a copy and a wait,
    and each wait gives the GIL to the input threads): the loss's bits, the exchange's
    overflow, then the hot rows' [hits, lookups] and the dynamic tables' counts and path
    where the step has them. Traced, inside the step."""
    loss_bits = jax.lax.bitcast_convert_type(jnp.asarray(metrics["loss"], jnp.float32), jnp.uint32)
    parts = [loss_bits.reshape(1), jnp.asarray(metrics["exchange_overflows"]).astype(jnp.uint32).reshape(1)]
    for key in ("hot_counts", "id_map_counts", "id_route"):
        if key in metrics:
            parts.append(jnp.asarray(metrics[key]).astype(jnp.uint32).reshape(-1))
    return jnp.concatenate(parts)


_FRESH_LOSS_FAR = 20.0  # a first logloss above it: the logits start at tens, not near 0


class TrainingDiverged(FloatingPointError):
    """The loss became non-finite or grew past train.max_loss_ratio x its starting value."""


class LossWatch:
    """Per-step losses read on the host: window sums, and the divergence check.

    ``reference``: the loss the limit is a multiple of, the first step's of the run that
    started the lineage (kept with every checkpoint: a resumed run does not start afresh from
    its own first loss, which may already be a bad state's); None: this run's first loss."""

    def __init__(self, max_ratio: float, reference: float | None = None):
        self.max_ratio, self.reference = max_ratio, reference
        self.total, self.steps, self.overflows = 0.0, 0, 0
        self.hot_hits, self.lookups = 0, 0
        self.id_maps = np.zeros(len(STATS), np.int64)
        self.id_routes = collections.Counter()  # steps by the resolution's path

    def add(self, step: int, out) -> None:
        words = np.asarray(out["read_back"].addressable_data(0))  # waits for that step only
        loss = float(words[:1].view(np.float32)[0])
        if self.reference is None:
            self.reference = loss
        self._check(loss, f"training diverged at step {step}: loss {loss:.6g}")
        self.total, self.steps = self.total + loss, self.steps + 1
        self.overflows += int(words[1])
        rest = words[2:].astype(np.int64)  # in read_back's order
        if "hot_counts" in out:
            self.hot_hits, self.lookups = self.hot_hits + int(rest[0]), self.lookups + int(rest[1])
            rest = rest[2:]
        if "id_map_counts" in out:
            self.id_maps += rest[: len(STATS)]
            self.id_routes[int(rest[len(STATS)])] += 1
        if "host_id_map_counts" in out:  # tiered dynamic tables' maps, on the host
            self.id_maps += out["host_id_map_counts"]

    def check_state(self, step: int, check: tuple[jax.Array, jax.Array]) -> None:
        """Raises unless the state after ``step``, about to be saved, is sound: every value
        finite and its loss on the step's batch within the limit (``StepFunctions.state_check``).
        A step's update shows only in the next step's loss: the losses checked so far miss it."""
        loss, finite = host_scalar(check[0]), host_scalar(check[1])
        what = "non-finite values" if not finite else f"loss {loss:.6g} on that step's batch"
        self._check(
            loss if finite else math.nan,
            f"training diverged at step {step}: the state after it has {what}; it was not saved",
        )

    def _check(self, loss: float, what: str) -> None:
        if not math.isfinite(loss) or (self.max_ratio and loss > self.max_ratio * max(self.reference, 1e-3)):
            limit = (
                f"train.max_loss_ratio={self.max_ratio:g}x" if self.max_ratio else "no limit: train.max_loss_ratio=0"
            )
            # A fresh model's logloss is near ln 2; one far above it came from the inputs, not
            # from steps too large (dense values of 1e30 were blamed on the learning rate)
            advice = (
                f"the starting loss is far above a fresh model's ({math.log(2):.2f}): inputs out of scale? (dense "
                "features in the thousands or more: normalise them, e.g. log1p as preprocessing does)"
                if self.reference > _FRESH_LOSS_FAR
                else "lower train.learning_rate or warm up to it (train.warmup_steps)"
            )
            raise TrainingDiverged(
                f"{what} (starting loss {self.reference:.6g}, {limit}); nothing after the last checkpoint was "
                f"saved; {advice}"
            )

    def take_id_maps(self) -> dict:
        """The dynamic tables' counts since the last call (empty without dynamic tables): ids
        looked up, found in their maps, admitted (given a row), rows evicted, ids held back by
        admission and ids that found no free slot, and the share of lookups found."""
        counts = dict(zip(STATS, self.id_maps.tolist(), strict=True))
        self.id_maps[:] = 0
        if not counts["lookups"]:
            return {}
        return {f"ids_{k}": v for k, v in counts.items()} | {"ids_found_rate": counts["found"] / counts["lookups"]}

    def take_id_routes(self) -> dict[int, int]:
        """Steps since the last call by the path their raw ids were resolved on (an index into
        ``DynamicTables.resolution_paths``; empty without dynamic tables on the devices)."""
        out, self.id_routes = dict(self.id_routes), collections.Counter()
        return out

    def take_window(self) -> tuple[float, int, int, float]:
        """(mean loss, steps, exchange overflows, hot hit rate) of the steps since the last call."""
        out = (self.total / self.steps, self.steps, self.overflows, self.hot_hits / max(self.lookups, 1))
        self.total, self.steps, self.overflows, self.hot_hits, self.lookups = 0.0, 0, 0, 0, 0
        return out
