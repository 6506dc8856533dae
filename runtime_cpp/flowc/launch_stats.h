// What a generated driver needs to count a run's launches (FLOWC_STATS=1) and to set up
// OpenMP's wait policy; the target switch lives here, so the driver template has none.
//
//   flowc::stats::WorkCount a = flowc::stats::work_so_far();   // waits for queued work
//   ... runs ...
//   flowc::stats::WorkCount b = flowc::stats::work_so_far();   // b - a: what they ran
//
// On the host the figures are the emulator's (flowc::sim::Counters: counted as the work runs, a
// replayed CUDA Graph's nodes one by one): kernels, library calls (GEMMs and convolutions;
// cuBLASLt/cuDNN calls on the GPU, one or more kernels each), copies, memsets, host functions
// (the host build's collectives). The CUDA build has no such counters: `kCounted` is false and
// every count reads 0.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "flowc/device.h"
#include "flowc/env.h"

#if defined(FLOWC_HOST)
#include <unistd.h>  // execv
#endif

namespace flowc {
namespace stats {

struct WorkCount {
  uint64_t kernels = 0, library_calls = 0, copies = 0, memsets = 0, host_functions = 0;
};

#if defined(FLOWC_HOST)
constexpr bool kCounted = true;
#else
constexpr bool kCounted = false;
#endif

// FLOWC_STATS=1 (flowc/env.h; a model's create() has refused any value but 0 and 1).
inline bool wanted() {
  bool on = false;
  return env::flag("FLOWC_STATS", &on).ok() && on;
}

// The work that has run so far, after waiting for all that was queued (create's fills too), so
// that two readings bracket exactly the runs issued between them.
inline WorkCount work_so_far() {
  WorkCount w;
#if defined(FLOWC_HOST)
  (void)cudaDeviceSynchronize();
  const sim::Counters c = sim::counters();
  w.kernels = c.kernels;
  w.library_calls = c.library_calls;
  w.copies = c.copies;
  w.memsets = c.memsets;
  w.host_functions = c.host_functions;
#endif
  return w;
}

// libgomp reads OMP_WAIT_POLICY once, when the program loads, before main. Left unset, its
// threads spin for a while after every parallel region (each emulated kernel is one) and take
// the cores from OpenBLAS's threads, which run the GEMMs and convolutions (light ResNet-50 on
// two threads: several times slower). So on the host a driver started without the variable
// starts itself again: execv of the same program (/proc/self/exe) and arguments, with
// OMP_WAIT_POLICY=PASSIVE added to its environment. A value the user set (ACTIVE too) is kept.
// No loop: the variable is set before the exec, so the second start finds it and goes on. When
// the exec fails, this process runs on with libgomp's default and says so. Call it first thing
// in main (before MPI starts: the exec keeps the process). On the GPU build it does nothing.
inline void restart_with_passive_omp_wait(char** argv) {
#if defined(FLOWC_HOST)
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  if (setenv("OMP_WAIT_POLICY", "PASSIVE", 1) != 0) return;
  execv("/proc/self/exe", argv);
  std::fprintf(stderr, "warning: could not restart with OMP_WAIT_POLICY=PASSIVE (%s); set it to run faster\n",
               std::strerror(errno));
#else
  (void)argv;
#endif
}

}  // namespace stats
}  // namespace flowc
