"""Sharding plans: the decision of where every table lives, as printable, JSON-able data.

The exchange code reads a plan, never the config. This module holds the plan types and the
planner; strategies other than ``replicated`` are added by the model-parallel engine.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass

from dlrm_jax.embedding.specs import Pooling, TableSpec


class Strategy(enum.StrEnum):
    REPLICATED = "replicated"
    TABLE = "table"
    ROW = "row"
    COLUMN = "column"


IMPLEMENTED = (Strategy.REPLICATED,)

# Bytes of optimizer state per row, as a multiple of the row's float32 bytes (adagrad) or fixed.
def optimizer_bytes_per_row(optimizer: str, dim: int) -> int:
    return {"sgd": 0, "adagrad": 4 * dim, "rowwise_adagrad": 4}[optimizer]


@dataclass(frozen=True)
class TablePlan:
    """Where one table lives: its spec, its strategy, and the devices that hold a part of it."""

    spec: TableSpec
    strategy: Strategy
    devices: tuple[int, ...]

    def param_bytes_per_device(self) -> int:
        return self.spec.bytes_f32  # replicated: a full copy on every device


@dataclass(frozen=True)
class EmbeddingPlan:
    """The sharding plan of every table, plus what the step's exchange will move."""

    tables: tuple[TablePlan, ...]
    num_devices: int
    optimizer: str
    global_batch: int

    # ------------------------------------------------------------ accounting
    def per_device_bytes(self) -> dict[str, int]:
        params = sum(t.param_bytes_per_device() for t in self.tables)
        opt = sum(t.spec.rows * optimizer_bytes_per_row(self.optimizer, t.spec.dim) for t in self.tables)
        # Replicated update: every device gathers the whole batch's rows (int32) and gradients.
        slots = sum(t.spec.bag_size for t in self.tables)
        dim = max(t.spec.dim for t in self.tables)
        exchange = self.global_batch * slots * (4 + 4 * dim)
        return {"parameters": params, "optimizer_state": opt, "exchange_buffers": exchange}

    def exchange_bytes_per_step(self) -> int:
        """Bytes each device receives from the others per step (the replicated all-gather)."""
        n = self.num_devices
        return self.per_device_bytes()["exchange_buffers"] * (n - 1) // n

    # ------------------------------------------------------------ data round trip
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> EmbeddingPlan:
        raw = json.loads(text)
        tables = tuple(
            TablePlan(TableSpec(**{**t["spec"], "pooling": Pooling(t["spec"]["pooling"])}),
                      Strategy(t["strategy"]), tuple(t["devices"]))
            for t in raw["tables"]
        )
        return cls(tables, raw["num_devices"], raw["optimizer"], raw["global_batch"])

    def to_text(self) -> str:
        """The plan as a table, then per-device totals and the predicted exchange volume."""
        head = f"{'table':<14}{'rows':>12}{'dim':>6}{'bag':>5}  {'strategy':<11}{'devices':<12}{'bytes/device':>14}"
        lines = [f"Embedding plan: {len(self.tables)} tables on {self.num_devices} devices, "
                 f"optimizer {self.optimizer}, global batch {self.global_batch}", head, "-" * len(head)]
        for t in self.tables:
            devs = "all" if len(t.devices) == self.num_devices else ",".join(map(str, t.devices))
            lines.append(f"{t.spec.name:<14}{t.spec.rows:>12,}{t.spec.dim:>6}{t.spec.bag_size:>5}  "
                         f"{t.strategy.value:<11}{devs:<12}{_fmt_bytes(t.param_bytes_per_device()):>14}")
        totals = self.per_device_bytes()
        lines.append("")
        lines.append("Per device: " + ", ".join(f"{k.replace('_', ' ')} {_fmt_bytes(v)}" for k, v in totals.items())
                     + f"; total {_fmt_bytes(sum(totals.values()))}")
        lines.append(f"Predicted exchange per step per device: {_fmt_bytes(self.exchange_bytes_per_step())}")
        return "\n".join(lines)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def plan_embeddings(specs: tuple[TableSpec, ...], sharding: str, num_devices: int,
                    optimizer: str, global_batch: int) -> EmbeddingPlan:
    """Choose a strategy per table. ``auto`` picks replicated while that is the only one built."""
    strategy = Strategy.REPLICATED if sharding == "auto" else Strategy(sharding)
    if strategy not in IMPLEMENTED:
        raise NotImplementedError(
            f"embedding.sharding={sharding}: only {', '.join(s.value for s in IMPLEMENTED)} "
            "(and auto) are available in this version"
        )
    everyone = tuple(range(num_devices))
    return EmbeddingPlan(tuple(TablePlan(s, strategy, everyone) for s in specs), num_devices,
                         optimizer, global_batch)
