"""The dense layers spread over model groups: ``model.mlp_parallel`` data | tensor | pipeline.

A model group is ``mesh.model`` neighbouring devices (the mesh's ``model`` axis); there are
``data`` groups. The batch stays split over every device (the embedding exchange's layout), so
each device brings B / devices rows, and a group B / data.

- ``data``: every device holds every layer and runs its own rows; the dense gradients are
  all-reduced over every device.
- ``tensor`` (Megatron; the "horizontal" slicing of Krishna and Bahukhandi's *Multi-GPU Parallelism and Large Sparse Data Movement in DL Models*): consecutive MLP layers pair up
  (``model.mlp.pair_roles``): the first of a pair is column-parallel, its kernel [in, out] split
  by output columns over the group (``P(None, "model")``), the second row-parallel
  (``P("model", None)``). Before a pair the group's rows are all-gathered; each device computes
  its columns of the whole group's rows, then its rows of the second kernel; the pair's partial
  sums are reduce-scattered back to each device's own rows: one all-gather and one reduction per
  pair, and everything between pairs (interaction, ReLU) runs once per row. A low-rank cross
  layer's U, V are such a pair. Each device holds 1/model of each paired layer and its optimizer
  state. The PartitionSpecs are declared on the parameters (``tensor_param_specs``) and XLA
  places the collectives the activations' sharding constraints (``TensorLayout``) imply.
- ``pipeline`` (GPipe; the "vertical" placement): the layers are cut into ``mesh.model`` stages,
  one per device of a group (``PipelinePlan``). Stage 0 holds the bottom MLP, the interaction and
  the cross network (they need the embeddings) and the first top layers; the other stages the
  rest of the top MLP, cut so the stages hold about equal weights. The group's rows are split
  into ``model.microbatches`` microbatches that flow through the stages (one ``ppermute`` per
  tick, ``microbatches + stages - 1`` ticks; the backward pass runs the schedule in reverse).
  Stages differ in their layers' widths: each device keeps its stage's weights (and optimizer
  state) packed into one vector of the largest stage's length, unpacked by static offsets inside
  its stage's branch of a ``lax.switch``, and activations travel between stages padded to the
  widest cut. The padding (weights and the narrower cuts' activations) is memory and bandwidth
  spent for a uniform SPMD program; the bench reports what it costs. Checkpoints hold the
  parameters unpacked (``PipelinePlan.unpack``), so they restore in every mode.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.config_schema import ConfigError
from dlrm_jax.model.dlrm import DLRMDense, top_inputs
from dlrm_jax.model.mlp import linear, pair_roles
from dlrm_jax.parallel.mesh import AXIS, DATA_AXIS, MODEL_AXIS


class TensorLayout:
    """The activations' shardings around Megatron pairs (``model.mlp_parallel=tensor``)."""

    def __init__(self, mesh):
        self._gathered = NamedSharding(mesh, P(DATA_AXIS, None))  # a group's rows on each of its devices
        self._split = NamedSharding(mesh, P(DATA_AXIS, MODEL_AXIS))  # ... and a share of the columns
        self._rows = NamedSharding(mesh, P(AXIS, None))  # each device its own rows

    def gathered(self, x: jax.Array) -> jax.Array:
        return lax.with_sharding_constraint(x, self._gathered)

    def split(self, x: jax.Array) -> jax.Array:
        return lax.with_sharding_constraint(x, self._split)

    def rows(self, x: jax.Array) -> jax.Array:
        return lax.with_sharding_constraint(x, self._rows)


def _mlps(params: dict) -> tuple[str, ...]:
    """The MLPs with layers (Wide&Deep's bottom MLP has none: no parameters at all)."""
    return tuple(mlp for mlp in ("bottom", "top") if params.get(mlp, {}).get("layers"))


def tensor_param_specs(params: dict) -> dict:
    """PartitionSpecs of the dense parameters (``DLRMDense``'s pure dict) under tensor
    parallelism: column-parallel kernels and biases split by columns, row-parallel kernels by
    rows, the rest replicated."""
    specs = jax.tree.map(lambda _: P(), params)
    for mlp in _mlps(params):
        layers = params[mlp]["layers"]
        for i, role in zip(sorted(layers), pair_roles(len(layers)), strict=True):
            if role == "column":
                specs[mlp]["layers"][i] = {"kernel": P(None, MODEL_AXIS), "bias": P(MODEL_AXIS)}
            elif role == "row":
                specs[mlp]["layers"][i]["kernel"] = P(MODEL_AXIS, None)
    cross = params.get("cross", {})
    if "u" in cross:
        specs["cross"]["u"] = {i: P(None, MODEL_AXIS) for i in cross["u"]}
        specs["cross"]["v"] = {i: P(MODEL_AXIS, None) for i in cross["v"]}
    return specs


def check_tensor_widths(widths: dict[str, list[int]], rank: int, model: int) -> None:
    """Every split width must divide over the group: a ConfigError naming the key otherwise.
    ``widths``: each MLP's layers' output widths (``model.bottom_mlp``, ``model.top_mlp``);
    ``rank``: the low-rank cross layers' (0: none). Checked with the config
    (``train.checks.check_batch``, which ``build`` runs too), so that ``plan`` refuses what
    training would."""
    for mlp, outs in widths.items():
        for i, (width, role) in enumerate(zip(outs, pair_roles(len(outs)), strict=True)):
            if role == "column" and width % model:
                raise ConfigError(
                    f"model.{mlp}_mlp[{i}]={width}: model.mlp_parallel=tensor splits this layer's "
                    f"outputs over mesh.model={model} devices; use a multiple of {model}"
                )
    if rank % model:
        raise ConfigError(
            f"model.dcn_rank={rank}: model.mlp_parallel=tensor splits the cross layers' "
            f"rank over mesh.model={model} devices; use a multiple of {model}"
        )


def check_microbatches(batch_size: int, devices: int, model: int, microbatches: int) -> None:
    """model.microbatches must divide a model group's rows (``batch_size / (devices / model)``):
    checked with the config (``train.checks``), so that ``plan`` refuses what training would."""
    rows = batch_size // (devices // model)
    if rows % microbatches:
        raise ConfigError(
            f"model.microbatches={microbatches} must divide the {rows} rows of a "
            f"model group (train.batch_size / (devices / mesh.model))"
        )


class PipelinePlan:
    """Which layers each pipeline stage holds and where its weights sit in the packed vector.

    ``cuts[s]``: the first top-MLP layer of stage s (stage 0 also holds bottom, cross). Stages
    are contiguous and balanced by weight count (stage 0's fixed part counted); every stage
    after the first holds at least one top layer.
    """

    def __init__(self, model: DLRMDense, params: dict, stages: int, microbatches: int):
        top = params["top"]["layers"]
        if len(top) < stages - (1 if stages > 1 else 0):
            raise ConfigError(
                f"model.top_mlp has {len(top)} layers: model.mlp_parallel=pipeline needs at least "
                f"mesh.model - 1 = {stages - 1} of them (stage 0 holds the bottom MLP and interaction)"
            )
        self.stages, self.microbatches = stages, microbatches
        size = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
        head = size({k: v for k, v in params.items() if k != "top"})
        self.cuts = _balanced_cuts(head, [size(top[i]) for i in sorted(top)], stages)
        bounds = [*self.cuts, len(top)]
        # Stage s's leaves in order: (path in the pure dict, shape), and their offsets.
        self.leaves: list[list[tuple[tuple, tuple]]] = []
        for s in range(stages):
            mine = {k: v for k, v in params.items() if k != "top"} if s == 0 else {}
            mine = {**mine, "top": {"layers": {i: top[i] for i in range(bounds[s], bounds[s + 1])}}}
            self.leaves.append(
                [
                    (tuple(_key(k) for k in path), tuple(x.shape))
                    for path, x in jax.tree_util.tree_flatten_with_path(mine)[0]
                ]
            )
        self.length = max(1, max(sum(int(np.prod(shape)) for _, shape in stage) for stage in self.leaves))
        widths = [params["top"]["layers"][i]["kernel"].shape[0] for i in range(len(top))] + [1]
        self.width = max(widths[b] for b in bounds[1:])  # the widest activation between stages
        self.top_widths = widths
        self.bottom_def = nnx.split(model.bottom, nnx.Param)[0]
        self.cross_def = nnx.split(model.cross, nnx.Param)[0] if model.cross is not None else None
        self.interaction, self.dtype, self.top_layers = model.interaction, model.dtype, len(top)
        self.bounds = bounds

    # ------------------------------------------------------------------ packing
    def pack(self, params: dict) -> dict:
        """Pure dict -> {"stages": [stages, length]}: each stage's leaves raveled and padded."""
        rows = []
        for stage in self.leaves:
            flat = [_get(params, path).reshape(-1) for path, _ in stage]
            row = jnp.concatenate(flat) if flat else jnp.zeros((0,), jnp.float32)
            rows.append(jnp.pad(row, (0, self.length - row.shape[0])))
        return {"stages": jnp.stack(rows)}

    def unpack(self, packed: dict) -> dict:
        """{"stages": ...} -> the pure dict every other mode (and checkpoints) use."""
        out: dict = {}
        for s in range(self.stages):
            _merge(out, self._stage_params(packed["stages"][s], s))
        return out

    def _stage_params(self, row: jax.Array, s: int) -> dict:
        out: dict = {}
        offset = 0
        for path, shape in self.leaves[s]:
            n = int(np.prod(shape))
            _set(out, path, row[offset : offset + n].reshape(shape))
            offset += n
        return out

    # ------------------------------------------------------------------ schedule
    def logits(self, mesh, packed: dict, dense_bd: jax.Array, emb_bfd: jax.Array) -> jax.Array:
        """The GPipe forward over every model group: logits [B], split like the batch."""
        fn = jax.shard_map(
            partial(self._group_forward), mesh=mesh, in_specs=(P(MODEL_AXIS), P(AXIS), P(AXIS)), out_specs=P(AXIS)
        )
        return fn(packed["stages"], dense_bd, emb_bfd)

    def _group_forward(self, row, dense_bd, emb_bfd):
        stages, k = self.stages, self.microbatches
        stage = lax.axis_index(MODEL_AXIS)
        local = dense_bd.shape[0]
        dense = lax.all_gather(dense_bd, MODEL_AXIS, tiled=True)  # the group's rows, for stage 0
        emb = lax.all_gather(emb_bfd, MODEL_AXIS, tiled=True)
        mb = dense.shape[0] // k
        dense = dense.reshape(k, mb, *dense.shape[1:])
        emb = emb.reshape(k, mb, *emb.shape[1:])
        branches = [partial(self._stage_forward, s) for s in range(stages)]
        shift = [(i, i + 1) for i in range(stages - 1)]

        def tick(carry, t):
            received, outs = carry
            m = t - stage  # the microbatch this stage works on now
            i = jnp.clip(m, 0, k - 1)
            y = lax.switch(stage, branches, row[0], received, dense[i], emb[i])
            done = (m >= 0) & (m < k) & (stage == stages - 1)
            outs = outs.at[i].set(jnp.where(done, y[:, 0], outs[i]))
            return (lax.ppermute(y, MODEL_AXIS, shift) if stages > 1 else y, outs), None

        start = (jnp.zeros((mb, self.width), jnp.float32), jnp.zeros((k, mb), jnp.float32))
        start = jax.tree.map(lambda x: lax.pcast(x, AXIS, to="varying"), start)
        (_, outs), _ = lax.scan(tick, start, jnp.arange(k + stages - 1))
        logits = lax.psum(jnp.where(stage == stages - 1, outs, 0.0), MODEL_AXIS).reshape(-1)
        return lax.dynamic_slice_in_dim(logits, stage * local, local)  # this device's own rows

    def _stage_forward(self, s: int, row, received, dense_bd, emb_bfd):
        p = self._stage_params(row, s)
        if s == 0:
            bottom = nnx.merge(self.bottom_def, p.get("bottom", {}))  # (Wide&Deep's is empty)
            cross = nnx.merge(self.cross_def, p["cross"]) if self.cross_def is not None else None
            x = top_inputs(bottom, cross, self.interaction, self.dtype, dense_bd, emb_bfd)
        else:
            x = received[:, : self.top_widths[self.bounds[s]]].astype(self.dtype)
        for i in range(self.bounds[s], self.bounds[s + 1]):
            layer = p["top"]["layers"][i]
            x = linear(x, layer["kernel"], layer["bias"], self.dtype)
            if i < self.top_layers - 1:
                x = jax.nn.relu(x)
        x = x.astype(jnp.float32)
        return jnp.pad(x, ((0, 0), (0, self.width - x.shape[1])))


def _balanced_cuts(head: int, costs: list[int], stages: int) -> list[int]:
    """Contiguous cuts of the top layers into ``stages`` minimising the heaviest stage, stage 0
    starting with ``head`` weights and possibly no top layer, the others at least one."""
    n = len(costs)
    best: dict = {}

    def solve(s: int, start: int) -> tuple[int, list[int]]:  # stages s.. over layers start..
        if s == stages - 1:
            return sum(costs[start:]), [start]
        if (s, start) not in best:
            options = []
            for end in range(start + 1, n - (stages - 2 - s) + 1):
                rest, cuts = solve(s + 1, end)
                options.append((max(sum(costs[start:end]), rest), [start, *cuts]))
            best[s, start] = min(options)
        return best[s, start]

    if stages == 1:
        return [0]
    options = []
    for first in range(0, n - (stages - 1) + 1):  # stage 0's top layers: 0..first
        rest, cuts = solve(1, first)
        options.append((max(head + sum(costs[:first]), rest), [0, *cuts]))
    return min(options)[1]


def _key(k):
    return getattr(k, "key", getattr(k, "idx", k))


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _merge(into: dict, other: dict) -> None:
    for k, v in other.items():
        if isinstance(v, dict):
            _merge(into.setdefault(k, {}), v)
        else:
            into[k] = v
