// dQ out of the sliced hdim256 backward by bulk copies (CUFLASH_BWD_DQ=bulk, the default; fp32
// atomics from registers with CUFLASH_BWD_DQ=atomics and in the flex kernels): each MMA warpgroup stages its dQ through an
// 8 KB slot of shared memory, and a producer warp per warpgroup adds the slot to global memory
// with a bulk reduce-add (DqBulkStage), as the kernels whose whole dQ tile fits in shared memory
// do. Measured on the H200 +11-17% over the atomics in one call, then +1-4% with a warp per
// warpgroup (bench/NOTES.md, "Bulk dQ, the order warp and the rotation rule measured" and
// "one dQ warp per warpgroup"), +12-17% with softcap; summing the partials of two CTAs
// in distributed shared memory first (dQ pairs) had measured within -3..+3% of the atomics.
#pragma once

#include <cutlass/arch/barrier.h>

namespace cuflash::sm90::bwd {

// Each MMA warpgroup's slot.
template <int kFloats, int kWarpgroups>
struct DqSlotStorage {
  struct Slot {
    alignas(128) float buffer[kFloats];
  };
  Slot slot[kWarpgroups];
};

// dQ through a warpgroup's slot (CUFLASH_BWD_DQ=bulk): the MMA warpgroup stores 4 float4 per
// thread (the slot's 8 KB) in fragment order and signals its producer warp, which adds
// the slot to global memory with one bulk reduce-add and frees it once the copy has read it
// (MainloopBwdSm90::store_dq_bulk); the warpgroup waits for that before its next store.
template <int kFloats, int kThreads>
struct DqBulkStage {
  static constexpr int kVecs = kFloats / kThreads / 4;

  // MMA warpgroup: values [kBegin, kBegin + kVecs) of `vec(i)` into the slot once it is free
  // (named barrier `empty`, synced with the producer warp), then `full` (arrive only).
  template <int kBegin, class Vec>
  CUTE_DEVICE static void store(uint32_t slot, int thread_in_wg, uint32_t empty, uint32_t full, Vec const& vec) {
    cutlass::arch::NamedBarrier::sync(kThreads + cutlass::NumThreadsPerWarp, empty);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVecs; ++i) {
      float4 const v = vec(kBegin + i);
      asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(slot + uint32_t((i * kThreads + thread_in_wg) * 16)),
                   "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                   : "memory");
    }
    // The bulk copy reads through the async proxy.
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::arrive(kThreads + cutlass::NumThreadsPerWarp, full);
  }
};

}  // namespace cuflash::sm90::bwd
