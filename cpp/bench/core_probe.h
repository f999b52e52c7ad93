// CoreToCoreRoundTripNs: how long a cache line takes to go from one CPU to another and back.
//
// For the benchmark's record of the machine: on the 2-core development VM this round trip
// switches between about 100 ns and about 500 ns within seconds (the host moving the two
// vCPUs between cores that share a cache and cores that do not), and MPI's 8 B and 1 MiB
// hops mostly follow it (2.8-3.3 us against 3.6-4.4 us, 117-171 us against 286-323 us).
#pragma once

namespace jcm {

// Mean round trip over `iterations` of a flag bounced between a thread pinned to `cpu_a`
// and one pinned to `cpu_b`, in nanoseconds; -1 if a thread cannot be pinned there.
double CoreToCoreRoundTripNs(int cpu_a, int cpu_b, int iterations);

}  // namespace jcm
