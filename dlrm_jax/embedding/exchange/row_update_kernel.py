"""The sparse update as fused GPU kernels (Pallas, Triton): each distinct row's gradient summed
from its lookups' pooled gradients in a fixed order and the optimizer applied to the row, in
one pass, with no gradient row written to memory per lookup or per distinct row.

XLA cannot fuse a sum over a row's lookups into the scatter that updates the row: its form
(``row_grads.sum_by_row`` then ``SparseOptimizer.apply``) writes the distinct rows' sums to
memory and, on a GPU, adds a row's lookups with float atomics (fast, but in any order). Here,
after the one sort by row (``sort_by_row``, XLA's):

row kernel    one program per distinct row: reads its lookups' pooled gradients, BLOCK at a
              time in their sorted order, sums them in registers, then reads the row and its
              state, applies ``RowStep`` (the optimizer's own arithmetic, shared with the XLA
              form) and writes them back, once.
chunk kernel  a row with more than LONG lookups (a hot id: a Zipf batch can hold one id
              hundreds of thousands of times) would keep one program busy for the whole
              step, so its lookups are first summed in chunks of LONG, one program each,
              and its program adds the chunks' sums in order.

Every sum runs in an order fixed by the sorted lookups, so a run gives the same bits every
time; the order differs from the XLA form's (blocks, then chunks), so the two agree to
rounding. On other backends the kernels run in Pallas's interpreter (the tests' path).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dlrm_jax.embedding.exchange.row_grads import Lookups, sort_by_row

BLOCK = 16  # lookups read per iteration: one [BLOCK, W] gather of pooled gradients
LONG = 512  # a row with more lookups than this is summed in chunks of this many first
WARPS = 1  # per program
PLACES = 4  # distinct rows per program of the row kernel (fewer, longer programs than one each)


def applies(table: jax.Array, grads: jax.Array) -> bool:
    """Whether the kernels take this table: rows of a power-of-two width (Triton's blocks)."""
    width = table.shape[-1]
    return table.ndim == 2 and grads.ndim == 2 and width & (width - 1) == 0


def _sum_block(lo, hi, vectors_ref, index_ref=None, weight_ref=None):
    """sum_j weight[j] * vectors[index[j]] over j in [lo, hi), BLOCK at a time, in order of
    blocks (identity index and unit weights where not given)."""
    width = vectors_ref.shape[-1]

    def body(i, acc):
        pos = lo + i * BLOCK + lax.iota(jnp.int32, BLOCK)
        inside = pos < hi
        pos = jnp.minimum(pos, hi - 1)  # read a real lookup, then zero it: no masked loads
        index = pos if index_ref is None else index_ref[pos]
        rows = vectors_ref[index].astype(jnp.float32)
        if weight_ref is not None:
            rows = rows * weight_ref[pos][:, None]
        return acc + jnp.sum(jnp.where(inside[:, None], rows, 0.0), axis=0)

    return lax.fori_loop(0, pl.cdiv(hi - lo, BLOCK), body, jnp.zeros((width,), jnp.float32))


def _chunk_kernel(begin_ref, end_ref, source_ref, *rest, weighted: bool):
    """Program c: the sum of lookups [begin[c], end[c]) of one long row -> partial[c]."""
    weight_ref = rest[0] if weighted else None
    grads_ref, partial_ref = rest[-2:]
    c = pl.program_id(0)
    partial_ref[pl.ds(c, 1), :] = _sum_block(begin_ref[c], end_ref[c], grads_ref, source_ref, weight_ref)[None]


def _row_kernel(*refs, step, num_rows: int, weighted: bool, state_keys: tuple, has_mean_sq: bool):
    """Program p of P, for the places k of its rounds (PLACES places, P x PLACES apart, until
    the distinct rows run out): distinct row ``rows[k]`` (past the end: nothing to do) gets its
    summed gradient (its lookups, or its chunks' partial sums), then one optimizer step."""
    it = iter(refs)
    rows_ref, starts_ref, first_ref, chunks_ref, source_ref = (next(it) for _ in range(5))
    weight_ref = next(it) if weighted else None
    grads_ref, partial_ref, lr_ref, distinct_ref = next(it), next(it), next(it), next(it)
    mean_sq_ref = next(it) if has_mean_sq else None
    next(it)  # the table as input (aliased to the output below)
    [next(it) for _ in state_keys]
    table_ref = next(it)
    state_refs = {key: next(it) for key in state_keys}

    def update_row(k, row):
        chunks, start, end = chunks_ref[k], starts_ref[k], starts_ref[k + 1]
        direct_end = jnp.where(chunks > 0, start, end)  # a long row reads its chunks instead
        g = _sum_block(start, direct_end, grads_ref, source_ref, weight_ref)
        g = g + _sum_block(first_ref[k], first_ref[k] + chunks, partial_ref)
        at = pl.ds(row, 1)
        w = table_ref[at, :].astype(jnp.float32)
        state = {key: ref[at, :] if len(ref.shape) == 2 else ref[at] for key, ref in state_refs.items()}
        mean_sq = None if mean_sq_ref is None else mean_sq_ref[pl.ds(k, 1)]
        out, new = step.fn(w if step.reads_table else None, state, g[None], lr_ref[0], mean_sq)
        table_ref[at, :] = (w + out if step.adds else out).astype(table_ref.dtype)
        for key, ref in state_refs.items():
            if len(ref.shape) == 2:
                ref[at, :] = new[key].astype(ref.dtype)
            else:
                ref[at] = new[key].astype(ref.dtype)

    places, p, programs = rows_ref.shape[0], pl.program_id(0), pl.num_programs(0)  # (read outside the loops)

    def one_round(j, carry):  # places (p + j x programs) x PLACES onward
        first_place = (p + j * programs) * PLACES

        def one_place(i, carry):
            k = jnp.minimum(first_place + i, places - 1)
            row = rows_ref[k]
            pl.when((first_place + i < places) & (row < num_rows))(lambda: update_row(k, row))
            return carry

        return lax.fori_loop(0, PLACES, one_place, carry)

    # the distinct rows' places come first; a program past them has no round
    rounds = pl.cdiv(jnp.maximum(distinct_ref[0] - p * PLACES, 0), programs * PLACES)
    lax.fori_loop(0, rounds, one_round, 0)


def _varying_like(x, shape, dtype) -> jax.ShapeDtypeStruct:
    """An output's shape that varies over the mesh axes as ``x`` does (inside ``shard_map``,
    whose type check needs it; outside, over none)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(x).manual_axis_type)


def long_row_chunks(s, num_rows: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """How the chunk kernel splits long rows: per place of the sorted lookups ``s`` (a
    ``SortedLookups``), its ``chunks`` of LONG lookups (0: summed directly) and the ``first``
    one's index; per chunk program, the lookups [``begin``, ``end``) it sums (empty: unused).
    The padding's place (rows past ``num_rows``, all of a bag's unused slots: over half of
    DLRM-DCNv2's lookups) is never chunked: the row kernel skips it, so its sums were wasted."""
    n = s.order.shape[0]
    count = s.starts[1:] - s.starts[:-1]
    chunks = jnp.where((count > LONG) & (s.rows < num_rows), (count + LONG - 1) // LONG, 0).astype(jnp.int32)
    chunk_end = jnp.cumsum(chunks, dtype=jnp.int32)
    first = chunk_end - chunks
    most = 2 * n // LONG + 1  # each long row has over LONG lookups, so at most 2 chunks per LONG
    c = lax.iota(jnp.int32, most)
    # unrolled: one kernel on GPUs, where the default search, a loop of log2(n) rounds, ran two
    # kernels and a copy a round (87 of criteo_kaggle's 191 kernels a step)
    place = jnp.searchsorted(chunk_end, c, side="right", method="scan_unrolled")
    place = jnp.minimum(place, n - 1).astype(jnp.int32)
    used = c < chunk_end[-1]
    begin = jnp.where(used, s.starts[place] + (c - first[place]) * LONG, 0)
    end = jnp.where(used, jnp.minimum(begin + LONG, s.starts[place + 1]), 0)
    return chunks, first, begin, end


def fused_row_update(
    step, table, state: dict, lookups, grads, lr, row_mean_sq=None, interpret: bool | None = None, programs: int = 0
):
    """``SparseOptimizer.update`` through the kernels: ``step`` its ``RowStep``; the rest as
    there. ``interpret``: run in Pallas's interpreter (default: unless on a GPU). ``programs``:
    at most this many programs of the row kernel, each taking PLACES places at a time until
    the distinct rows run out (0: one program per PLACES lookups, enough for any batch, most of
    them idle when rows repeat: on one H200 the row kernel's time followed its programs, about
    0.75 ns each, with 90% of them idle). The same bits either way."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    lookups = Lookups.of(lookups)
    num_rows, width = table.shape
    s = sort_by_row(lookups.rows, num_rows)
    n = s.order.shape[0]
    # The lookups' sources and weights in row order: the kernels read them contiguously.
    source = s.order if lookups.sources is None else lookups.sources[s.order]
    weight = None if lookups.weights is None else lookups.weights[s.order].astype(jnp.float32)
    chunks, first, begin, end = long_row_chunks(s, num_rows)
    most = begin.shape[0]

    weights_in = () if weight is None else (weight,)
    # Triton's compiler parameters pick the Triton backend (not Mosaic GPU's warpgroup copies,
    # which want rows of 512 bytes or more); one warp per program: a program holds one row.
    params = plt.CompilerParams(num_warps=WARPS, num_stages=1)
    call = functools.partial(pl.pallas_call, interpret=interpret, compiler_params=params)
    partial = call(
        functools.partial(_chunk_kernel, weighted=weight is not None),
        grid=(most,),
        out_shape=_varying_like(grads, (most, width), jnp.float32),
    )(begin, end, source, *weights_in, grads)

    keys = tuple(sorted(state))
    mean_sq = ()
    if row_mean_sq is not None:  # per place: every lookup of a row carries its row's value
        mean_sq = (s.max_by_row(row_mean_sq).astype(jnp.float32),)
    lr = jnp.asarray(lr, jnp.float32).reshape(1)
    distinct = jnp.sum(s.rows < num_rows, dtype=jnp.int32).reshape(1)
    inputs = (s.rows, s.starts, first, chunks, source, *weights_in, grads, partial, lr, distinct, *mean_sq)
    out_shape = [_varying_like(x, x.shape, x.dtype) for x in (table, *(state[k] for k in keys))]
    outs = call(
        functools.partial(
            _row_kernel,
            step=step,
            num_rows=num_rows,
            weighted=weight is not None,
            state_keys=keys,
            has_mean_sq=bool(mean_sq),
        ),
        grid=(min(pl.cdiv(n, PLACES), programs or n),),
        out_shape=out_shape,
        input_output_aliases={len(inputs) + i: i for i in range(1 + len(keys))},
    )(*inputs, table, *(state[k] for k in keys))
    return outs[0], dict(zip(keys, outs[1:], strict=True))
