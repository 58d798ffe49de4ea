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
              step, so its lookups are first summed in pieces, one program each, and its
              program adds the pieces' sums in order. The pieces are the row's parts in
              fixed blocks of LONG sorted lookups, two programs a block (the long row at its
              first lookup, and the one at its last if another), so each program finds its
              piece from the sorted lookups alone: no prefix sum or search over the rows
              between the sort and the kernels (on a GPU those were 11 of criteo_kaggle's
              108 kernels a step, compiled for one H200).

Every sum runs in an order fixed by the sorted lookups, so a run gives the same bits every
time; the order differs from the XLA form's (blocks, then pieces), so the two agree to
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


def _sum_block(lo, hi, vectors_ref, index_ref=None, weight_ref=None, acc=None):
    """``acc`` (zeros if not given) + sum_j weight[j] * vectors[index[j]] over j in [lo, hi),
    BLOCK at a time, in order of blocks (identity index and unit weights where not given)."""
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

    acc = jnp.zeros((width,), jnp.float32) if acc is None else acc
    return lax.fori_loop(0, pl.cdiv(hi - lo, BLOCK), body, acc)


def chunk_range(c, blocks: int, segment, starts, rows, num_rows: int):
    """The sorted lookups [begin, end) that chunk program ``c`` of ``2 * blocks`` sums: in block
    ``b = c % blocks`` (sorted lookups [b x LONG, (b + 1) x LONG)), the part of the row at the
    block's first lookup (``c < blocks``) or at its last (``c >= blocks``, unless the same row)
    where that row is long (more than LONG lookups) and real (below ``num_rows``: never the
    padding's); else an empty range. A long row's pieces are thus: in its first block, the
    program of the side it lies on (the last lookup's, unless it starts the block), then the
    first side's of each later block it reaches (see :func:`_long_row_pieces`). ``segment``,
    ``starts``, ``rows``: a ``SortedLookups``'s, as refs in a kernel or arrays (the tests')."""
    n = segment.shape[0]
    side, b = lax.div(c, blocks), lax.rem(c, blocks)
    lo = b * LONG
    hi = jnp.minimum(lo + LONG, n)
    at_first, at_last = segment[lo], segment[hi - 1]
    q = jnp.where(side == 0, at_first, at_last)
    start, end = starts[q], starts[q + 1]
    take = _is_long(start, end) & (rows[q] < num_rows) & ((side == 0) | (at_last != at_first))
    return jnp.where(take, jnp.maximum(start, lo), 0), jnp.where(take, jnp.minimum(end, hi), 0)


def _is_long(start, end):
    """Whether a row's lookups [start, end) are summed in pieces by the chunk kernel."""
    return end - start > LONG


def _long_row_pieces(start, end, blocks: int):
    """Where a long row's lookups [start, end) were summed by the chunk kernel: the index of
    its first piece's partial sum, and the range of partial sums of the rest (each in order)."""
    # (non-negative: division truncates, which Triton's lowering takes where floor division's
    # sign fix-up it does not)
    first_block, last_block = lax.div(start, LONG), lax.div(end - 1, LONG)
    # a row starting inside a block is the one at the block's last lookup there
    first = jnp.where(lax.rem(start, LONG) != 0, first_block + blocks, first_block)
    return first, first_block + 1, last_block + 1


def _chunk_kernel(segment_ref, starts_ref, rows_ref, source_ref, *rest, weighted: bool, num_rows: int):
    """Program c: the sum of lookups :func:`chunk_range` gives it -> partial[c]."""
    weight_ref = rest[0] if weighted else None
    grads_ref, partial_ref = rest[-2:]
    c = pl.program_id(0)
    begin, end = chunk_range(c, partial_ref.shape[0] // 2, segment_ref, starts_ref, rows_ref, num_rows)
    partial_ref[pl.ds(c, 1), :] = _sum_block(begin, end, grads_ref, source_ref, weight_ref)[None]


def _row_kernel(*refs, step, num_rows: int, weighted: bool, state_keys: tuple, has_mean_sq: bool):
    """Program p of P, for the places k of its rounds (PLACES places, P x PLACES apart, until
    the distinct rows run out): distinct row ``rows[k]`` (past the end: nothing to do) gets its
    summed gradient (its lookups, or its pieces' partial sums), then one optimizer step."""
    it = iter(refs)
    rows_ref, starts_ref, source_ref = (next(it) for _ in range(3))
    weight_ref = next(it) if weighted else None
    grads_ref, partial_ref, lr_ref, segment_ref = next(it), next(it), next(it), next(it)
    mean_sq_ref = next(it) if has_mean_sq else None
    next(it)  # the table as input (aliased to the output below)
    [next(it) for _ in state_keys]
    table_ref = next(it)
    state_refs = {key: next(it) for key in state_keys}

    blocks = partial_ref.shape[0] // 2

    def update_row(k, row):
        start, end = starts_ref[k], starts_ref[k + 1]
        long = _is_long(start, end)  # (a real row: the caller checked)
        direct_end = jnp.where(long, start, end)  # a long row reads its pieces' sums instead
        g = _sum_block(start, direct_end, grads_ref, source_ref, weight_ref)
        first, rest_lo, rest_hi = _long_row_pieces(start, end, blocks)
        g = g + _sum_block(
            jnp.where(long, rest_lo, 0),
            jnp.where(long, rest_hi, 0),
            partial_ref,
            acc=jnp.where(long, partial_ref[pl.ds(first, 1), :], 0.0).reshape(-1),
        )
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

    # The distinct rows' places come first, then the padding's if any (the last lookup's place,
    # read here: a count of the real rows before the kernel was two kernels more); a program
    # past them has no round.
    last = segment_ref[segment_ref.shape[0] - 1]
    distinct = jnp.where(rows_ref[last] < num_rows, last + 1, last)
    rounds = pl.cdiv(jnp.maximum(distinct - p * PLACES, 0), programs * PLACES)
    lax.fori_loop(0, rounds, one_round, 0)


def _varying_like(x, shape, dtype) -> jax.ShapeDtypeStruct:
    """An output's shape that varies over the mesh axes as ``x`` does (inside ``shard_map``,
    whose type check needs it; outside, over none)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(x).manual_axis_type)


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
    blocks = pl.cdiv(n, LONG)

    weights_in = () if weight is None else (weight,)
    # Triton's compiler parameters pick the Triton backend (not Mosaic GPU's warpgroup copies,
    # which want rows of 512 bytes or more); one warp per program: a program holds one row.
    params = plt.CompilerParams(num_warps=WARPS, num_stages=1)
    call = functools.partial(pl.pallas_call, interpret=interpret, compiler_params=params)
    partial = call(
        functools.partial(_chunk_kernel, weighted=weight is not None, num_rows=num_rows),
        grid=(2 * blocks,),
        out_shape=_varying_like(grads, (2 * blocks, width), jnp.float32),
    )(s.segment, s.starts, s.rows, source, *weights_in, grads)

    keys = tuple(sorted(state))
    mean_sq = ()
    if row_mean_sq is not None:  # per place: every lookup of a row carries its row's value
        mean_sq = (s.max_by_row(row_mean_sq).astype(jnp.float32),)
    lr = jnp.asarray(lr, jnp.float32).reshape(1)
    inputs = (s.rows, s.starts, source, *weights_in, grads, partial, lr, s.segment, *mean_sq)
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
