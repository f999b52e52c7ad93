"""README.md stays short, links into the docs, and keeps the quickstart CI reads.

``.ci/run`` takes the test command from the second ```bash block before "## Why"; the first
block is the install-and-run command. Both are checked here as CI parses them.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MAX_LINES = 200

INSTALL = ("python3 -m venv .venv && .venv/bin/pip install . && "
           ".venv/bin/python -m jax_cpu_mpi.examples.pipeline")
TEST = ("python3 -m venv .venv && .venv/bin/pip install '.[test]' && "
        ".venv/bin/python -m pytest -q -n 2 --dist loadfile tests")


def test_readme_is_at_most_200_lines():
    lines = README.count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines; move content into docs/"


def _quickstart_commands() -> list[str]:
    """As .ci/run reads them: the first two bash blocks before '## Why', comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", README.split("## Why")[0], re.S)
    return [next(line for line in b.splitlines() if line.strip() and
                 not line.strip().startswith("#")) for b in blocks[:2]]


def test_quickstart_is_the_two_commands_ci_runs():
    assert _quickstart_commands() == [INSTALL, TEST]
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'split("## Why")[0]' in ci and "blocks[1]" in ci, ".ci/run parses differently now"


def test_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README.md links to a missing file: {target}"
