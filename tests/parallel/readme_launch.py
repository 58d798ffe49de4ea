"""The README's laptop launch line: test_multiprocess runs it, test_docs checks its form."""

from tests.helpers import REPO


def readme_launch_line() -> list[str]:
    """The README's first laptop launch command, as a user copies it."""
    with open(REPO / "README.md") as f:
        line = next(x.strip() for x in f if x.startswith("scripts/launch_local.sh "))
    return line.split("#")[0].split()
