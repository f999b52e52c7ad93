"""A progress bar on stderr (one line per step when stderr is not a terminal)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``Progress(total)``; ``step(label)`` before each unit of work; ``close()`` at the end."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None,
                 width: int = 30) -> None:
        self.total = max(1, total)
        self.done = 0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.width = width
        self.start = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def step(self, label: str) -> None:
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.monotonic() - self.start
        line = f"[{bar}] {self.done}/{self.total} {elapsed:6.1f}s {label}"
        if self.tty:
            self.stream.write("\r" + line[:120].ljust(120))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.done += 1

    def close(self) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        line = f"[{'#' * self.width}] {self.total}/{self.total} {elapsed:6.1f}s done"
        self.stream.write(("\r" + line.ljust(120) + "\n") if self.tty else line + "\n")
        self.stream.flush()
