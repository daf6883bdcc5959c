// A timeline of the MMA warpgroups, for finding where the time goes: in the forward kernel a
// tile's stages (per-tile fixed cost, the stream-K meet), in the backward main kernel a row
// block's step. Built only with -DCUFLASH_FWD_TRACE=1 / -DCUFLASH_BWD_TRACE=1 (diagnostic builds);
// otherwise every call below compiles to nothing.
//
// Each MMA warpgroup's first thread (of the first two warpgroups, in the first kMaxCtas CTAs)
// records (event, SM clock) pairs in a global buffer, and in the backward so does the first dQ
// warp of the producer warpgroup (the deterministic order's turns, as a third "warpgroup", 2).
// After each launch the host waits and prints them (dump_after_launch), so a traced call is
// synchronous. bench/trace_fwd.py and bench/trace_bwd.py read the lines.
#pragma once

#include <cutlass/cutlass.h>

#include <cuda_runtime.h>

#include <cstdio>

#include "sm90/utils_sm90.hpp"

#ifndef CUFLASH_FWD_TRACE
#define CUFLASH_FWD_TRACE 0
#endif
#ifndef CUFLASH_BWD_TRACE
#define CUFLASH_BWD_TRACE 0
#endif
#define CUFLASH_TRACE (CUFLASH_FWD_TRACE || CUFLASH_BWD_TRACE)

namespace cuflash::sm90::trace {

enum Event : int {
  kStart = 0,      // the warpgroup's first instruction after its register allocation
  kTile = 1,       // a tile (or piece) begins: before its first waits
  kFirstS = 2,     // the first Q K^T of the tile has landed in registers
  kFirstP = 3,     // its softmax is done (P ready): the loop begins
  kLoopEnd = 4,    // every loop iteration issued and waited; the last P V follows
  kMmaEnd = 5,     // the last P V has completed (and the finalize issued under it)
  kMeetArrived = 6,  // stream-K: this piece knows whether it is the tile's last
  kMeetDone = 7,     // stream-K: state written (not last) or merged (last)
  kEpilogue = 8,   // the epilogue has issued the tile's stores
  kEnd = 9,        // the warpgroup leaves the tile loop
  // Backward main kernel, per row block (step) of a column block:
  kBwdStep = 10,     // the step begins: before the wait for Q
  kBwdQ = 11,        // Q has landed and S = Q K^T is issued
  kBwdSdP = 12,      // S and dP = dO V^T have completed
  kBwdDs = 13,       // P and dS computed and stored to shared memory
  kBwdDq0 = 14,      // the first half of dQ handed out (the sliced hdim256 kernels; else all dQ)
  kBwdDq1 = 15,      // the second half of dQ handed out (sliced kernels)
  kBwdStepEnd = 16,  // every MMA of the step has completed; Q released
  // Inside the sliced hdim256 kernels' dV / dK / dQ MMAs (between kBwdDs and kBwdDq1):
  kBwdPdS = 17,   // both warpgroups' dS stored (the P / dS barrier passed); dV_0 issued before it
  kBwdMma0 = 18,  // dV_0 and dQ_0 have completed (dV_1 issued): the first dQ half's stores follow
  kBwdMma1 = 19,  // dK_0 and dQ_1 have completed (dK_1 issued): the second half's stores follow
  // The backward's first dQ warp (mark_bwd_dq_warp), per row block of a deterministic run:
  kBwdTurnWait = 20,  // it begins to wait for the row block's turn
  kBwdTurn = 21,      // the turn has come (the earlier column blocks have added)
  kBwdReleased = 22,  // this column block's adds have landed and the row block is passed on
  // MMA warpgroups of the kernels whose dQ goes through one shared-memory buffer:
  kBwdDqBuffer = 23,  // the warpgroup has the dQ buffer (the previous row block's adds read it)
  // Backward kernels with a window (causal, local): a step whose tile the window's edge cuts
  // (some of its scores masked), marked in place of kBwdStep.
  kBwdStepCut = 24,
};

// How many CTAs and events per recording slot are kept. The defaults cover about two waves;
// -DCUFLASH_TRACE_MAX_CTAS=2048 -DCUFLASH_TRACE_MAX_EVENTS=512 covers a whole 16k-token hdim256
// backward grid (1,664 CTAs at 2k) for the grid view of bench/trace_bwd.py (38 MB per unit).
#ifndef CUFLASH_TRACE_MAX_CTAS
#define CUFLASH_TRACE_MAX_CTAS 264
#endif
#ifndef CUFLASH_TRACE_MAX_EVENTS
#define CUFLASH_TRACE_MAX_EVENTS 1024
#endif
constexpr int kMaxEvents = CUFLASH_TRACE_MAX_EVENTS;
constexpr int kMaxCtas = CUFLASH_TRACE_MAX_CTAS;
constexpr int kSlotsPerCta = 3;  // MMA warpgroups 0 and 1, the backward's first dQ warp

#if CUFLASH_TRACE
// Per (CTA, recording slot): the events' SM clocks and codes, how many, and the global timer at
// the slot's start (to place the CTAs on one time line). One copy per translation unit (10 MB
// of device memory each: build only the kernels to trace, CUFLASH_KERNEL_REGEX), read back by
// that unit's launch (dump_after_launch).
static __device__ long long g_clocks[kMaxCtas * kSlotsPerCta * kMaxEvents];
static __device__ int g_events[kMaxCtas * kSlotsPerCta * kMaxEvents];
static __device__ int g_counts[kMaxCtas * kSlotsPerCta];
static __device__ unsigned long long g_start_ns[kMaxCtas * kSlotsPerCta];
static __device__ unsigned long long g_end_ns[kMaxCtas * kSlotsPerCta];

CUTLASS_DEVICE int* counts() {
  __shared__ int buffer[kSlotsPerCta];
  return buffer;
}

// One event of slot `which` (0 / 1: MMA warpgroup, 2: dQ warp) of CTA `cta`, by its one
// recording thread.
CUTLASS_DEVICE void record(int cta, int which, Event event) {
  if (cta >= kMaxCtas) return;
  int const slot = cta * kSlotsPerCta + which;
  if (event == kStart || event == kEnd) {
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    (event == kStart ? g_start_ns : g_end_ns)[slot] = ns;
    if (event == kStart) counts()[which] = 0;
  }
  int const k = counts()[which];
  if (k >= kMaxEvents) return;
  g_clocks[slot * kMaxEvents + k] = clock64();
  g_events[slot * kMaxEvents + k] = int(event);
  counts()[which] = k + 1;
  g_counts[slot] = k + 1;
}
#endif

// cta: the CTA's place in the trace (< kMaxCtas or not traced); thread_idx: the thread's index
// among the MMA threads (warpgroup = thread_idx / 128). Global stores only (no call): a call
// would serialise the kernel's WGMMAs (ptxas C7510).
CUTLASS_DEVICE void mark_at(int cta, int thread_idx, Event event) {
#if CUFLASH_TRACE
  if (thread_idx % 128 != 0 || thread_idx >= 256) return;
  record(cta, thread_idx / 128, event);
#else
  (void)cta;
  (void)thread_idx;
  (void)event;
#endif
}

// Forward: the persistent CTAs by their index.
CUTLASS_DEVICE void mark(int thread_idx, Event event) {
#if CUFLASH_FWD_TRACE
  mark_at(int(blockIdx.x), thread_idx, event);
#else
  (void)thread_idx;
  (void)event;
#endif
}

// Backward: the CTAs in launch order (the first kMaxCtas of the grid). The
// grid position is read anew at each mark (volatile reads): computed once and kept, it took
// registers through the step loop and the plain hdim128 kernel spilled.
CUTLASS_DEVICE int bwd_launch_index() {
  return int(ctaid_volatile<0>() + nctaid_volatile<0>() * (ctaid_volatile<1>() + nctaid_volatile<1>() * ctaid_volatile<2>()));
}

CUTLASS_DEVICE void mark_bwd(int thread_idx, Event event) {
#if CUFLASH_BWD_TRACE
  mark_at(bwd_launch_index(), thread_idx, event);
#else
  (void)thread_idx;
  (void)event;
#endif
}

// Backward, the producer warpgroup's warp 1 (the dQ warp: the reduce warp, the first bulk dQ
// warp, or the order warp), its lane 0 recording; any other thread's call does nothing.
CUTLASS_DEVICE void mark_bwd_dq_warp(Event event) {
#if CUFLASH_BWD_TRACE
  if (threadIdx.x != cutlass::NumThreadsPerWarp) return;
  record(bwd_launch_index(), 2, event);
#else
  (void)event;
#endif
}

#if CUFLASH_TRACE
// Host: after a launch of `ctas` CTAs, waits for it and prints its events, one line each:
// "<tag> <kernel> <cta> <warpgroup> <event> <cycles since the warpgroup's start>
// <global ns at the warpgroup's start> <global ns at its end>"; tag fwdtrace (kernel 0 plain,
// 1 stream-K pieces) or bwdtrace (kernel 0: the main kernel); warpgroup 2 is the backward's dQ
// warp.
inline void dump_after_launch(char const* tag, int kernel, int ctas, cudaStream_t stream) {
  static long long clocks[kMaxCtas * kSlotsPerCta * kMaxEvents];
  static int events[kMaxCtas * kSlotsPerCta * kMaxEvents];
  static int counts_host[kMaxCtas * kSlotsPerCta];
  static unsigned long long start_ns[kMaxCtas * kSlotsPerCta];
  static unsigned long long end_ns[kMaxCtas * kSlotsPerCta];
  cudaStreamSynchronize(stream);
  cudaMemcpyFromSymbol(clocks, g_clocks, sizeof(clocks));
  cudaMemcpyFromSymbol(events, g_events, sizeof(events));
  cudaMemcpyFromSymbol(counts_host, g_counts, sizeof(counts_host));
  cudaMemcpyFromSymbol(start_ns, g_start_ns, sizeof(start_ns));
  cudaMemcpyFromSymbol(end_ns, g_end_ns, sizeof(end_ns));
  for (int slot = 0; slot < kSlotsPerCta * (ctas < kMaxCtas ? ctas : kMaxCtas); ++slot) {
    for (int k = 0; k < counts_host[slot]; ++k)
      std::printf("%s %d %d %d %d %lld %llu %llu\n", tag, kernel, slot / kSlotsPerCta, slot % kSlotsPerCta,
                  events[slot * kMaxEvents + k], clocks[slot * kMaxEvents + k] - clocks[slot * kMaxEvents],
                  start_ns[slot], end_ns[slot]);
  }
  std::fflush(stdout);
  static int const zero[kMaxCtas * kSlotsPerCta] = {};
  cudaMemcpyToSymbol(g_counts, zero, sizeof(zero));
}
#endif

}  // namespace cuflash::sm90::trace
