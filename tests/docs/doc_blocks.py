"""The docs convention: find the code blocks of README.md and docs/*.md, with their markers.

A ```` ```python ```` block runs as written. The marker lines right before it (HTML comments,
invisible on GitHub and in Sphinx) say how; several markers mean several runs:

* none: one process, 1 CPU device;
* ``<!-- run: devices=4 -->``: one process, ``--xla_force_host_platform_device_count=4``;
* ``<!-- run: mpirun -n 2 devices=1 -->``: under ``mpirun -n 2``, that many devices per rank;
* ``<!-- run: shell -->`` (```` ```bash ```` blocks only; others are never run): ``bash``
  in the repository root, with this Python's ``bin`` first on ``PATH``;
* ``isolated`` after any of these: a fresh interpreter of its own (blocks of one page and
  device count otherwise share one interpreter, each in a fresh namespace);
  ``timeout=SECONDS`` raises the default limit;
* ``<!-- skip: reason -->``: not run.

A ```` ```text ```` block marked ``<!-- output -->`` right after a block is what that block
prints (under mpirun: rank 0's stdout).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_MARKER = re.compile(r"^<!--\s*(run|skip|output)\s*:?\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(`{3,})\s*([^\s`]*)")


class ConventionError(ValueError):
    """A page breaks the docs convention (a marker that applies to nothing, a bad marker)."""


@dataclass(frozen=True)
class Run:
    """How to run a block once."""

    mode: str  # "python", "mpirun" or "shell"
    devices: int = 1
    nprocs: int = 1
    isolated: bool = False
    timeout: float = 180.0

    def label(self) -> str:
        if self.mode == "shell":
            return "shell"
        text = f"devices={self.devices}"
        if self.mode == "mpirun":
            text = f"mpirun -n {self.nprocs} {text}"
        return text


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    runs: list[Run] = field(default_factory=list)
    skip: str | None = None
    expected: str | None = None

    @property
    def where(self) -> str:
        return f"{_rel(self.page)}:{self.line}"


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def parse_run(text: str, where: str) -> Run:
    words = text.split()
    mode, devices, nprocs, isolated, timeout = "python", 1, 1, False, 180.0
    i = 0
    while i < len(words):
        word = words[i]
        if word == "mpirun" and i + 2 < len(words) and words[i + 1] == "-n":
            mode, nprocs = "mpirun", int(words[i + 2])
            i += 3
            continue
        if word == "shell":
            mode = "shell"
        elif word == "isolated":
            isolated = True
        elif word.startswith("devices="):
            devices = int(word.split("=", 1)[1])
        elif word.startswith("timeout="):
            timeout = float(word.split("=", 1)[1])
        else:
            raise ConventionError(f"{where}: unknown word {word!r} in marker 'run: {text}'")
        i += 1
    return Run(mode, devices, nprocs, isolated, timeout)


def parse_page(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    pending: list[tuple[str, str, int]] = []  # markers seen right before the next fence
    last_block: Block | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        where = f"{_rel(page)}:{i + 1}"
        marker = _MARKER.match(line.strip())
        if marker:
            pending.append((marker.group(1), marker.group(2), i + 1))
            i += 1
            continue
        fence = _FENCE.match(line)
        if not fence:
            if line.strip() and pending:
                raise ConventionError(f"{where}: marker(s) at line(s) "
                                      f"{[p[2] for p in pending]} are not right before a block")
            i += 1
            continue
        ticks, lang = fence.group(1), fence.group(2)
        end = i + 1
        while end < len(lines) and not lines[end].startswith(ticks):
            end += 1
        code = "\n".join(lines[i + 1:end]) + "\n"
        kinds = {kind for kind, _, _ in pending}
        if "output" in kinds:
            if kinds != {"output"} or lang != "text" or last_block is None:
                raise ConventionError(f"{where}: <!-- output --> must stand alone before a "
                                      "```text block that follows a code block")
            if last_block.expected is not None:
                raise ConventionError(f"{where}: a second output block for {last_block.where}")
            last_block.expected = code
        else:
            block = Block(page, i + 1, lang, code)
            for kind, text, _ in pending:
                if kind == "skip":
                    if not text:
                        raise ConventionError(f"{where}: <!-- skip: --> needs a reason")
                    block.skip = text
                else:
                    block.runs.append(parse_run(text, where))
            if block.skip and block.runs:
                raise ConventionError(f"{where}: a block is either skipped or run")
            if lang == "python" and not block.skip and not block.runs:
                block.runs.append(Run("python"))
            if lang != "python" and any(r.mode != "shell" for r in block.runs):
                raise ConventionError(f"{where}: only ```python blocks run as Python")
            if lang != "bash" and any(r.mode == "shell" for r in block.runs):
                raise ConventionError(f"{where}: only ```bash blocks run as shell")
            blocks.append(block)
            last_block = block
        pending = []
        i = end + 1
    if pending:
        raise ConventionError(f"{_rel(page)}: marker(s) at the end of the page")
    return blocks


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in parse_page(page)]
