"""Every sharding strategy against a plain single-device reference, on 1, 2, 4 and 8 devices.

The reference is the obvious program: gather rows from one unsharded table, pool them with
loops, and apply the textbook optimizer to the full-table gradient. The collection must agree
on the forward vectors and on every table's values and optimizer state after 5 steps, whatever
the plan: strategies x devices x optimizers x one-hot/multi-hot bags.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlrm_jax.data.sources.synthetic import SyntheticSource
from dlrm_jax.embedding.exchange.capacity import measure_capacities
from dlrm_jax.embedding.exchange.collection import physical_rows
from dlrm_jax.embedding.plan.embedding_plan import EmbeddingPlan, ExchangeKind, HotPlan, Strategy
from dlrm_jax.embedding.plan.layout import (
    group_capacity,
    pooled_layout,
    two_level_capacities,
    two_level_keys,
    whole_rows_capacity,
    whole_rows_key,
)
from dlrm_jax.embedding.plan.part_kinds import exchange_parts
from dlrm_jax.parallel.mesh import AXIS
from dlrm_jax.train.planning import agree_by_max
from dlrm_jax.train.wiring import plan_from_config
from tests.embedding.reference_checks import CARDS, build, check_against_reference, strategy_overrides

STRATEGIES = ["replicated", "table", "row", "row_cyclic", "column", "host_row", "host_column", "auto", "mixed"]
OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad"]


CASES = [
    (s, d, OPTIMIZERS[(i + j) % 3], (i + j) % 2 == 1)
    for i, s in enumerate(STRATEGIES)
    for j, d in enumerate([1, 2, 4, 8])
]


@pytest.mark.parametrize(
    "strategy,devices,optimizer,multi_hot",
    CASES,
    ids=[f"{s}-{d}dev-{o}-{'bags' if m else 'onehot'}" for s, d, o, m in CASES],
)
def test_strategy_matches_reference(tiny, strategy, devices, optimizer, multi_hot):
    bags = ["data.bag_sizes=[3, 1, 4, 2, 2]", "data.pooling=mean"] if multi_hot else []
    cfg = tiny(f"embedding.optimizer={optimizer}", "train.batch_size=32", CARDS, *bags, *strategy_overrides(strategy))
    coll, _ = check_against_reference(cfg, devices)
    want = {"row_cyclic": "row", "mixed": None, "auto": None}.get(strategy, strategy)
    if want and devices > 1:
        assert {t.strategy.value for t in coll.plan.tables} == {want}


@pytest.mark.parametrize("optimizer,exchange", [("sgd", "pooled"), ("rowwise_adagrad", "ids")])
def test_rows_within_hosts_on_two_hosts_of_four(tiny, optimizer, exchange):
    """Tables split by rows and by columns within one host of 4, on a mesh of 2 hosts, beside
    the other strategies: forward and state after 40 steps against the reference. Pooled: the
    host's devices sum their rows or columns of each bag, and the sums or slices meet within
    the host; ids: distinct rows go to the requester."""
    cfg = tiny(
        f"embedding.optimizer={optimizer}",
        "train.batch_size=32",
        CARDS,
        "data.bag_sizes=[3, 1, 4, 2, 5]",
        "data.pooling=mean",
        f"embedding.bag_exchange={exchange}",
        *strategy_overrides("mixed_hosts"),
    )
    coll, _ = check_against_reference(cfg, 8)
    host_row, host_column = coll.plan.tables[4], coll.plan.tables[3]
    assert host_row.strategy == Strategy.HOST_ROW and host_row.devices in ((0, 1, 2, 3), (4, 5, 6, 7))
    assert host_column.strategy == Strategy.HOST_COLUMN and host_column.column_slices == 4
    host_forms = [f for f in coll.forms if type(f).__name__ in ("HostPooledForm", "HostColumnsForm")]
    assert len(host_forms) == 2 * (exchange == "pooled")
    assert all(dict(f.mesh.shape) == {"hosts": 2, "local": 4} for f in host_forms)


@pytest.mark.parametrize("capacity", ["measured", "rounds"])
def test_host_columns_whole_rows_of_distinct_rows_only(tiny, capacity):
    """Row-wise Adagrad on tables split by columns within hosts of 4 (2 hosts): the host's
    devices add up their slices' squared gradients for the distinct rows only. With the
    capacity measured on the batches trained on, one all-reduce a step; with a capacity of
    3 rows, in rounds (reported as overflows). Both against the reference for 40 steps."""
    cfg = tiny(
        "embedding.optimizer=rowwise_adagrad",
        "train.batch_size=32",
        CARDS,
        "data.bag_sizes=[3, 1, 4, 2, 5]",
        "embedding.sharding=host_column",
        "cluster.devices_per_host=4",
        "model.embedding_dim=16",
        "model.bottom_mlp=[16, 16]",
    )
    plan = plan_from_config(cfg, 8)
    (part,) = [p for p in exchange_parts(plan) if p.kind == ExchangeKind.HOST_COLUMNS]
    positions = whole_rows_capacity(plan, part.group)
    assert positions == 32 * pooled_layout(plan, part.group).ids_per_sample  # unmeasured: every position
    source = SyntheticSource(cfg)
    if capacity == "measured":
        capacities = measure_capacities(plan, [source.train_batch(i).ids for i in range(40)], 1.0)
    else:
        capacities = ((whole_rows_key(part.group), 3),)
    plan = dataclasses.replace(plan, capacities=capacities)
    want = whole_rows_capacity(plan, part.group)
    assert want < positions / 2 if capacity == "measured" else want == 3
    coll, state = check_against_reference(cfg, 8, plan=plan)
    (form,) = [f for f in coll.forms if type(f).__name__ == "HostColumnsForm"]
    assert form.rows_capacity == want
    ids = source.train_batch(0).ids
    _, res = jax.jit(coll.lookup)(state, jax.device_put(ids, jax.sharding.NamedSharding(coll.mesh, jax.P(AXIS))))
    assert (int(res.overflow) > 0) == (capacity == "rounds")
    # The measurement counts what the step's forward finds: the most distinct rows of a host.
    most = int(np.max(res.routes[coll.forms.index(form)][4]))
    assert measure_capacities(plan, [ids], 1.0) == ((whole_rows_key(part.group), most),)


TWO_LEVEL = [
    ("sgd", 8, 4, "measured", False),
    ("rowwise_adagrad", 8, 2, "measured", True),
    ("adagrad", 4, 2, "measured", True),
    ("adagrad", 8, 4, "one level", False),
]


@pytest.mark.parametrize(
    "optimizer,devices,per_host,capacities,multi_hot",
    TWO_LEVEL,
    ids=[f"{o}-{d}dev-hosts-of-{g}-{c}-{'bags' if m else 'onehot'}" for o, d, g, c, m in TWO_LEVEL],
)
def test_two_level_ids_match_reference(tiny, optimizer, devices, per_host, capacities, multi_hot):
    """Row-wise tables' ids in two levels (a host's requests merged at the device of each
    local index, then across hosts): forward and state after 40 steps against the reference,
    with the stage capacities measured on the batches trained on, and with capacities of one
    row (every step runs the one-level form instead, and reports it)."""
    bags = ["data.bag_sizes=[3, 1, 4, 2, 2]", "data.pooling=mean"] if multi_hot else []
    cfg = tiny(
        f"embedding.optimizer={optimizer}",
        "train.batch_size=32",
        CARDS,
        *bags,
        "embedding.sharding=row",
        f"cluster.devices_per_host={per_host}",
    )
    plan = dataclasses.replace(plan_from_config(cfg, devices), ids_hosts=devices // per_host)
    (part,) = [p for p in exchange_parts(plan) if p.kind == ExchangeKind.IDS]
    source = SyntheticSource(cfg)
    batches = [source.train_batch(i).ids for i in range(40)]
    if capacities == "measured":
        plan = dataclasses.replace(plan, capacities=measure_capacities(plan, batches, 1.0))
        every = plan.global_batch // devices * part.group.num_vslots
        assert max(two_level_capacities(plan, part.group)) < per_host * every  # smaller than no measurement
    else:
        plan = dataclasses.replace(plan, capacities=tuple((k, 1) for k in two_level_keys(part.group)))
    coll, state = check_against_reference(cfg, devices, plan=plan)
    (form,) = coll.forms
    assert type(form).__name__ == "HostIdsForm" and (form.c1, form.c2) == two_level_capacities(plan, part.group)
    _, res = jax.jit(coll.lookup)(state, jax.device_put(batches[0], jax.sharding.NamedSharding(coll.mesh, jax.P(AXIS))))
    assert (int(res.overflow) > 0) == (capacities == "one level")
    # The measurement counts what the step's routing finds: the fullest buckets of each stage
    # (of stage 2 only when stage 1 sent everything).
    most = np.asarray(res.routes[0][0][0].most).reshape(-1, 2).max(0)  # (route, ids), weights
    measured = dict(measure_capacities(plan, batches[:1], 1.0))
    want = tuple(measured[k] for k in two_level_keys(part.group))
    assert most[0] == want[0] and (most[1] == want[1] or capacities == "one level")


@pytest.mark.parametrize("processes_per_host", [2, 4])
def test_two_level_capacities_measured_by_processes_holding_part_of_a_host_never_fall_short(tiny, processes_per_host):
    """One process per GPU (or per few): each measures the host stage on its part of the host's
    rows; what they agree on (the largest) must cover what the whole host merges."""
    cfg = tiny("train.batch_size=64", CARDS, "embedding.sharding=row", "cluster.devices_per_host=4")
    plan = dataclasses.replace(plan_from_config(cfg, 8), ids_hosts=2)
    (part,) = [p for p in exchange_parts(plan) if p.kind == ExchangeKind.IDS]
    batches = [SyntheticSource(cfg).train_batch(i).ids for i in range(4)]
    whole = dict(measure_capacities(plan, batches, 1.0))
    processes = 2 * processes_per_host
    rows = plan.global_batch // processes  # each process's share of every batch
    each = [measure_capacities(plan, [b[p * rows : (p + 1) * rows] for b in batches], 1.0) for p in range(processes)]
    agreed = dict(agree_by_max(each))
    for key in two_level_keys(part.group):
        assert agreed[key] >= whole[key], key


DETERMINISTIC = [("replicated", 1, "sgd"), ("row", 8, "sgd"), ("mixed", 4, "rowwise_adagrad"), ("column", 2, "adagrad")]


@pytest.mark.parametrize("strategy,devices,optimizer", DETERMINISTIC)
def test_deterministic_sums_match_reference(tiny, strategy, devices, optimizer):
    """embedding.deterministic: the exact sums on every path that merges gradients."""
    cfg = tiny(
        f"embedding.optimizer={optimizer}",
        "embedding.deterministic=true",
        "train.batch_size=32",
        CARDS,
        "data.bag_sizes=[3, 1, 4, 2, 2]",
        *strategy_overrides(strategy),
    )
    coll, _ = check_against_reference(cfg, devices)
    assert coll.optimizer.exact_sums


POOLED = [
    ("table", 2, "rowwise_adagrad"),
    ("table", 4, "adagrad"),
    ("column", 8, "adagrad"),
    ("mixed", 8, "sgd"),
    ("column", 4, "rowwise_adagrad"),
    ("column", 2, "sgd"),
]


@pytest.mark.parametrize("strategy,devices,optimizer", POOLED)
def test_owner_pooled_bags_match_reference(tiny, strategy, devices, optimizer):
    """Bags pooled by their owners (table-wise tables and column slices; row-wise ones in
    the mixed plan take the ids form beside them), mean pooling, against the reference."""
    cfg = tiny(
        f"embedding.optimizer={optimizer}",
        "train.batch_size=32",
        CARDS,
        "embedding.bag_exchange=pooled",
        "data.bag_sizes=[5, 1, 6, 3, 4]",
        "data.pooling=mean",
        *strategy_overrides(strategy),
    )
    coll, _ = check_against_reference(cfg, devices)
    fixed = {
        (vt.table, vt.col_start)
        for g in coll.groups
        if not g.replicated
        for vt in g.vtables
        if coll.plan.tables[vt.table].strategy in (Strategy.TABLE, Strategy.COLUMN)
    }
    pooled = {
        (vt.table, vt.col_start) for f in coll.forms if type(f).__name__ == "PooledForm" for vt in f.group.vtables
    }
    assert fixed and pooled == fixed


def test_bag_exchange_setting_picks_each_tables_form(tiny):
    """auto: fixed-owner tables pool bags, one-hot ones send distinct ids; ids: never pooled;
    pooled: every fixed-owner table; row-wise tables always send ids."""
    mixed = [
        "embedding.sharding=table",
        "embedding.table_sharding=[cat_0=row, cat_2=column]",
        CARDS,
        "data.bag_sizes=[8, 1, 8, 1, 8]",
    ]
    exchange = {
        mode: [t.exchange.value for t in plan_from_config(tiny(*mixed, f"embedding.bag_exchange={mode}"), 4).tables]
        for mode in ("auto", "ids", "pooled")
    }
    assert exchange["auto"] == ["ids", "ids", "pooled", "ids", "pooled"]
    assert exchange["ids"] == ["ids"] * 5
    assert exchange["pooled"] == ["ids", "pooled", "pooled", "pooled", "pooled"]


@pytest.mark.parametrize(
    "cards,kind",
    [
        ("data.cardinalities=[5, 3, 9, 4, 2]", "allreduce"),
        ("data.cardinalities=[5000, 3000, 9000, 400, 2000]", "gather"),
    ],
)
@pytest.mark.parametrize("devices", [2, 8])
def test_replicated_tables_allreduce_or_gather(tiny, cards, kind, devices):
    """Replicated tables of few rows all-reduce their [rows, W] gradient; of many rows they
    gather the batch's (row, gradient) pairs: whichever moves fewer bytes, both exact."""
    cfg = tiny(
        "embedding.sharding=replicated",
        "embedding.optimizer=rowwise_adagrad",
        "train.batch_size=32",
        "data.bag_sizes=[3, 1, 4, 2, 2]",
        cards,
    )
    coll, _ = check_against_reference(cfg, devices)
    assert [f.kind for f in coll.forms] == [kind]


@pytest.mark.parametrize("strategy", ["table", "row", "column"])
def test_sharded_tables_are_split_not_replicated(tiny, strategy):
    cfg = tiny(f"embedding.sharding={strategy}", "embedding.optimizer=adagrad", CARDS)
    coll = build(cfg, 8)
    state = coll.init(jax.random.key(0))
    for name, arr in state.tables.items():
        assert not arr.sharding.is_fully_replicated, name
        shard_rows = {s.data.shape[0] for s in arr.addressable_shards}
        assert shard_rows == {arr.shape[0] // 8}, (name, shard_rows)


@pytest.mark.parametrize(
    "variant",
    [  # the fast lane keeps the first; the other two take 5-7 s each on 2 cores
        pytest.param(["embedding.sharding=row", "embedding.optimizer=rowwise_adagrad"], id="rows"),
        pytest.param(
            ["embedding.sharding=row", "embedding.optimizer=adagrad", "data.bag_sizes=[3, 1, 4, 2, 2]"],
            id="bags",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["embedding.sharding=column", "embedding.optimizer=rowwise_adagrad", "embedding.bag_exchange=ids"],
            id="column-slices-rowwise",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_forced_overflow_loses_nothing(tiny, variant):
    """A capacity far too small runs the exchange in rounds at that capacity: same numbers as
    the reference (each row updated once per step, as Adagrad needs), overflow reported."""
    cfg = tiny("embedding.capacity_factor=0.01", "train.batch_size=32", CARDS, *variant)
    coll, state = check_against_reference(cfg, 4, steps=3)
    assert all(group_capacity(coll.plan, g) == 1 for g in coll.groups if not g.replicated)
    ids = SyntheticSource(cfg).train_batch(0).ids
    _, res = jax.jit(coll.lookup)(state, jnp.asarray(ids))
    assert int(res.overflow) >= 1
    roomy = build(tiny("train.batch_size=32", CARDS, *variant), 4)
    _, res = jax.jit(roomy.lookup)(roomy.init(jax.random.key(0)), jnp.asarray(ids))
    assert int(res.overflow) == 0


@pytest.mark.parametrize("capacity", ["0.01", "4"], ids=["overflow", "roomy"])
@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(["embedding.sharding=row", "embedding.optimizer=rowwise_adagrad"], id="rows"),
        pytest.param(
            ["embedding.sharding=column", "embedding.optimizer=rowwise_adagrad", "embedding.bag_exchange=ids"],
            id="column-slices-rowwise",
        ),
    ],
)
def test_the_gpus_first_trip_outside_the_loop_matches_the_reference(monkeypatch, tiny, capacity, variant):
    """The GPUs' form of the update's rounds (the one trip before the loop: every request where
    nothing overflowed, none after an overflow, whose rounds then send them all) forced on CPU
    devices: the same numbers as the reference, step by step, with and without rounds."""
    from dlrm_jax.choices import ControlFlow
    from dlrm_jax.embedding.exchange import common

    monkeypatch.setattr(common, "ROUNDS_FORM", ControlFlow.ONE_PATH)
    cfg = tiny(f"embedding.capacity_factor={capacity}", "train.batch_size=32", CARDS, *variant)
    coll, state = check_against_reference(cfg, 4, steps=3)
    _, res = jax.jit(coll.lookup)(state, jnp.asarray(SyntheticSource(cfg).train_batch(0).ids))
    assert (int(res.overflow) >= 1) == (capacity == "0.01")


@pytest.mark.parametrize("devices", [2, 8])
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "sgd"])
def test_bfloat16_storage_and_exchange_within_tolerance(tiny, devices, optimizer):
    """bf16 tables and bf16 wire, float32 accumulation at the owner: forward vectors, tables and
    accumulators within 1e-2 of the float32 reference in relative norm (the documented bound).
    Not per-element Adagrad: its first step moves an element by lr * sign(g) whatever |g|, so a
    gradient whose bf16 partial sums cancel to near zero can step the other way (2 lr apart)."""
    cfg = tiny(
        "embedding.sharding=row",
        "embedding.dtype=bfloat16",
        "embedding.exchange_dtype=bfloat16",
        "train.batch_size=32",
        CARDS,
        f"embedding.optimizer={optimizer}",
    )
    check_against_reference(cfg, devices, steps=3, norm_tol=1e-2)


@pytest.mark.parametrize("strategy,devices", [("row", 4), ("table", 8), ("column", 2)])
def test_float8_exchange_within_tolerance(tiny, strategy, devices):
    """float8 (e4m3, a float32 scale per vector) on the wire, float32 everywhere else: forward
    vectors and tables within 0.07 of the float32 reference in relative norm (each value is
    within 2**-4 of its vector's largest: the documented bound), over 10 steps."""
    cfg = tiny(
        f"embedding.sharding={strategy}",
        "embedding.exchange_dtype=float8",
        "train.batch_size=32",
        CARDS,
        "embedding.optimizer=rowwise_adagrad",
        "data.bag_sizes=[3, 1, 4, 2, 2]",
    )
    check_against_reference(cfg, devices, steps=10, norm_tol=0.07)


def test_plan_json_round_trip(tiny):
    cfg = tiny(
        "embedding.sharding=auto", CARDS, "embedding.table_sharding=[cat_4=column]", "embedding.optimizer=adagrad"
    )
    plan = plan_from_config(cfg, 8)
    assert EmbeddingPlan.from_json(plan.to_json()) == plan
    assert plan.tables[4].strategy == Strategy.COLUMN and plan.tables[4].column_slices == 2


def test_measured_capacity_is_tight_and_still_exact(tiny):
    """Buckets sized from one batch's statistics (no headroom): later batches may overflow,
    take the fallback path, and still match the reference exactly."""
    cfg = tiny(
        "embedding.sharding=row", "train.batch_size=64", CARDS, "embedding.optimizer=adagrad", "data.zipf_exponent=1.3"
    )
    coll = build(cfg, 4)
    measured = measure_capacities(coll.plan, [SyntheticSource(cfg).train_batch(0).ids], headroom=1.0)
    bound = {g.name: g.max_capacity(16) for g in coll.groups}
    assert measured and all(0 < distinct < bound[name] for name, distinct in measured)
    plan = dataclasses.replace(coll.plan, capacities=measured)
    assert EmbeddingPlan.from_json(plan.to_json()) == plan
    coll, state = check_against_reference(cfg, 4, plan=plan)
    overflows = [
        int(jax.jit(coll.lookup)(state, jnp.asarray(SyntheticSource(cfg).train_batch(s).ids))[1].overflow)
        for s in range(1, 5)
    ]
    assert max(overflows) >= 1  # the tight capacity did overflow on some batch, and lost nothing


@pytest.mark.parametrize("devices,bags", [(8, False), (4, True)])
def test_column_slices_with_rowwise_adagrad_share_one_accumulator(tiny, devices, bags):
    """Each slice owner gets the whole row's mean squared gradient (partials summed across the
    slice owners), so every slice's accumulator equals the single-device one."""
    extra = ["data.bag_sizes=[3, 1, 4, 2, 2]", "embedding.bag_exchange=pooled"] if bags else []
    cfg = tiny("embedding.optimizer=rowwise_adagrad", "embedding.sharding=column", "train.batch_size=32", CARDS, *extra)
    coll, state = check_against_reference(cfg, devices)
    assert any(t.column_slices > 1 for t in coll.plan.tables)
    assert {type(f).__name__ for f in coll.forms} == {"PooledForm" if bags else "IdsForm"}
    for g in coll.groups:
        for t in {vt.table for vt in g.vtables}:
            accs = [
                np.asarray(state.slots[g.name]["accumulator"])[
                    np.asarray(physical_rows(g, vt, jnp.arange(vt.rows, dtype=jnp.int32)))
                ]
                for vt in g.vtables
                if vt.table == t
            ]
            for acc in accs[1:]:
                np.testing.assert_array_equal(acc, accs[0])


def test_bag_pooling_is_scatter_free(tiny):
    """Pooling a bag is a fixed-order reduction, not a scatter-add: on a GPU the latter adds a
    bag's vectors with atomics in any order, so the forward would differ between runs."""
    cfg = tiny("train.batch_size=16", CARDS, "data.bag_sizes=[3, 1, 4, 2, 2]", "embedding.sharding=replicated")
    coll = build(cfg, 1)
    state = coll.init(jax.random.key(0))
    ids = SyntheticSource(cfg).train_batch(0).ids
    assert "scatter" not in str(jax.make_jaxpr(coll.lookup)(state, ids))


def scatters_into(hlo: str, shapes: set[str]) -> list[str]:
    """The compiled program's scatters whose result has one of ``shapes`` (HLO spelling, e.g.
    'f32[219,8]'), fused or not."""
    found = []
    for line in hlo.splitlines():
        head, _, rest = line.partition(" = ")
        if rest.split("{")[0].split(" ")[0] in shapes and " scatter(" in f" {rest}":
            found.append(line.strip())
    return found


def hlo_shape(x) -> str:
    dtype = {"float32": "f32", "bfloat16": "bf16", "int32": "s32"}[str(x.dtype)]
    return f"{dtype}[{','.join(map(str, x.addressable_shards[0].data.shape))}]"


@pytest.mark.parametrize("strategy", ["replicated", "table", "row", "column", "host_column", "hot"])
def test_updates_write_each_row_of_a_table_or_its_state_once(tiny, strategy):
    """Row-wise Adagrad's compiled update never scatters repeated indices into a table, its
    accumulator or the hot rows (a GPU adds those with contended float atomics, in any order):
    every such scatter promises unique indices, because the update sums each distinct row's
    gradient first, in a fixed order, and applies the optimizer to it once."""
    overrides = strategy_overrides("row" if strategy == "hot" else strategy)
    cfg = tiny(
        "train.batch_size=32",
        CARDS,
        "data.bag_sizes=[3, 1, 4, 2, 2]",
        "embedding.optimizer=rowwise_adagrad",
        *overrides,
    )
    plan = plan_from_config(cfg, 2)
    if strategy == "hot":
        plan = dataclasses.replace(plan, hot=HotPlan(16))
    coll = build(cfg, 2, plan)
    state = coll.init(jax.random.key(0))
    ids = jax.device_put(SyntheticSource(cfg).train_batch(0).ids, jax.sharding.NamedSharding(coll.mesh, jax.P(AXIS)))
    pooled, res = jax.jit(coll.lookup)(state, ids)
    lowered = jax.jit(coll.apply_gradients).lower(state, res, jnp.ones_like(pooled), jnp.float32(0.1))
    # XLA:CPU's older emitters (the suite's compile flags) turn scatters into loops: read the
    # program as the fusion emitters compile it, scatters kept.
    hlo = lowered.compile(compiler_options={"xla_cpu_use_fusion_emitters": True}).as_text()
    arrays = [*jax.tree.leaves(state.tables), *jax.tree.leaves(state.slots)]
    if strategy == "hot":
        arrays += [state.hot.values, *jax.tree.leaves(state.hot.slots)]
    found = scatters_into(hlo, {hlo_shape(a) for a in arrays})
    assert found, "no scatter into a table found: the test no longer reads the program it means to"
    repeated = [line for line in found if "unique_indices=true" not in line]
    assert not repeated, "\n".join(repeated)


BF16_CASES = [
    ("replicated", 1, "fused"),
    ("replicated", 1, "xla"),
    ("replicated", 2, "fused"),
    ("row", 2, "fused"),
    ("column", 4, "xla"),
    ("host_row", 4, "xla"),
    ("table", 8, "fused"),
]


@pytest.mark.parametrize("strategy,devices,update", BF16_CASES, ids=[f"{s}-{d}dev-{u}" for s, d, u in BF16_CASES])
def test_a_bfloat16_gradient_gives_the_bits_of_its_float32_copy(tiny, strategy, devices, update, monkeypatch):
    """A model computing in bfloat16 hands the collection its pooled vectors' gradient in
    bfloat16 (the train step differentiates w.r.t. them as the model reads them): every form
    then updates its tables and state exactly as from the float32 copy of that gradient, the
    replicated form's fused kernels reading it as it comes (on one device: no float32 copy of
    it written), every other sum in float32."""
    from dlrm_jax.embedding.exchange import row_update_kernel

    read = []
    kernels = row_update_kernel.fused_row_update
    monkeypatch.setattr(
        row_update_kernel, "fused_row_update", lambda *a, **k: read.append(a[4].dtype) or kernels(*a, **k)
    )
    cfg = tiny(
        *strategy_overrides(strategy),
        "embedding.optimizer=rowwise_adagrad",
        f"embedding.sparse_update={update}",
        "data.bag_sizes=[3, 1, 4, 2]",
    )
    coll = build(cfg, devices)
    source = SyntheticSource(cfg)
    state = coll.init(jax.random.key(0))
    lookup, apply = jax.jit(coll.lookup), jax.jit(coll.apply_gradients)
    batch = jax.sharding.NamedSharding(coll.mesh, jax.P(AXIS))
    for step in range(4):
        pooled, res = lookup(state, jax.device_put(source.train_batch(step).ids, batch))
        w = jnp.asarray(np.random.default_rng(step).normal(size=pooled.shape), jnp.bfloat16)
        low = apply(state, res, jax.device_put(w, batch), jnp.float32(0.05))
        wide = apply(state, res, jax.device_put(w.astype(jnp.float32), batch), jnp.float32(0.05))
        for a, b in zip(jax.tree.leaves(low), jax.tree.leaves(wide), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"step {step}")
        state = low
    if (strategy, devices, update) == ("replicated", 1, "fused"):
        assert read[0] == jnp.bfloat16 and read[1] == jnp.float32  # (the two programs' traces)


@pytest.mark.parametrize("strategy", ["row", "row_cyclic", "column", "mixed", "host_column"])
def test_tables_laid_out_on_the_host_are_the_devices_logical_tables(tiny, strategy):
    """Exports read each table on the host from its arrays' device shards (relayout's
    tables_on_host): the device program that gathered them held every whole table on every
    device. Both give the same tables and optimizer state, bit for bit."""
    from dlrm_jax.embedding.exchange.relayout import tables_on_host

    sharding = [f"embedding.sharding={strategy}"] if strategy in ("row", "column") else strategy_overrides(strategy)
    cfg = tiny(*sharding, "embedding.optimizer=rowwise_adagrad")
    coll = build(cfg, 8)
    state = coll.init(jax.random.key(3))
    bump = lambda a: a + jnp.arange(a.size, dtype=a.dtype).reshape(a.shape) / a.size  # (distinct slots too)
    state = state._replace(slots=jax.tree.map(bump, state.slots))
    tables, slots = coll.logical_tables(state)
    got = list(tables_on_host(coll, state))
    assert [t for t, _, _ in got] == list(range(len(tables)))
    for t, values, opt in got:
        np.testing.assert_array_equal(values, np.asarray(tables[t]))
        assert opt.keys() == slots[t].keys() and opt
        for k in opt:
            np.testing.assert_array_equal(opt[k], np.asarray(slots[t][k]))
