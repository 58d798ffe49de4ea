"""The package as a wheel installs it: shipped configs and schemas are package data, every module
is in it, and ``dlrm-jax train --config smoke`` runs from that copy, away from the checkout.
(``scripts/check_wheel_install.sh`` does the same in a fresh venv with dependencies from PyPI.)"""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.child_env import child_env

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def unpacked_wheel(tmp_path_factory):
    """The wheel built from a copy of the sources (the checkout's build/ untouched), unpacked."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO / "dlrm_jax", src / "dlrm_jax", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp), str(src)]
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    (wheel,) = tmp.glob("dlrm_jax-*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp / "site")
    return tmp / "site"


def test_wheel_holds_every_module_config_and_schema(unpacked_wheel):
    for part in ("*.py", "configs/*.yaml", "configs/*/*.yaml"):
        shipped = {
            p.relative_to(REPO / "dlrm_jax") for p in (REPO / "dlrm_jax").rglob(part) if "__pycache__" not in p.parts
        }
        assert shipped, part
        missing = [p for p in shipped if not (unpacked_wheel / "dlrm_jax" / p).is_file()]
        assert not missing, f"not in the wheel: {missing}"


@pytest.mark.slow
def test_the_installed_copy_trains_the_smoke_config_by_name(unpacked_wheel, tmp_path):
    env = child_env(drop=())
    env["PYTHONPATH"] = str(unpacked_wheel)  # ahead of the checkout's editable install

    def cli(*args):
        proc = subprocess.run(
            [sys.executable, "-m", "dlrm_jax", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    where = subprocess.run(
        [sys.executable, "-c", "import dlrm_jax, dlrm_jax.config as c; print(dlrm_jax.__file__, c.CONFIG_DIR)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.count(str(unpacked_wheel)) == 2, where
    out = cli("train", "--config", "smoke", "--set", "train.steps=4", "--run-dir", "run")
    assert "final step=4" in out
    schema = subprocess.run(
        [
            sys.executable,
            "-c",
            "from dlrm_jax.data.preprocessing.tabular_schema import load_schema; print(load_schema('movielens_1m').path)",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert schema.returncode == 0 and schema.stdout.startswith(str(unpacked_wheel)), schema.stderr[-2000:]
