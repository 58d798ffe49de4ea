"""The CLI's commands are a registry: a new command is one module and a row of ``COMMANDS``, a
new bench suite a row of ``SUITES``; nothing else in the package changes."""

import types

from dlrm_jax.cli import commands, main
from dlrm_jax.cli.commands import bench


def toy_command() -> types.ModuleType:
    """A command module as a contributor writes one: NAME, HELP, add_arguments, run."""
    toy = types.ModuleType("toy")
    toy.NAME, toy.HELP = "toy", "say hello"
    toy.add_arguments = lambda p: p.add_argument("--who", default="world")

    def run(args) -> int:
        print(f"hello {args.who}")
        return 3

    toy.run = run
    return toy


def test_a_new_command_is_a_module_and_a_row(monkeypatch, capsys):
    monkeypatch.setattr(commands, "COMMANDS", (*commands.COMMANDS, toy_command()))
    assert main(["toy", "--who", "you"]) == 3
    assert capsys.readouterr().out == "hello you\n"


def test_a_new_bench_suite_is_a_row(monkeypatch, capsys):
    ran = []
    suite = bench.Suite("count to three", lambda p: p.add_argument("--to", type=int, default=3), ran.append)
    monkeypatch.setitem(bench.SUITES, "toy", suite)
    assert main(["bench", "toy", "--to", "5"]) == 0
    assert ran[0].to == 5


def test_every_command_and_suite_is_listed_once_with_its_help():
    names = [c.NAME for c in commands.COMMANDS]
    assert len(set(names)) == len(names) and names[:2] == ["train", "eval"]
    for c in commands.COMMANDS:
        assert c.HELP and callable(c.add_arguments) and callable(c.run), c.NAME
    assert all(s.help for s in bench.SUITES.values())
