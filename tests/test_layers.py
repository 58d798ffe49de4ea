"""The package's layers: every import points down (docs/architecture.md, "Code layout")."""

import ast
import re
from pathlib import Path

import dlrm_jax

# Bottom first. A module may import its own unit and the units before it, never one after.
LAYERS = [
    (
        "ids",
        "hashing",
        "sorting",
        "few_segments",
        "chunks",
        "choices",
        "wording",
        "config_schema",
        "config_renames",
        "config_checks",
        "config",
        "files",
        "hostmem",
        "stopping",
        "jax_settings",
        "config_doc",
    ),
    ("parallel",),
    ("observe",),
    ("data",),
    ("embedding.dynamic",),
    ("embedding.plan",),
    ("embedding.hot",),
    ("embedding.exchange",),
    ("embedding.tiers",),
    ("serving",),
    ("model",),
    ("train",),
    ("bench",),
    ("cli",),
    ("__main__",),
]
RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}
ROOT = Path(dlrm_jax.__file__).parent


def unit_of(module: str) -> str:
    parts = module.split(".")[1:]
    if parts[:1] == ["embedding"] and len(parts) > 1:
        return "embedding." + parts[1]
    return parts[0]


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dlrm_jax."):
            names = [f"{node.module}.{a.name}" for a in node.names]
            # `from dlrm_jax.embedding.hot import refresh`: the module imported is the name
            yield from (
                n if unit_of(n) != unit_of(node.module) or node.module.count(".") < 2 else node.module for n in names
            )
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("dlrm_jax."))


def test_every_import_points_down():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        if module in ("dlrm_jax", "dlrm_jax.embedding"):
            continue  # the public API re-exports from every layer (lazily); a docstring
        unit = unit_of(module)
        assert unit in RANK, f"{module}: unit {unit} has no layer in LAYERS"
        for target in imports(path):
            if target.split(".")[1] == "embedding" and target.count(".") == 1:
                continue
            to = unit_of(target)
            if to != unit and RANK.get(to, -1) > RANK[unit]:
                wrong.append(f"{module} imports {target} ({to} is above {unit})")
    assert not wrong, "\n".join(wrong)


def _imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_the_plan_is_host_only_and_the_exchange_needs_nothing_of_data():
    """embedding/plan/ says nothing there is traced: it imports no JAX. The exchange and the
    plan take ids by the convention of dlrm_jax.ids, not from data/."""
    wrong = []
    for sub in ("plan", "exchange"):
        for path in sorted((ROOT / "embedding" / sub).glob("*.py")):
            for m in _imported_modules(path):
                if m.startswith("dlrm_jax.data") or (sub == "plan" and (m == "jax" or m.startswith("jax."))):
                    wrong.append(f"embedding/{sub}/{path.name} imports {m}")
    assert not wrong, "\n".join(wrong)


def test_nothing_under_embedding_drives_the_train_layers_steps_or_state():
    """Duck typing hides an upward dependency from the import check: no module under
    embedding/ names the train layer's step functions or train state (the tiered runner and
    the hot-row refresh that drove them live in train/ now: driver.py, tier_runner.py)."""
    names = re.compile(
        r"StepFunctions|TrainState|\.train_step\b|\.eval_step\b|\.fill_step\b|\.state_check\b"
        r"|\.device_batch\(|\bstate\.emb\b"
    )
    wrong = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in sorted((ROOT / "embedding").rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if names.search(line)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_config_stops_at_the_edge():
    """embedding/ and model/ take specs, plans and single config sections, never a whole
    Config (the name ``cfg``, the type, or an import of ``dlrm_jax.config``): train/wiring.py
    is the one module that reads a Config into those pieces."""
    wrong = []
    for unit in ("embedding", "model"):
        for p in sorted((ROOT / unit).rglob("*.py")):
            tree = ast.parse(p.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Name) and node.id in ("cfg", "Config"):
                    wrong.append(f"{p.relative_to(ROOT)}:{node.lineno}: names {node.id}")
                elif isinstance(node, ast.arg) and node.arg == "cfg":
                    wrong.append(f"{p.relative_to(ROOT)}:{node.lineno}: takes cfg")
                elif isinstance(node, ast.ImportFrom) and node.module == "dlrm_jax.config":
                    wrong.append(f"{p.relative_to(ROOT)}:{node.lineno}: imports dlrm_jax.config")
    assert not wrong, "\n".join(wrong)
