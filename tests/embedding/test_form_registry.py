"""Exchange forms enter by their registries: a kind's byte model in plan/part_kinds.PART_KINDS,
its form in exchange/forms.FORMS. A toy form added here, in this file only, is planned, built,
run and priced like the built-in ones."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from dlrm_jax import EmbeddingCollection, TableSpec, make_mesh, plan_embeddings
from dlrm_jax.embedding.exchange import forms
from dlrm_jax.embedding.exchange.forms import FORMS
from dlrm_jax.embedding.plan import part_kinds
from dlrm_jax.embedding.plan.embedding_plan import ExchangeKind
from dlrm_jax.embedding.plan.part_kinds import PART_KINDS, SPAN_ALL, PartKind, exchange_parts
from dlrm_jax.embedding.plan.stats import collective_bytes, plan_report
from dlrm_jax.parallel.mesh import AXIS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "sharding.md"


def test_every_kind_has_a_form_and_every_form_a_kind():
    assert set(PART_KINDS) == set(FORMS) == {k.value for k in ExchangeKind}
    for name, kind in PART_KINDS.items():
        assert kind.name == name
        for method in ("links", "buffer_bytes", "memory_traffic", "describe"):  # the byte model is whole
            assert getattr(type(kind), method) is not getattr(PartKind, method), f"{name}: no {method}"


def test_the_adding_a_form_checklist_names_what_a_form_touches():
    """docs/sharding.md's checklist names the two registries, the protocol and this test; the
    files it names exist."""
    text = DOCS.read_text()
    section = text[text.index("## Adding a form") :]
    section = section[: section.find("\n## ", 3)] if "\n## " in section[3:] else section
    for name in ("ExchangeForm", "FORMS", "PART_KINDS", "PartKind", "FormRequest", "test_form_registry.py"):
        assert name in section, f"the checklist does not name {name}"
    for path in re.findall(r"`((?:dlrm_jax|tests|docs)/[\w/.]+\.(?:py|md))`", section):
        assert (DOCS.parents[1] / path).is_file(), f"the checklist names {path}, which does not exist"


# ---------------------------------------------------------------- a toy form, added here alone


class ToyDense(PartKind):
    """Replicated tables, SGD only: every device sums its lookups' gradients into a dense
    [rows, W] array and all-reduces it (the all-reduce kind's traffic, written plainly)."""

    name, replicated = "toy_dense", True

    def usable(self, plan, devices):
        return plan.optimizer == "sgd"

    def links(self, plan, part, replicas=1):
        m = plan.num_devices * replicas
        return [("all-reduce", 2 * (m - 1) / m * part.group.local_rows * part.group.width * 4, SPAN_ALL)]

    def buffer_bytes(self, plan, part):
        return 2 * part.group.local_rows * part.group.width * 4

    def memory_traffic(self, plan, part):
        g = part.group
        return plan.global_batch * g.num_vslots * g.width * 4, g.local_rows * g.width * 12

    def describe(self, plan, part):
        return "on every device", "a dense gradient summed over the devices (toy)"


class ToyDenseForm:
    """The toy kind's form: the protocol and nothing more."""

    def __init__(self, request: forms.FormRequest):
        self.group = g = request.part.group
        self.cols = g.vfeature_cols.reshape(-1)
        self.mesh = request.mesh

    def _rows(self, ids_bs):
        g = self.group
        vids = ids_bs[:, g.vslot_slot]
        return jnp.where(vids == -1, g.local_rows, vids + jnp.asarray(g.vslot_offset))

    def _pool(self, per_vslot):  # [B, V, W] -> [B, V' * W]
        g = self.group
        pooled = jax.ops.segment_sum(per_vslot.transpose(1, 0, 2), g.vslot_vfeature, len(g.vtables))
        return pooled.transpose(1, 0, 2).reshape(per_vslot.shape[0], -1)

    def forward(self, table, ids_bs, weights_bs):
        vectors = table.at[self._rows(ids_bs)].get(mode="fill", fill_value=0).astype(jnp.float32)
        weighted = vectors * weights_bs[:, self.group.vslot_slot][:, :, None]
        return self._pool(weighted), (ids_bs, weights_bs), jnp.zeros((), jnp.int32)

    def update(self, table, slots, residual, grad, lr):
        g = self.group

        def local(table, ids, weights, grad, lr):
            per_vslot = grad.reshape(grad.shape[0], len(g.vtables), g.width)[:, g.vslot_vfeature]
            per_vslot = per_vslot * weights[:, g.vslot_slot][:, :, None]
            dense = jnp.zeros((g.local_rows + 1, g.width), jnp.float32).at[self._rows(ids)].add(per_vslot)
            return (table - lr * lax.psum(dense[:-1], AXIS)).astype(table.dtype)

        table = jax.shard_map(
            local, mesh=self.mesh, in_specs=(P(), P(AXIS), P(AXIS), P(AXIS), P()), out_specs=P(), check_vma=False
        )(table, *residual, grad, lr)
        return table, slots


SPECS = [TableSpec("a", 40, 8, 1), TableSpec("b", 12, 8, 3, pooling="mean"), TableSpec("c", 30, 8, 2)]


def _run(devices, steps=6):
    plan = plan_embeddings(SPECS, "replicated", devices, "sgd", 16)
    coll = EmbeddingCollection(plan, make_mesh(devices))
    state = coll.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    rows = np.repeat([s.rows for s in SPECS], [s.bag_size for s in SPECS])
    step = jax.jit(lambda st, ids, t: _step(coll, st, ids, t))
    outs = []
    for _ in range(steps):
        ids = rng.integers(0, rows, size=(16, len(rows))).astype(np.int32)
        ids[rng.random(ids.shape) < 0.2] = -1
        target = rng.normal(size=(16, len(SPECS), 8)).astype(np.float32)
        ids, target = (jax.device_put(x, coll.batch_sharding) for x in (ids, target))
        state, pooled = step(state, ids, target)
        outs.append(np.asarray(pooled))
    tables, _ = coll.logical_tables(state)
    return plan, outs, [np.asarray(t) for t in tables]


def _step(coll, state, ids, target):
    pooled, res = coll.lookup(state, ids)
    grad = jax.grad(lambda p: 0.5 * jnp.sum((p - target) ** 2))(pooled)
    return coll.apply_gradients(state, res, grad, jnp.float32(0.1)), pooled


@pytest.mark.parametrize("devices", [1, 2])
def test_a_toy_form_is_planned_built_run_and_priced_from_its_registry_rows(devices, monkeypatch):
    ref_plan, ref_out, ref_tables = _run(devices)
    # The toy kind in place of the built-in replicated ones: registry rows only.
    kinds = {"toy_dense": ToyDense(), **{k: v for k, v in PART_KINDS.items() if not v.replicated}}
    monkeypatch.setattr(part_kinds, "PART_KINDS", kinds)
    monkeypatch.setitem(FORMS, "toy_dense", ToyDenseForm)
    plan, out, tables = _run(devices)
    assert [p.kind for p in exchange_parts(plan)] == ["toy_dense"]
    coll = EmbeddingCollection(plan, make_mesh(devices))
    assert isinstance(coll.forms[0], ToyDenseForm)
    for a, b in zip(out + tables, ref_out + ref_tables, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    expected = 2 * (devices - 1) / devices * coll.forms[0].group.local_rows * 8 * 4
    assert collective_bytes(plan)["all-reduce"] == round(expected)
    assert "Exchange toy_dense (on every device)" in plan_report(plan)
    assert ref_plan.tables == plan.tables  # the plan itself is the same; only its parts' kind differs
