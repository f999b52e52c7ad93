"""Command line of the benchmark, message sizes and the iteration plan of each size.

Every rank parses the same command line and derives the same plan from it (iteration counts
depend on the size only, never on measured times), so ranks run their loops in lockstep.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from jax_cpu_mpi._src.runtime.config import parse_bytes

#: Method names, in the order they run. ``/call``: one jitted call per message (ping-pong:
#: one call per round trip); ``/scan``: many messages inside one jitted ``lax.scan``.
MPI_METHODS = (
    "mpi4py",
    "psend/call",
    "psend/scan",
    "psend2/scan",
    "mpi4jax/call",
    "mpi4jax/scan",
    "gloo/call",
    "gloo/scan",
    "ppermute/scan",
    "jit-floor",
    "hop-floor",
)
LOCAL_METHODS = (
    "memcpy",
    "hop-floor-local",
    "psend-local/call",
    "psend-local/scan",
    "ppermute-local/call",
    "ppermute-local/scan",
    "jit-floor-local",
)
#: Measured only when named in --methods (the ping-pong and the patterns: see
#: bench/methods.py and bench/patterns.py).
EXTRA_METHODS = ("psend-donated/scan",)
GPU_METHODS = (
    "psend-nccl/call",
    "psend-nccl/scan",
    "ppermute-nccl/call",
    "ppermute-nccl/scan",
    "jit-floor-gpu",
)
ALL_METHODS = MPI_METHODS + LOCAL_METHODS + EXTRA_METHODS + GPU_METHODS
KINDS = ("latency", "bandwidth", "bibw", "exchange", "ring", "multi-pair")
#: ``--pattern`` names: OSU's and nccl-tests' (pingpong and bw are the kinds latency and
#: bandwidth; the others are measured by :mod:`.patterns`).
PATTERNS = {"pingpong": "latency", "bw": "bandwidth", "bibw": "bibw", "exchange": "exchange",
            "ring": "ring", "multi-pair": "multi-pair"}


def format_size(size: int) -> str:
    """``8`` -> ``"8 B"``, ``16777216`` -> ``"16 MiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def size_range(min_size: int, max_size: int, step: int) -> list[int]:
    """Sizes ``max_size / step**i`` down to ``min_size``, plus ``min_size`` itself.

    Anchored at the top so that 16 MiB and 64 MiB are both in the default powers-of-4 list.
    """
    if min_size < 1 or max_size < min_size:
        raise ValueError(f"need 1 <= min size ({min_size}) <= max size ({max_size})")
    if step < 2:
        raise ValueError(f"--step must be >= 2, got {step}")
    sizes = {min_size}
    size = max_size
    while size >= min_size:
        sizes.add(size)
        size //= step
    return sorted(sizes)


def parse_sizes(text: str) -> list[int]:
    """``"8,1K,16MiB"`` -> ``[8, 1024, 16777216]``."""
    try:
        sizes = sorted({parse_bytes(part) for part in text.split(",") if part.strip()})
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--sizes: {e}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"--sizes needs positive byte counts, got {text!r}")
    return sizes


def _bytes_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@dataclass(frozen=True)
class Plan:
    """How one message size is measured."""

    size: int
    iters: int  # per-call samples (ping-pong round trips, memcpy copies)
    warmup: int  # untimed repetitions before the samples (the first one compiles)
    hops: int  # one-way messages inside one scan call (even: round trips of 2 hops)
    scan_samples: int  # scan calls timed
    window: int  # one-way messages per bandwidth sample (then one acknowledgement)
    window_samples: int  # bandwidth samples
    scan_warmup: int  # untimed scan calls (the first one compiles)
    window_warmup: int  # untimed windows


@dataclass(frozen=True)
class Options:
    """Everything the command line sets."""

    sizes: tuple[int, ...]
    methods: tuple[str, ...]
    kinds: tuple[str, ...]
    platform: str = "cpu"
    formats: tuple[str, ...] = ("osu",)
    out: str | None = None
    json: str | None = None
    plot: str | None = None
    max_iters: int = 1000
    min_iters: int = 20
    iter_bytes: int = 512 << 20
    max_hops: int = 256
    max_window: int = 64
    window_bytes: int = 512 << 20
    scan_bytes: int = 4 << 30
    min_samples: int = 10
    local_devices: int = 2
    progress: bool = True
    repeat: int = 1
    rounds: int = 1

    def plan(self, size: int) -> Plan:
        iters = max(self.min_iters, min(self.max_iters, self.iter_bytes // size))
        warmup = max(2, iters // 10)
        # Enough messages per call that the call's own cost (dispatch, fresh buffers) fades:
        # on the 2-core VM, the fresh output buffers and the copies into the loop carry of
        # a call cost about 2 ms per MiB of message (page faults), 8 hops' worth at 64 MiB.
        hops = max(2, min(self.max_hops, self.scan_bytes // size) & ~1)
        scan_samples = max(self.min_samples, -(-2 * iters // hops))
        window = max(2, min(self.max_window, self.window_bytes // size))
        window_samples = max(self.min_samples, iters // window)
        return Plan(size, iters, warmup, hops, scan_samples, window, window_samples,
                    scan_warmup=max(2, -(-2 * warmup // hops)),
                    window_warmup=max(2, -(-warmup // window)))


def _select_methods(text: str, platform: str) -> tuple[str, ...]:
    default = GPU_METHODS if platform == "gpu" else MPI_METHODS + LOCAL_METHODS
    if text == "all":
        return default
    chosen: list[str] = []
    for word in (w.strip() for w in text.split(",") if w.strip()):
        matches = [m for m in ALL_METHODS if m == word or m.split("/")[0] == word]
        if not matches:
            raise SystemExit(
                f"--methods: unknown method {word!r}; choose among {', '.join(ALL_METHODS)} "
                "(a name before '/' selects both its /call and /scan variants)"
            )
        chosen.extend(m for m in matches if m not in chosen)
    return tuple(m for m in ALL_METHODS if m in chosen)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_cpu_mpi.bench",
        description=(
            "Latency and bandwidth of jax_cpu_mpi.psend/precv (this package, over MPI and between "
            "devices of one process) next to raw MPI (mpi4py), JAX ppermute over gloo, mpi4jax "
            "and numpy memcpy; --platform gpu: psend/precv over NCCL. Run it under "
            "`mpirun -n 2` for the MPI methods."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: this package (MPI and in-process); gpu: JAX's NCCL lowering")
    p.add_argument("--methods", default="all",
                   help=f"comma-separated subset of: {', '.join(ALL_METHODS)}")
    p.add_argument("--kinds", default="latency,bandwidth",
                   help="latency (ping-pong, half the round trip), bandwidth (window of "
                        "one-way messages, then an acknowledgement)")
    p.add_argument("--pattern", default=None,
                   help="comma-separated subset of: pingpong (osu_latency), bw (osu_bw), bibw "
                        "(osu_bibw), exchange (nccl-tests sendrecv_perf, 2 ranks: both ways in "
                        "one step), ring (sendrecv_perf, P ranks), multi-pair (osu_mbw_mr); "
                        "overrides --kinds")
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help="explicit sizes, e.g. 8,1K,16M (overrides --min-size/--max-size/--step)")
    p.add_argument("--min-size", type=_bytes_arg, default=8, help="smallest message (bytes)")
    p.add_argument("--max-size", type=_bytes_arg, default=64 << 20,
                   help="largest message (bytes)")
    p.add_argument("--step", type=int, default=4, help="ratio between consecutive sizes (2 or 4)")
    p.add_argument("--format", default="osu",
                   help="tables to print: osu, nccl or osu,nccl (JSON lines go to --json)")
    p.add_argument("--out", default=None,
                   help="folder for results.jsonl, osu.txt, nccl.txt, targets.txt and plot.png")
    p.add_argument("--json", default=None, help="also write JSON lines here ('-': stdout)")
    p.add_argument("--plot", default=None, help="also write the PNG plot here")
    p.add_argument("--max-iters", type=int, default=1000, help="samples at the smallest sizes")
    p.add_argument("--min-iters", type=int, default=20, help="samples at the largest sizes")
    p.add_argument("--iter-bytes", type=_bytes_arg, default=512 << 20,
                   help="iterations of a size: this many bytes / size, within the bounds above")
    p.add_argument("--max-hops", type=int, default=256,
                   help="messages inside one scan call (fewer for large sizes: --scan-bytes)")
    p.add_argument("--max-window", type=int, default=64,
                   help="messages in flight per bandwidth sample (OSU's window)")
    p.add_argument("--window-bytes", type=_bytes_arg, default=512 << 20,
                   help="windows shrink so that messages x size stays under this")
    p.add_argument("--scan-bytes", type=_bytes_arg, default=4 << 30,
                   help="scans (ping-pong and stream) shrink so that messages x size stays "
                        "under this")
    p.add_argument("--min-samples", type=int, default=10,
                   help="at least this many samples per measurement")
    p.add_argument("--local-devices", type=int, default=2,
                   help="CPU devices per process (the in-process methods need 2)")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure each method and size this many times; keep the best median "
                        "(the quietest moment of a shared machine)")
    p.add_argument("--rounds", type=int, default=1,
                   help="interleave: at each size, measure every method once per round, this "
                        "many rounds (raw, ours, raw, ours, ...); the tables use the samples "
                        "of all rounds, the targets the median over rounds of the per-round "
                        "ratio")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 8 B to 4 KiB, few iterations (numbers are not meaningful)")
    # The bar is on by default: no "(default: True)" from ArgumentDefaultsHelpFormatter,
    # which would read as if --no-progress were on.
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   default=argparse.SUPPRESS,
                   help="no progress bar on stderr (the bar is shown by default)")
    return p


def parse(argv: list[str] | None = None) -> Options:
    args = build_parser().parse_args(argv)
    formats = tuple(f.strip() for f in args.format.split(",") if f.strip())
    bad = [f for f in formats if f not in ("osu", "nccl")]
    if bad or not formats:
        raise SystemExit(f"--format: expected osu, nccl or osu,nccl; got {args.format!r}")
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if not kinds or any(k not in KINDS for k in kinds):
        raise SystemExit(f"--kinds: expected latency, bandwidth or both; got {args.kinds!r}")
    if args.pattern is not None:
        chosen = [w.strip() for w in args.pattern.split(",") if w.strip()]
        bad = [w for w in chosen if w not in PATTERNS]
        if bad or not chosen:
            raise SystemExit(f"--pattern: unknown {', '.join(bad) or repr(args.pattern)}; "
                             f"choose among {', '.join(PATTERNS)}")
        kinds = tuple(dict.fromkeys(PATTERNS[w] for w in chosen))
    if args.local_devices < 1:
        raise SystemExit(f"--local-devices must be >= 1, got {args.local_devices}")
    extra: dict[str, int] = {}
    if args.quick:
        extra = dict(max_iters=20, min_iters=4, max_hops=8, max_window=8, min_samples=3)
        sizes = args.sizes or size_range(8, 4096, 8)
    else:
        try:
            sizes = args.sizes or size_range(args.min_size, args.max_size, args.step)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    for name in ("max_iters", "min_iters", "max_hops", "max_window", "min_samples", "repeat",
                 "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    return Options(
        sizes=tuple(sizes),
        methods=_select_methods(args.methods, args.platform),
        kinds=kinds,
        platform=args.platform,
        formats=formats,
        out=args.out,
        json=args.json,
        plot=args.plot,
        max_iters=extra.get("max_iters", args.max_iters),
        min_iters=extra.get("min_iters", args.min_iters),
        iter_bytes=args.iter_bytes,
        max_hops=extra.get("max_hops", args.max_hops),
        max_window=extra.get("max_window", args.max_window),
        window_bytes=args.window_bytes,
        scan_bytes=args.scan_bytes,
        min_samples=extra.get("min_samples", args.min_samples),
        local_devices=args.local_devices,
        progress=getattr(args, "progress", True),  # SUPPRESS: absent unless given
        repeat=args.repeat,
        rounds=args.rounds,
    )
