// CoreToCoreRoundTripNs: how long a cache line takes to go from one CPU to another and back.
//
// Benchmark-only (python/jax_cpu_mpi/bench/): the record of the machine a result was
// measured on. On a virtual machine the host may move vCPUs between cores that share a
// cache and cores that do not, and the latency of small MPI hops follows this round trip,
// so a result is only comparable with others measured at a similar round trip
// (benchmarks/results/ has the figures). Not used by the transports.
#pragma once

namespace jcm {

// Mean round trip over `iterations` of a flag bounced between a thread pinned to `cpu_a`
// and one pinned to `cpu_b`, in nanoseconds; -1 if a thread cannot be pinned there.
double CoreToCoreRoundTripNs(int cpu_a, int cpu_b, int iterations);

}  // namespace jcm
