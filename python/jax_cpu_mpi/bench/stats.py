"""One measurement (a method at a size) and its statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Measurement:
    """Timed samples of one method, one kind, one message size.

    ``seconds`` holds one entry per sample, already divided down to the unit the tables
    report: for ``latency``, one one-way message (half a ping-pong round trip, or one hop of
    a scan); for ``bandwidth``, one message of a streamed window.
    """

    method: str
    kind: str  # "latency" | "bandwidth"
    size: int  # bytes per message
    seconds: np.ndarray
    warmup: int
    messages_per_sample: int  # one-way messages behind each sample
    wrong: int  # received bytes that differ from what was sent (all ranks)
    mode: str  # "mpi" (2 processes), "local" (1 process), "gpu"
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def samples(self) -> int:
        return int(self.seconds.size)

    @property
    def valid(self) -> bool:
        return self.wrong == 0

    def latency_us(self) -> dict[str, float]:
        us = self.seconds * 1e6
        return dict(
            min=float(us.min()),
            median=float(np.median(us)),
            mean=float(us.mean()),
            p99=float(np.percentile(us, 99)),
            max=float(us.max()),
        )

    def bandwidth_mbps(self) -> dict[str, float]:
        """MB/s (10^6 bytes per second, as OSU reports) from the median, best and worst."""
        mb = self.size / 1e6
        return dict(
            median=mb / float(np.median(self.seconds)),
            max=mb / float(self.seconds.min()),
            min=mb / float(self.seconds.max()),
        )

    def to_json(self) -> dict[str, Any]:
        median_s = float(np.median(self.seconds))
        record: dict[str, Any] = dict(
            type="result",
            method=self.method,
            kind=self.kind,
            mode=self.mode,
            size=self.size,
            count=self.size,
            dtype="uint8",
            samples=self.samples,
            warmup=self.warmup,
            messages_per_sample=self.messages_per_sample,
            latency_us=self.latency_us(),
            time_us=median_s * 1e6,
            algbw_GBps=self.size / median_s / 1e9,
            busbw_GBps=self.size / median_s / 1e9,  # point to point: bus bw = algorithm bw
            wrong=self.wrong,
            validation="Pass" if self.valid else "Fail",
            description=self.description,
        )
        if self.kind == "bandwidth":
            record["bandwidth_MBps"] = self.bandwidth_mbps()
        record.update(self.extra)
        return record
