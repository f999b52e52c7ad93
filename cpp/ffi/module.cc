// The nanobind extension `jax_cpu_mpi._jax_cpu_mpi`: the low-level handles behind the Python
// package. It exposes the FFI handler capsules and the runtime controls; all policy (when to
// attach MPI, which communicator, configuration from the environment) lives in Python.
#include <mpi.h>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "bench/core_probe.h"
#include "common/keep_freed_memory.h"
#include "common/trace.h"
#include "ffi/device_thread_hint.h"
#include "ffi/mark.h"
#include "ffi/order_token.h"
#include "ffi/collective_handlers.h"
#include "ffi/p2p_handlers.h"
#include "ffi/runtime.h"
#include "ffi/uninitialized.h"
#include "local/zero_fill.h"
#include "mpi/exit_before_finalize.h"
#include "mpi/stop_for_test.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

std::string MpiLibraryVersion() {
  char version[MPI_MAX_LIBRARY_VERSION_STRING] = {0};
  int len = 0;
  if (int rc = MPI_Get_library_version(version, &len); rc != MPI_SUCCESS) {
    throw std::runtime_error(jcm::Status::MpiError("MPI_Get_library_version", rc).message());
  }
  return std::string(version, len);
}

// Which MPI the extension was compiled against: vendor, MPI standard version, and the
// size of the handle types (an ABI fingerprint: MPICH uses int handles, Open MPI pointers).
nb::dict BuildMpiInfo() {
  nb::dict info;
#if defined(MPICH_VERSION)
  info["vendor"] = "MPICH";
  info["vendor_version"] = MPICH_VERSION;
#elif defined(OMPI_MAJOR_VERSION)
  info["vendor"] = "Open MPI";
  info["vendor_version"] = std::to_string(OMPI_MAJOR_VERSION) + "." +
                           std::to_string(OMPI_MINOR_VERSION) + "." +
                           std::to_string(OMPI_RELEASE_VERSION);
#else
  info["vendor"] = "unknown";
  info["vendor_version"] = "";
#endif
  info["mpi_version"] = std::to_string(MPI_VERSION) + "." + std::to_string(MPI_SUBVERSION);
  info["comm_handle_bytes"] = sizeof(MPI_Comm);
#if defined(JAX_CPU_MPI_MPI_FROM_WHEEL)
  info["from_mpich_wheel"] = true;
#else
  info["from_mpich_wheel"] = false;
#endif
  return info;
}

}  // namespace

NB_MODULE(_jax_cpu_mpi, m) {
  m.doc() = "Low-level handles of jax_cpu_mpi: XLA FFI handlers and runtime controls.";

  m.def("registrations", [] {
    nb::dict d;
    d["jax_cpu_mpi_psend"] = EncapsulateFfiHandler(JcmPsend);
    d["jax_cpu_mpi_precv"] = EncapsulateFfiHandler(JcmPrecv);
    d["jax_cpu_mpi_device_thread_hint"] = EncapsulateFfiHandler(JcmDeviceThreadHint);
    d["jax_cpu_mpi_mark"] = EncapsulateFfiHandler(JcmMark);
    d["jax_cpu_mpi_all_reduce"] = EncapsulateFfiHandler(JcmAllReduce);
    d["jax_cpu_mpi_exchange"] = EncapsulateFfiHandler(JcmExchange);
    d["jax_cpu_mpi_collectives_end"] = EncapsulateFfiHandler(JcmCollectivesEnd);
    d["jax_cpu_mpi_order_token"] = EncapsulateFfiHandler(JcmOrderToken);
    d["jax_cpu_mpi_uninitialized"] = EncapsulateFfiHandler(JcmUninitialized);
    return d;
  }, "FFI handler capsules by target name.");

  m.def("set_meeting_handoff",
        [](int mode) {
          if (!jcm::SetMeetingHandoff(mode)) throw nb::value_error("mode must be 0, 1 or 2");
        },
        nb::arg("mode"),
        "When a device that does not lead its process's meeting in a collective parks "
        "(returns a pending future) instead of waiting there: 0 never (JAX_CPU_MPI_PARK=off), "
        "1 where the node has more busy threads than cores (auto, the default), 2 always "
        "(on); in every mode only in programs that allow it (passes/park_safety.py).");
  m.def("meeting_handoff", &jcm::MeetingHandoff);
  m.def("set_poison_uninitialized", &jcm::SetPoisonUninitialized, nb::arg("on"),
        "Whether jax_cpu_mpi_uninitialized fills its buffer with NaN (floats), the most "
        "negative (signed), the largest (unsigned) value or true, so that a read before a "
        "write shows (JAX_CPU_MPI_POISON_UNINITIALIZED); read at each call.");
  m.def("poison_uninitialized", &jcm::PoisonUninitialized);

  m.def("configure",
        [](double recv_timeout_s, uint64_t max_inflight_bytes) {
          if (!(recv_timeout_s > 0)) throw nb::value_error("recv_timeout_s must be > 0");
          if (max_inflight_bytes == 0) throw nb::value_error("max_inflight_bytes must be > 0");
          jcm::Config c;
          c.recv_timeout_s = recv_timeout_s;
          c.max_inflight_bytes = max_inflight_bytes;
          jcm::Runtime::Get().set_config(c);
        },
        nb::arg("recv_timeout_s"), nb::arg("max_inflight_bytes"));
  m.def("attach_mpi",
        [](int64_t comm_fortran_handle, std::vector<int> rank_of_process, int local_devices,
           int node_ranks, const std::string& wait, int node_cores) {
          jcm::WaitChoice choice;
          if (wait == "spin") {
            choice.policy = jcm::WaitPolicy::kSpin;
          } else if (wait == "sleep") {
            choice.policy = jcm::WaitPolicy::kSleep;
          } else if (wait != "auto") {
            throw nb::value_error("wait must be 'auto', 'spin' or 'sleep'");
          }
          choice.local_devices = local_devices;
          choice.node_ranks = node_ranks;
          choice.node_cores = node_cores;
          MPI_Comm comm = MPI_Comm_f2c(static_cast<MPI_Fint>(comm_fortran_handle));
          std::unique_ptr<jcm::MpiTransport> transport;
          // Ranks attach when they lower their first program, which may be minutes apart
          // (compilation): the receive timeout, but never less than kAttachWaitS.
          constexpr double kAttachWaitS = 600.0;
          const auto deadline = jcm::DeadlineAfter(
              std::max(jcm::Runtime::Get().config().recv_timeout_s, kAttachWaitS));
          jcm::Status s = jcm::MpiTransport::Create(comm, std::move(rank_of_process), deadline,
                                                    choice, &transport);
          if (!s.ok()) throw std::runtime_error("jax_cpu_mpi: cannot attach MPI: " + s.message());
          jcm::Runtime::Get().attach_mpi(std::move(transport));
        },
        nb::arg("comm_fortran_handle"), nb::arg("rank_of_process"), nb::arg("local_devices") = 1,
        nb::arg("node_ranks") = 1, nb::arg("wait") = "auto", nb::arg("node_cores") = 0,
        "Duplicate the communicator (given as its Fortran handle, see mpi4py's Comm.py2f) "
        "for our point-to-point traffic; `wait` (auto, spin, sleep), with this process's "
        "devices, the job's ranks on this node and the cores they run on together "
        "(0: unknown), says how waits for a peer go.");
  m.def("mpi_wait", [] {
    nb::dict d;
    std::shared_ptr<jcm::MpiTransport> t = jcm::Runtime::Get().mpi();
    if (t == nullptr) return d;
    const jcm::WaitChoice& w = t->wait_choice();
    d["local_devices"] = w.local_devices;
    d["node_ranks"] = w.node_ranks;
    d["cores"] = w.cores;
    d["sleeps_soon"] = w.sleeps_soon;
    switch (w.mode()) {
      case jcm::WaitMode::kBounded: d["mode"] = "bounded"; break;
      case jcm::WaitMode::kLong: d["mode"] = "long"; break;
      case jcm::WaitMode::kSoon: d["mode"] = "soon"; break;
    }
    return d;
  }, "How the attached MPI transport waits for peers (empty when MPI is not attached).");
  m.def("mpi_attached", [] { return jcm::Runtime::Get().mpi() != nullptr; });
  m.def("set_rank_hosts",
        [](std::vector<std::string> hosts) {
          jcm::Runtime::Get().set_rank_hosts(std::move(hosts));
        },
        nb::arg("hosts"), "Hostname of each MPI rank of our communicator (for messages).");
  m.def("rank_hosts", [] {
    std::vector<std::string> hosts;
    for (int r = 0;; ++r) {
      std::string h = jcm::Runtime::Get().host_of_rank(r);
      if (h.empty()) break;
      hosts.push_back(std::move(h));
    }
    return hosts;
  }, "Hostname of each MPI rank, as set by set_rank_hosts.");
  m.def("unreachable_peers", [] { return jcm::Runtime::Get().unreachable_peers(); },
        "MPI ranks that did not answer this process (a precv timed out, an MPI call failed).");
  m.def("job_broken", [] { return jcm::Runtime::Get().job_broken(); },
        "Whether the MPI transport gave up on a message that MPI could not cancel at its "
        "deadline (a peer stopped mid-message): the job should end, not go on.");
  m.def("_stop_mid_next_mpi_send",
        [](uint64_t min_bytes, double after_s) {
          jcm::StopMidSendForTest::Arm(
              min_bytes, std::chrono::microseconds(static_cast<int64_t>(after_s * 1e6)));
        },
        nb::arg("min_bytes"), nb::arg("after_s"),
        "Testing only: the next MPI send of at least min_bytes stops this process (SIGSTOP) "
        "at the first test that finds it incomplete after_s or more after it was posted, as "
        "a peer whose link dies mid-message; min_bytes 0 disarms.");
  m.def("_prefault_waiting_outputs", [](bool on) { jcm::SetOutputPrefault(on); },
        nb::arg("on"),
        "Benchmarks only: whether a precv that waits for its message faults its large output "
        "in meanwhile (on by default), so that one process can time both ways in turn.");
  m.def("_zero_fill_ends_by_page", [](bool on) { jcm::SetZeroFillEndsByPage(on); },
        nb::arg("on"),
        "Benchmarks only: whether the zeros of a large precv that is no destination give back "
        "the 4 KiB pages not in memory at the output's partial huge pages (on by default) or "
        "write them, so that one process can time both ways in turn.");
  m.def("exit_barrier_met", [] { return jcm::Runtime::Get().exit_barrier_met(); },
        "Whether detach_mpi met every rank in the exit barrier.");
  m.def("register_exit_before_finalize", [] { jcm::RegisterExitBeforeFinalize(); },
        "Register (once) the interpreter exit function that can end the process just before "
        "mpi4py's MPI_Finalize (call after importing mpi4py.MPI).");
  m.def("arm_exit_before_finalize", [](int status) { jcm::ArmExitBeforeFinalize(status); },
        nb::arg("status"),
        "End the process with this status just before MPI_Finalize, instead of finalizing.");
  m.def("mpi_ops_active", [] { return jcm::Runtime::Get().mpi_ops_active(); },
        "psend/precv handlers of this process using the MPI transport now.");
  m.def("close",
        [](double wait_s) {
          nb::gil_scoped_release release;
          return jcm::Runtime::Get().close(wait_s);
        },
        nb::arg("wait_s"),
        "At exit: end every psend/precv still waiting for a peer (with an error), wait up to "
        "wait_s for them to return, and return how many still run.");
  m.def("closing", [] { return jcm::Closing(); }, "Whether close() was called.");
  m.def("reopen", [] { jcm::g_closing.store(false, std::memory_order_relaxed); },
        "After jax.distributed.shutdown() closed MPI: waits for a peer in this process "
        "(devices of one process) wait again until their deadline.");
  m.def("take_failed_ops", [] { return jcm::Runtime::Get().take_failed_ops(); },
        "The errors of failed psend/precv ops since the last call (distinct texts with "
        "their counts), for the report at exit; clears them.");
  m.def("report_failed_ops_at_process_exit",
        [](const std::string& where) {
          jcm::Runtime::Get().report_failed_ops_at_process_exit(where);
        },
        nb::arg("where"),
        "Print the failed ops on stderr when the process exits, after the interpreter's "
        "finalization (where the CPU client joins its device threads), naming the process "
        "`where`.");
  m.def("detach_mpi",
        [](double timeout_s) {
          nb::gil_scoped_release release;
          return jcm::Runtime::Get().detach_mpi(timeout_s);
        },
        nb::arg("timeout_s"),
        "Complete outstanding sends (up to timeout_s) and free the communicator. Returns a "
        "report of undelivered messages, empty if none.");

  m.def("mpi_unreceived", [] {
    nb::list out;
    std::shared_ptr<jcm::MpiTransport> t = jcm::Runtime::Get().mpi();
    if (t == nullptr) return out;
    for (const jcm::MpiTransport::Unreceived& u : t->ProbeUnreceived()) {
      out.append(nb::make_tuple(u.kind, u.source, u.tag, u.bytes));
    }
    return out;
  }, "Messages peers sent to this process that no receive took yet (kind, MPI rank, tag, "
     "bytes): the first of each peer and kind (staged, ready, direct), nothing received.");
  m.def("forget_refused_channels", [] { jcm::Runtime::Get().suspect_channels().Clear(); },
        "Tests only: every channel that a failed call or a timed-out precv marked is usable "
        "again. Only right where no message was left behind (a precv no psend matches).");
  m.def("stats", [] {
    jcm::Runtime& rt = jcm::Runtime::Get();
    nb::dict d;
    d["mailbox_queued_messages"] = rt.mailbox().queued_messages();
    d["mailbox_queued_bytes"] = rt.mailbox().queued_bytes();
    auto mpi = rt.mpi();
    d["mpi_inflight_sends"] = mpi ? mpi->inflight_sends() : 0;
    d["mpi_inflight_bytes"] = mpi ? mpi->inflight_bytes() : 0;
    d["mpi_sends_completed"] = mpi ? mpi->sends_completed() : 0;
    d["mpi_peak_inflight_bytes"] = mpi ? mpi->peak_inflight_bytes() : 0;
    d["mpi_direct_sends"] = mpi ? mpi->direct_sends() : 0;
    d["mpi_staged_large_sends"] = mpi ? mpi->staged_large_sends() : 0;
    // Framed messages sent, and received, without their chunk header (the channel's last).
    d["mpi_bare_sends"] = mpi ? mpi->bare_sends() : 0;
    d["mpi_bare_receives"] = mpi ? mpi->bare_receives() : 0;
    // psends that returned with their operand still being read, finished by a later precv.
    d["kept_sends"] = rt.kept_sends().kept_total();
    d["kept_sends_unfinished"] = rt.kept_sends().pending();
    // Channels into this process's devices that a failed call marked: their precvs refuse.
    d["refused_channels"] = rt.suspect_channels().count();
    // Channels out of this process's devices that a failed call marked: their psends refuse.
    d["refused_send_channels"] = rt.suspect_channels().send_count();
    // What the polling waits for MPI peers did (Backoff): load changes the times, not these.
    d["wait_yields"] = jcm::WaitYields();
    d["wait_sleeps"] = jcm::WaitSleeps();
    // Collective calls whose device parked in its meeting (JAX_CPU_MPI_PARK).
    d["collective_parks"] = jcm::CollectiveParks();
    // Bytes of large precv outputs faulted in while their precv waited for the message.
    d["prefaulted_bytes"] = jcm::PrefaultedBytes();
    // Bytes of such outputs found in memory already (a warm output), left alone.
    d["prefault_present_bytes"] = jcm::PrefaultPresentBytes();
    // Bytes of precv zeros written, and given back to the kernel instead (local/zero_fill.h).
    d["zero_fill_written_bytes"] = jcm::ZeroFillWrittenBytes();
    d["zero_fill_dropped_bytes"] = jcm::ZeroFillDroppedBytes();
    return d;
  });

  m.def("trace_set_mode",
        [](bool record, bool log, size_t events_per_thread) {
          jcm::trace::SetMode(record, log, events_per_thread);
        },
        nb::arg("record"), nb::arg("log"), nb::arg("events_per_thread"),
        "Switch the per-message timeline (record) and the stderr log (log); "
        "events_per_thread bounds each thread's buffer between two trace_take calls.");
  m.def("trace_set_process", &jcm::trace::SetThisProcess, nb::arg("process"),
        "This process's jax.process_index(), which the marks' events carry.");
  m.def("trace_mode", [] {
    const uint32_t mode = jcm::trace::Mode();
    return nb::make_tuple((mode & jcm::trace::kRecord) != 0, (mode & jcm::trace::kLog) != 0);
  }, "(recording, logging)");
  m.def("trace_take", [] {
    jcm::trace::Taken taken = jcm::trace::TakeEvents();
    nb::bytes table(reinterpret_cast<const char*>(taken.table.data()),
                    taken.table.size() * sizeof(int64_t));
    return nb::make_tuple(table, taken.dropped);
  }, "(events as native int64 rows of trace_columns(), events dropped) since the last take.");
  m.def("trace_columns", [] {
    return std::vector<std::string>{"start_ns", "dur_ns", "wait_ns", "process", "device",
                                    "peer", "bytes", "seq", "op", "path", "ok",
                                    "label0", "label1", "label2"};
  });
  static_assert(jcm::trace::kEventColumns == 14);
  m.def("trace_path_names", [] {
    std::vector<std::string> names;
    for (int p = 0; p <= static_cast<int>(jcm::trace::Path::kKept); ++p) {
      names.emplace_back(jcm::trace::PathName(static_cast<jcm::trace::Path>(p)));
    }
    return names;
  }, "Names of the path codes of trace_take's rows, by code.");
  m.def("trace_now_ns", &jcm::trace::NowNs, "The clock of the trace events (steady, ns).");
  m.def("trace_clock", [] {
    nb::dict d;
    auto mpi = jcm::Runtime::Get().mpi();
    d["measured"] = mpi ? mpi->clock_offset().measured : false;
    d["offset_ns"] = mpi ? mpi->clock_offset().offset_ns : 0;
    d["rtt_ns"] = mpi ? mpi->clock_offset().rtt_ns : 0;
    d["rank"] = mpi ? mpi->rank() : 0;
    return d;
  }, "This process's steady clock against MPI rank 0's, measured when MPI was attached.");

  m.def("keep_freed_memory", &jcm::KeepFreedMemory,
        "Keep the memory malloc frees in the process (glibc: no mmapped blocks, no heap "
        "trimming), so that large per-call buffers are not page-faulted in and zeroed at "
        "every call; False where not applied (not glibc).");
  m.def("streaming_zero_fill_min_bytes", &jcm::StreamingZeroFillMinBytes,
        "Size from which the zeros of a precv that is no destination are written with "
        "streaming stores (0: never on this platform).");
  m.def("zero_fill_drop_min_bytes", &jcm::ZeroFillDropMinBytes,
        "Size from which the zeros of a precv that is no destination give the output's "
        "whole huge pages back to the kernel instead of writing them (larger where the "
        "kernel has no PROCMAP_QUERY; 0: never, no transparent huge pages here).");
  m.def("zero_fill",
        [](nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> buffer) {
          jcm::ZeroFill(buffer.data(), buffer.size());
        },
        nb::arg("buffer"), "Zero a 1-D uint8 array as a precv that is no destination does "
        "(for tests).");
  m.def("core_to_core_round_trip_ns",
        [](int cpu_a, int cpu_b, int iterations) {
          nb::gil_scoped_release release;
          return jcm::CoreToCoreRoundTripNs(cpu_a, cpu_b, iterations);
        },
        nb::arg("cpu_a"), nb::arg("cpu_b"), nb::arg("iterations") = 2000,
        "Mean round trip (ns) of a cache line between two CPUs, -1 if one cannot be used "
        "(for the benchmark's record of the machine; cpp/bench/core_probe.h).");
  m.def("mpi_library_version", &MpiLibraryVersion,
        "MPI_Get_library_version() of the libmpi the extension is linked to.");
  m.def("mpi_build_info", &BuildMpiInfo, "Which MPI the extension was compiled against.");
  m.def("ffi_build_info", [] {
    // The XLA FFI API version of the headers the extension was compiled with: jaxlib
    // accepts handlers of an API version within its supported range when they register.
    nb::dict d;
    d["api_major"] = XLA_FFI_API_MAJOR;
    d["api_minor"] = XLA_FFI_API_MINOR;
#if defined(JAX_CPU_MPI_FFI_HEADERS_FROM)
    d["headers_from"] = JAX_CPU_MPI_FFI_HEADERS_FROM;
#else
    d["headers_from"] = "";
#endif
    return d;
  }, "XLA FFI API version (and jaxlib) of the headers the extension was compiled against.");
}
