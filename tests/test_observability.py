"""TensorBoard events and `dlrm-jax report` plots carry exactly what metrics.jsonl holds."""

import json
import struct

import pytest

from dlrm_jax.train.metrics import tensorboard_tag
from dlrm_jax.train.trainer import train_and_evaluate

QUIET = dict(log=lambda *_: None)


def read_scalars(folder) -> dict[tuple[str, int], float]:
    """(tag, step) -> value over every event file in ``folder``, later files winning (a resumed
    run's file is newer); records are TFRecord framed: length, crc, Event proto, crc."""
    from tensorboardX.proto.event_pb2 import Event

    scalars = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for v in event.summary.value:
                scalars[v.tag, event.step] = v.simple_value
    return scalars


def test_tensorboard_scalars_match_metrics_jsonl_across_a_resume(tiny, tmp_path):
    overrides = ["mesh.devices=2", "train.log_every=1", "train.eval_every=3", "train.checkpoint_every=3",
                 "train.tensorboard=true", "embedding.sharding=row"]
    train_and_evaluate(tiny(*overrides, "train.steps=3"), tmp_path, **QUIET)
    train_and_evaluate(tiny(*overrides, "train.steps=6"), tmp_path, **QUIET)
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scalars = read_scalars(tmp_path / "tensorboard")
    expected = {(tensorboard_tag(k), e["step"]): v for e in events for k, v in e.items()
                if k not in ("step", "event") and isinstance(v, int | float)}
    assert {"train/loss", "train/samples_per_s", "eval/auc", "eval/logloss", "exchange/a2a_bytes",
            "exchange/exchange_overflows"} <= {tag for tag, _ in expected}
    assert set(scalars) == set(expected)
    for key, value in expected.items():
        assert scalars[key] == pytest.approx(value, rel=1e-6), key
    assert sorted({s for t, s in scalars if t == "eval/auc"}) == [3, 6]


def test_no_tensorboard_folder_unless_asked(tiny, tmp_path):
    train_and_evaluate(tiny("train.steps=2"), tmp_path, **QUIET)
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tensorboard").exists()
