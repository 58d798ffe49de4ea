"""The notebook-facing API: every export resolves, and importing the package starts no JAX."""

import subprocess
import sys

import dlrm_jax


def test_every_export_resolves_with_a_docstring():
    for name in dlrm_jax.__all__:
        obj = getattr(dlrm_jax, name)
        assert obj.__doc__, name


def test_import_does_not_start_jax():
    code = "import sys, dlrm_jax; dlrm_jax.request_cpu_devices(3); print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_notebook_flow(tmp_path):
    code = (
        "import dlrm_jax\n"
        "dlrm_jax.request_cpu_devices(2)\n"
        "cfg = dlrm_jax.load_config('smoke', ['train.steps=4', 'train.progress_bar=false', 'mesh.devices=2'])\n"
        f"s = dlrm_jax.train_and_evaluate(cfg, {str(tmp_path)!r}, log=lambda *_: None)\n"
        "print(s.step, 0.0 <= s.auc <= 1.0)\n"
    )
    env_free = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=env_free)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "4 True"
