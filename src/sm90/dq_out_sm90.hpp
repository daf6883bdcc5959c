// dQ out of the sliced hdim256 backward by bulk copies (CUFLASH_BWD_DQ=bulk, the default; fp32
// atomics from registers with CUFLASH_BWD_DQ=atomics and in the flex kernels): each MMA
// warpgroup stages its dQ through a ring of three 4 KB slots of shared memory, and a producer
// warp per warpgroup adds each slot to global memory with a bulk reduce-add (DqBulkStage), as the
// kernels whose whole dQ tile fits in shared memory do. Measured on the H200 against the
// atomics in one call: +17-23% non-causal, +18-19% causal, +16-20% with softcap (bench/NOTES.md,
// "a ring of three dQ slots per warpgroup"); one 8 KB slot per warpgroup, which the warpgroup
// waited on for a full copy round trip per piece, had given +13-17% and +11-12%. Summing the
// partials of two CTAs in distributed shared memory first (dQ pairs) had measured within
// -3..+3% of the atomics.
#pragma once

#include <cutlass/arch/barrier.h>

namespace cuflash::sm90::bwd {

// Each MMA warpgroup's ring of kSlots slots, each with a pair of mbarriers: full (the
// warpgroup's 128 threads arrive once their values are in the slot) and empty (the warpgroup's
// dQ warp arrives once the bulk copy has read the slot).
template <int kFloats, int kSlots, int kWarpgroups>
struct DqSlotStorage {
  struct Slot {
    alignas(128) float buffer[kFloats];
  };
  Slot slot[kWarpgroups][kSlots];
  cutlass::arch::ClusterBarrier full[kWarpgroups][kSlots];
  cutlass::arch::ClusterBarrier empty[kWarpgroups][kSlots];

  CUTE_DEVICE void init() {
    for (int wg = 0; wg < kWarpgroups; ++wg) {
      for (int s = 0; s < kSlots; ++s) {
        full[wg][s].init(cutlass::NumThreadsPerWarpGroup);
        empty[wg][s].init(1);
      }
    }
  }
  // The n-th piece of a warpgroup goes through slot n % kSlots, in that slot's use n / kSlots
  // (whose parity the barriers' phases follow).
  CUTE_DEVICE static int slot_of(int piece) { return piece % kSlots; }
  CUTE_DEVICE static uint32_t parity_of(int piece) { return uint32_t(piece / kSlots) & 1u; }
};

// dQ through a warpgroup's ring (CUFLASH_BWD_DQ=bulk): the MMA warpgroup stores kVecs float4
// per thread (one slot) in fragment order into the next slot once it is free and signals its
// producer warp, which adds the slot to global memory with one bulk reduce-add and frees it once
// the copy has read it (MainloopBwdSm90::store_dq_bulk). With three slots the warpgroup waits
// only when it runs three pieces ahead of the copies.
template <int kFloats, int kThreads>
struct DqBulkStage {
  static constexpr int kVecs = kFloats / kThreads / 4;

  // MMA warpgroup: values [kBegin, kBegin + kVecs) of `vec(i)` as piece `piece` of warpgroup wg.
  template <int kBegin, class Storage, class Vec>
  CUTE_DEVICE static void store(Storage& ring, int wg, int piece, int thread_in_wg, Vec const& vec) {
    int const s = Storage::slot_of(piece);
    ring.empty[wg][s].wait(Storage::parity_of(piece) ^ 1u);  // a fresh slot passes at once
    uint32_t const slot = cute::cast_smem_ptr_to_uint(ring.slot[wg][s].buffer);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVecs; ++i) {
      float4 const v = vec(kBegin + i);
      asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(slot + uint32_t((i * kThreads + thread_in_wg) * 16)),
                   "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                   : "memory");
    }
    // The bulk copy reads through the async proxy.
    cutlass::arch::fence_view_async_shared();
    ring.full[wg][s].arrive();
  }
};

}  // namespace cuflash::sm90::bwd
