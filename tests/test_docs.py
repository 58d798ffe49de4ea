"""The documentation stays true to the code: every ``dlrm-jax`` command line in a
``bash`` block of README.md and docs/*.md parses with the real CLI parser and its ``--config``
and ``--set``s load; every config key the prose names exists; every ``scripts/``, ``examples/``,
``configs/`` path exists; every relative link (and its ``#anchor``) between the markdown files
resolves; docs/configs.md lists every key of the schema with its default. No JAX: seconds.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from dlrm_jax import config_doc
from dlrm_jax.cli import build_parser
from dlrm_jax.config import RENAMED_KEYS, ConfigError, load_config

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ALL_MD = [*DOCS, REPO / "BENCHMARKS.md"]
TWO_COMMANDS = [  # ARCHITECTURE.md section 3: the README starts with these, and .ci/run runs the second
    "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/dlrm-jax train",
    'python3 -m venv .venv && .venv/bin/pip install -e ".[test]" && .venv/bin/pytest -q',
]
SECTIONS = ("train", "data", "model", "embedding", "mesh")
FILE_SUFFIXES = {"txt", "yaml", "yml", "json", "jsonl", "npz", "npy", "py", "md", "log", "gz", "csv", "dat", "tsv"}


@dataclass(frozen=True)
class Line:
    """A logical line of a fenced block (backslash continuations joined): where, and its text."""

    path: Path
    number: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.number}"


def split_fences(path: Path) -> tuple[list[Line], list[tuple[int, str]]]:
    """Lines inside fenced blocks (joined), and the numbered lines of prose outside them."""
    code: list[Line] = []
    prose: list[tuple[int, str]] = []
    lang, pending, start = None, "", 0
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            lang = stripped[3:].strip() if lang is None else None
            continue
        if lang is None:
            prose.append((n, raw))
            continue
        start = start or n
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        code.append(Line(path, start, lang, pending + stripped))
        pending, start = "", 0
    return code, prose


def commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line, comments dropped, split at && || ; |."""
    tokens = shlex.split(line.removeprefix("$ "), comments=True)
    out, current = [], []
    for t in tokens:
        if t in ("&&", "||", ";", "|"):
            out.append(current)
            current = []
        else:
            current.append(t)
    out.append(current)
    return [c for c in out if c]


def dlrm_jax_argv(cmd: list[str]) -> list[str] | None:
    """The ``dlrm-jax`` arguments a command runs (directly, or through launch_local.sh)."""
    while cmd and re.fullmatch(r"[A-Z_]+=\S*", cmd[0]):  # VAR=value prefixes
        cmd = cmd[1:]
    if not cmd:
        return None
    if cmd[0].endswith("dlrm-jax"):
        return cmd[1:]
    if cmd[0].endswith("launch_local.sh"):
        rest = cmd[2:]
        return rest if rest and rest[0] in ("train", "eval", "profile") else ["train", *rest]
    if Path(cmd[0]).name.startswith("python") and cmd[1:3] == ["-m", "dlrm_jax"]:
        return cmd[3:]
    return None


def script_paths(cmd: list[str]) -> list[str]:
    """Repository files a command runs: ``python scripts/x.py``, ``scripts/launch_local.sh``."""
    paths = [cmd[0]] if cmd[0].startswith(("scripts/", "examples/")) else []
    if Path(cmd[0]).name.startswith("python") and len(cmd) > 1 and not cmd[1].startswith("-"):
        paths.append(cmd[1])
    return paths


def bash_lines() -> list[Line]:
    return [line for path in DOCS for line in split_fences(path)[0] if line.lang == "bash"]


def check_command(line: Line) -> list[str]:
    problems = []
    for cmd in commands(line.text):
        for p in script_paths(cmd):
            if not (REPO / p).is_file():
                problems.append(f"{line.where}: {p} does not exist")
        argv = dlrm_jax_argv(cmd)
        if argv is None:
            continue
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            problems.append(f"{line.where}: the CLI does not parse: dlrm-jax {shlex.join(argv)}")
            continue
        configs = [getattr(args, "config", None)]
        if isinstance(getattr(args, "configs", None), str):  # bench train / mlp-parallel
            configs = [c for c in args.configs.split(",") if c]
        for config in configs:
            try:
                load_config(config, list(getattr(args, "overrides", [])))
            except (ConfigError, OSError) as e:  # OSError: a --config file that is not there
                problems.append(f"{line.where}: {e}")
    return problems


def test_readme_starts_with_the_two_commands():
    """The first command in the README's first block, alone (a copy-paste of it trains, and
    does not go on into a 17-minute test run); the test command in a block of its own, before
    any other command."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = [b.splitlines() for b in text.split("```")[1::2]]  # fenced blocks: language line, then lines
    assert blocks[0] == ["bash", TWO_COMMANDS[0]], blocks[0]
    tests = [i for i, b in enumerate(blocks) if b == ["bash", TWO_COMMANDS[1]]]
    assert tests and all(
        b[0] != "bash" or "dlrm-jax" not in " ".join(b[1:]) or b[1:] == [TWO_COMMANDS[0]] or "cuda12" in b[1]
        for b in blocks[: tests[0]]
    ), blocks[: tests[0] + 1]


def test_readme_launch_line_is_the_laptop_form():
    from tests.parallel.readme_launch import readme_launch_line

    assert readme_launch_line() == ["scripts/launch_local.sh", "2", "--config", "smoke", "--set", "mesh.devices=8"]


def test_every_command_line_parses_and_its_config_loads():
    lines = bash_lines()
    assert sum(dlrm_jax_argv(c) is not None for x in lines for c in commands(x.text)) > 30
    problems = [p for line in lines for p in check_command(line)]
    assert not problems, "\n".join(problems)


def test_a_broken_command_line_is_caught(tmp_path):
    """The checker itself: a bad flag, a bad key, a bad value and a missing script are each named."""
    bad = [
        "dlrm-jax train --steps 3",
        "dlrm-jax plan --set embedding.shardin=row",
        "dlrm-jax train --set embedding.sharding=diagonal",
        "dlrm-jax train --config no_such_config",
        "python scripts/no_such_script.py",
    ]
    found = [check_command(Line(REPO / "README.md", i, "bash", text)) for i, text in enumerate(bad)]
    assert all(len(f) == 1 for f in found), found


def inline_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def check_span(span: str, keys: set[str], sections: set[str]) -> str | None:
    """What is wrong with an inline code span that names a config key (``mesh.devices=N``,
    ``--set a.b=1 --set c.d=2``); None when it names none or all is well."""
    m = re.fullmatch(r"(?:--set )?\"?([a-z_]+(?:\.[a-z_0-9]+)+)(=.*)?", span)
    if not m or m[1].split(".")[0] not in SECTIONS or m[1].rsplit(".", 1)[1] in FILE_SUFFIXES:
        return None
    if m[1] not in keys and m[1] not in sections:
        return "names no config key"
    if span.startswith("--set "):
        tokens = shlex.split(span)
        sets = [v for flag, v in zip(tokens, tokens[1:], strict=False) if flag == "--set"]
        placeholder = re.compile(r"[A-Z][A-Z_]*")  # mesh.devices=N stands for any value
        try:
            load_config(None, [v for v in sets if not placeholder.fullmatch(v.partition("=")[2])])
        except ConfigError as e:
            return str(e)
    return None


def test_config_keys_named_in_prose_exist():
    keys = {k.key for k in config_doc.schema_keys()} | set(RENAMED_KEYS)  # former names still load
    sections = {k.rsplit(".", i)[0] for k in keys for i in (1, 2)}
    problems = [
        f"{path.relative_to(REPO)}:{n}: `{span}`: {problem}"
        for path in ALL_MD
        for n, text in split_fences(path)[1]
        for span in inline_spans(text)
        if (problem := check_span(span, keys, sections))
    ]
    assert not problems, "\n".join(problems)
    assert check_span("embedding.hot.rowz", keys, sections) and check_span("--set train.steps=x", keys, sections)


def test_named_repository_paths_exist():
    pattern = re.compile(r"(?<![\w./-])((?:scripts|examples|configs|tests|docs)/[\w./-]*[\w/])")
    problems = [
        f"{path.relative_to(REPO)}: {p} does not exist"
        for path in ALL_MD
        for p in pattern.findall(path.read_text(encoding="utf-8"))
        if not (REPO / p).exists()
    ]
    assert not problems, "\n".join(problems)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for _, text in split_fences(path)[1]:
        m = re.match(r"#{1,6} (.+)", text)
        if m:
            s = slug(m[1])
            seen[s] = seen.get(s, -1) + 1
            if seen[s]:
                s = f"{s}-{seen[s]}"
                seen[s] = 0
    return set(seen)


def test_relative_links_resolve():
    problems = []
    for path in ALL_MD:
        for n, text in split_fences(path)[1]:
            for target in re.findall(r"\]\(([^)\s]+)\)", text):
                if re.match(r"[a-z]+:", target):
                    continue
                file, _, anchor = target.partition("#")
                dest = (path.parent / file).resolve() if file else path
                where = f"{path.relative_to(REPO)}:{n}: link {target}"
                if not dest.exists():
                    problems.append(f"{where}: {file} does not exist")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not problems, "\n".join(problems)


def test_every_doc_page_is_in_the_index():
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in DOCS if p.parent.name == "docs" and p.name != "README.md" and f"({p.name}" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


MULTI_PROCESS = {"--coordinator", "--coordinator-bind", "--num-processes", "--process-id", "--join-timeout"}


def usage_blocks() -> dict[tuple[str, ...], str]:
    """docs/cli.md's list of commands: each command's words (``("preprocess", "criteo")``) and
    its text, continuation lines included."""
    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8").split("```")[1]
    blocks: dict[tuple[str, ...], str] = {}
    words: tuple[str, ...] = ()
    for line in text.splitlines():
        if line.startswith("dlrm-jax "):
            words = tuple(w for w in line.split()[1:3] if re.fullmatch(r"[a-z][a-z-]*", w))
            blocks[words] = line
        elif line.strip() and words:
            blocks[words] += " " + line.strip()
    return blocks


def test_the_command_list_names_every_flag_of_every_command():
    """docs/cli.md promises every command and its flags (the multi-process ones in the table
    below it); a flag the parser takes and the list leaves out fails here."""
    blocks, missing = usage_blocks(), []
    subcommands = lambda parser: next(
        (a.choices for a in parser._actions if isinstance(a.choices, dict)),  # noqa: SLF001 - argparse's own
        {},
    )
    parser = build_parser()
    for name, sub in subcommands(parser).items():
        nested = subcommands(sub)
        for words, command in [((name, k), v) for k, v in nested.items()] if nested else [((name,), sub)]:
            text = blocks.get(words)
            if text is None:
                missing.append(f"dlrm-jax {' '.join(words)}: not listed")
                continue
            if "[the same" in text:  # preprocess tabular: "the same ... flags" as criteo's line
                text += blocks[(words[0], "criteo")]
            flags = {o for a in command._actions for o in a.option_strings if o.startswith("--")}  # noqa: SLF001
            for flag in sorted(flags - MULTI_PROCESS - {"--help"}):
                if not re.search(rf"{re.escape(flag)}(?![a-z-])", text):
                    missing.append(f"dlrm-jax {' '.join(words)}: {flag}")
    assert not missing, "docs/cli.md's command list leaves out:\n" + "\n".join(missing)


def test_configs_reference_matches_the_schema():
    text = config_doc.DOC_PATH.read_text(encoding="utf-8")
    problems = config_doc.problems(text, config_doc.DEFAULT_YAML.read_text(encoding="utf-8"))
    assert not problems, (
        "docs/configs.md, configs/default.yaml (regenerate: python -m dlrm_jax.config_doc):\n" + "\n".join(problems)
    )


@pytest.mark.parametrize("change", ["drop a row", "wrong default", "unknown key", "no meaning"])
def test_the_reference_check_fails_when_the_docs_fall_behind(change):
    text = config_doc.DOC_PATH.read_text(encoding="utf-8")
    row = next(x for x in text.splitlines() if x.startswith("| `train.steps` |"))
    edited = {
        "drop a row": text.replace(row + "\n", ""),
        "wrong default": text.replace(row, row.replace("`1000`", "`999`")),
        "unknown key": text.replace(row, row + "\n" + row.replace("train.steps", "train.stepz")),
        "no meaning": text.replace(row, row.rsplit("|", 2)[0] + f"| {config_doc.TODO} |"),
    }[change]
    assert config_doc.problems(edited)
    fixed = config_doc.render(edited)
    assert change == "no meaning" or "train.stepz" not in fixed


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_readme_first_command_ends_with_the_line_the_readme_shows(tmp_path):
    """The README's first command trains the embedded default and ends with the README's line:
    step and metrics to the spread the README gives for CPUs (their matrix kernels differ in
    the last bits; a wrong exchange or model moves AUC by 1e-2). The README once showed
    0.288854 / 0.928379 / 0.288325 where the command printed 0.289070 / 0.928436 / 0.289078."""
    import subprocess
    import sys

    from tests.child_env import child_env

    text = (REPO / "README.md").read_text(encoding="utf-8")
    shown = re.search(r"^final step=(\d+) loss=(\S+) auc=(\S+) logloss=(\S+) samples_per_s=\S+$", text, re.M)
    assert shown, "the README shows no final line"
    # As a user runs it: without the suite's compile flags (XLA's optimisation level moves the
    # fourth decimal too: level 0 gave AUC 0.927867 where the default gives 0.928163).
    env = {k: v for k, v in child_env().items() if k != "XLA_FLAGS"}
    run = subprocess.run(
        [sys.executable, "-m", "dlrm_jax", "train", "--set", "train.progress_bar=false"],
        capture_output=True,
        text=True,
        timeout=850,
        cwd=tmp_path,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = re.search(r"^final step=(\d+) loss=(\S+) auc=(\S+) logloss=(\S+) samples_per_s=\S+$", run.stdout, re.M)
    assert got and got.group(1) == shown.group(1), run.stdout[-2000:]
    for name, index, spread in (("loss", 2, 1e-3), ("auc", 3, 5e-4), ("logloss", 4, 1e-3)):
        assert abs(float(got.group(index)) - float(shown.group(index))) <= spread, (name, got.group(0), shown.group(0))


_SCRIPTS_HELP = """
import contextlib, io, runpy, sys
from pathlib import Path
sys.path.insert(0, "scripts")  # (as `python scripts/x.py` puts its folder first: gpu_bench's parts)
bad = []
for path in sorted(Path("scripts").glob("*.py")):
    if "argparse" not in path.read_text():
        continue
    sys.argv, out = [str(path), "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(path), run_name="__main__")
        bad.append(f"{path}: --help did not exit")
    except SystemExit as e:
        if e.code not in (0, None) or "usage:" not in out.getvalue():
            bad.append(f"{path}: --help exited {e.code} with {out.getvalue()[:200]!r}")
    except BaseException as e:
        bad.append(f"{path}: {type(e).__name__}: {e}")
print(bad)
"""


def test_every_script_the_docs_point_to_answers_help():
    """Before: ``python scripts/bench_checksums.py --help`` (docs/run-dirs.md) raised TypeError
    in the code that reads its device count before argparse runs; one process, every script."""
    import subprocess
    import sys

    from tests.child_env import child_env

    done = subprocess.run(
        [sys.executable, "-c", _SCRIPTS_HELP], cwd=REPO, capture_output=True, text=True, timeout=300, env=child_env()
    )
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout[-2000:], done.stderr[-2000:])
