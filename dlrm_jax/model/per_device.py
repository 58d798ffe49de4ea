"""A kernel XLA cannot split, run on each device's samples under jit's sharding."""

from __future__ import annotations

from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def per_batch_shard(fn, rule: str, out_spec, whole: tuple[int, ...] = ()):
    """``fn`` run on each device's samples under jit's sharding: every operand's first axis is
    the batch, split as the first operand's is, the other axes whole, except the operands at
    ``whole`` (weights), whole on every device (XLA cannot split a kernel: it would gather the
    batch to every device). ``rule``: Shardy's sharding rule, the batch factor ``b``;
    ``out_spec(batch)``: the result's PartitionSpec (a tuple of them for several results)."""
    wrapped = custom_partitioning(fn)

    def shardings(mesh, arg_shapes):
        spec = arg_shapes[0].sharding.spec
        batch = spec[0] if len(spec) else None
        args = tuple(
            NamedSharding(mesh, P() if i in whole else P(batch, *(None,) * (len(a.shape) - 1)))
            for i, a in enumerate(arg_shapes)
        )
        out = out_spec(batch)
        return args, tuple(NamedSharding(mesh, o) for o in out) if isinstance(out, tuple) else NamedSharding(mesh, out)

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[1]

    def partition(mesh, arg_shapes, result_shape):
        args, out = shardings(mesh, arg_shapes)
        return mesh, fn, out, args

    factors = rule.replace("->", " ").replace(",", " ").split()
    others = tuple(f for f in dict.fromkeys(factors) if f != "b")  # (in the order they appear: Shardy's)
    wrapped.def_partition(
        partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule, need_replication_factors=others
    )
    return wrapped
