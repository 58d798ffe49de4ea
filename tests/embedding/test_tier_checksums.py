"""Row checksums of the disk tier: damage is an error naming the file and rows, never values."""

import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from dlrm_jax.embedding.tiers.format import CHECKSUMS, TierError
from dlrm_jax.embedding.tiers.integrity import RowsDamaged
from dlrm_jax.embedding.tiers.store import TierStore
from tests.embedding.tier_store_cases import CHUNK_ROWS, TABLES, assert_equal, contents, full, new_values, reference

CHUNK = "cat_0/values/c.1.0"  # rows 8..15 of cat_0, 64 bytes each


@pytest.fixture(params=[False, True], ids=["requests", "mapped"])
def store(tmp_path, request):
    s = TierStore.create(tmp_path / "tier", TABLES, reference, CHUNK_ROWS)
    s.mapped = request.param
    yield s
    s.close()


def random_bytes(path: Path) -> None:
    path.write_bytes(np.random.default_rng(0).integers(0, 256, path.stat().st_size, np.uint8).tobytes())


def one_flipped_byte(path: Path) -> None:  # row 10, its third float's lowest byte
    data = bytearray(path.read_bytes())
    data[2 * 64 + 8] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, rows",
    [
        (random_bytes, "rows 8, 9, 10 and 5 more"),
        (one_flipped_byte, "row 10 of table cat_0 does not match its checksum"),
    ],
)
def test_a_damaged_chunk_is_an_error_naming_it_and_its_rows(store, tmp_path, damage, rows):
    store.read("cat_0", np.arange(37))  # its files are open (and mapped) before the damage
    damage(tmp_path / "tier/work" / CHUNK)
    with pytest.raises(RowsDamaged) as e:
        store.read("cat_0", np.array([3, 30, 10, 9, 8, 11, 12, 13, 14, 15]))
    said = str(e.value)
    assert said.startswith(f"{tmp_path / 'tier/work' / CHUNK}: {rows}") and "the file changed after the tier" in said
    assert "re-running resumes from the newest checkpoint whose disk-tier snapshot is intact" in said
    assert "\n" not in said
    others = np.array([0, 7, 16, 36])  # the other chunks still read
    assert_equal(store.read("cat_0", others), {f: v[others] for f, v in full("cat_0").items()})


def test_a_damaged_file_every_snapshot_holds_says_no_copy_is_intact(store, tmp_path):
    store.snapshot(1)
    store.write("cat_0", np.array([30]), new_values(store, "cat_0", 1, seed=0))  # c.1 stays shared
    store.snapshot(2)
    random_bytes(tmp_path / "tier/work" / CHUNK)  # the one file work/ and both snapshots link
    with pytest.raises(RowsDamaged, match="every snapshot of the disk tier .steps 1, 2. holds this same file"):
        store.read("cat_0", np.array([9]))
    with pytest.raises(RowsDamaged) as e:  # a restore checks every row first and changes nothing
        store.restore(1)
    assert str(tmp_path / "tier/snapshots/1" / CHUNK) in str(e.value) and "no checkpoint" in str(e.value)


def test_restores_refuse_a_damaged_snapshot_and_take_an_intact_one(store, tmp_path):
    store.snapshot(1)
    at_1 = contents(store)
    store.write("cat_0", np.array([9, 30]), new_values(store, "cat_0", 2, seed=0))  # c.1 copied: work's own
    store.snapshot(2)
    one_flipped_byte(tmp_path / "tier/snapshots/2" / CHUNK)  # and so work/'s, the same file
    with pytest.raises(
        RowsDamaged,
        match="snapshots/2/cat_0/values/c.1.0: row 10 of table cat_0 does not match its checksum: the file changed after the tier wrote it$",
    ):
        store.restore(2)
    store.restore(1)  # its own copy of c.1 is intact: checksums kept through snapshot and restore
    assert_equal(contents(store), at_1)
    store.write("cat_0", np.arange(16), new_values(store, "cat_0", 16, seed=1))
    store.restore(1)
    assert_equal(contents(store), at_1)


def test_a_row_torn_by_a_write_in_flight_is_read_again_not_called_damaged(store, tmp_path, monkeypatch):
    """Reads take no lock: one may see a write's new values beside their old checksums. Here
    the writer holds the lock with the values on disk and not the checksums when the read runs."""
    new = new_values(store, "cat_0", 1, seed=3)
    real, reads, torn = store._read_sorted, [], threading.Event()

    def read_half_written(wanted, per_thread):
        if not reads:
            with open(tmp_path / "tier/work" / CHUNK, "r+b") as f:
                f.seek(2 * 64)  # row 10's values, the first half of the write
                f.write(new["values"].tobytes())
        reads.append(wanted)
        got = real(wanted, per_thread)
        torn.set()
        return got

    monkeypatch.setattr(store, "_read_sorted", read_half_written)
    got = {}
    with store._lock:  # the writer's
        reader = threading.Thread(target=lambda: got.update(store.read("cat_0", np.array([10]))))
        reader.start()
        assert torn.wait(30)
        store.write("cat_0", np.array([10]), new)  # the whole write, as the writer would finish it
    reader.join(30)
    assert len(reads) == 2, "the torn row was not read again"
    assert_equal(got, new)


def test_stores_made_before_checksums_read_and_write_unchecked(tmp_path):
    with TierStore.create(tmp_path / "tier", TABLES, reference, CHUNK_ROWS) as store:
        store.snapshot(1)
    for folder in [tmp_path / "tier/work", tmp_path / "tier/snapshots/1"]:
        for table in TABLES:
            shutil.rmtree(folder / table / CHECKSUMS)
    with TierStore.open(tmp_path / "tier", TABLES) as old:
        assert old.unverified_tables() == list(TABLES)
        old.write("cat_1", np.array([2]), {"values": new_values(old, "cat_1", 1, seed=0)["values"]})
        old.restore(1)
        assert_equal(contents(old), {t: full(t) for t in TABLES})
        assert not (tmp_path / "tier/work/cat_0" / CHECKSUMS).exists()


def test_every_write_needs_every_field_and_exports_leave_checksums_out(store, tmp_path):
    with pytest.raises(ValueError, match=r"needs every field .* no \['accumulator'\]"):
        store.write("cat_0", np.array([1]), {"values": np.zeros((1, 16), np.float32)})
    store.export(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out/cat_0").iterdir()) == ["accumulator", "values"]
    one_flipped_byte(tmp_path / "tier/work" / CHUNK)
    with pytest.raises(RowsDamaged, match=f"{tmp_path / 'tier/work' / CHUNK}: row 10 of table cat_0 does not"):
        store.export(tmp_path / "again")
    with pytest.raises(ValueError, match=CHECKSUMS):
        TierStore.create(tmp_path / "other", {"t": (4, {CHECKSUMS: ((), "float32")})}, reference)
    assert isinstance(RowsDamaged(tmp_path, "x"), TierError)  # an OSError: the CLI's one-line error
