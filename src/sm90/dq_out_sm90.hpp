// dQ out of the sliced hdim256 backward, besides fp32 atomics from registers (CUFLASH_BWD_DQ):
//  - pairs: two CTAs of a cluster on adjacent column blocks (n, n ^ 1) sum their dQ partials of
//    the row blocks both visit through distributed shared memory, so that only one of them adds
//    each value to the fp32 accumulator in global memory: half the dQ atomics. Measured on the
//    H200 within -3..+3% of the atomics (bench/NOTES.md, "dQ pairs for the hdim256 backward").
//  - bulk: each warpgroup stages its dQ through its 8 KB slot of the same storage, and the second
//    producer warp adds each slot to global memory with a bulk reduce-add (DqBulkStage), as the
//    kernels whose whole dQ tile fits in shared memory do.
//
// Pairs, per exchange (one half slice of dQ^T of one warpgroup: 64 head dims x 64 rows, 16 KB) the
// warpgroups of the same index in the two CTAs split the slice: CTA r keeps half r. Each stores
// the other half into the partner's 8 KB buffer with st.async, which counts the bytes on the
// partner's `full` transaction barrier; then waits on its own `full` for the partner's half,
// adds it to its own, frees its buffer by arriving on the partner's `empty` barrier (one arrive
// per warp) and issues the atomics of its half of the sum.
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>
#include <cutlass/version.h>

#include <cstddef>

namespace cuflash::sm90::bwd {

// The release below replaces PipelineTmaAsync's, whose cluster-of-one form arrives on cluster
// rank 0's barrier (written for launches without clusters).
static_assert(CUTLASS_MAJOR > 4 || (CUTLASS_MAJOR == 4 && CUTLASS_MINOR >= 2),
              "CtaPipelineTmaAsync needs CUTLASS 4.2 or later (PipelineTmaAsync's storage layout)");

// PipelineTmaAsync for a CTA whose producer and consumers are all its own, also when the kernel
// runs in clusters: consumers release the CTA's own empty barrier.
template <int Stages>
class CtaPipelineTmaAsync : public cutlass::PipelineTmaAsync<Stages> {
  using Base = cutlass::PipelineTmaAsync<Stages>;

 public:
  using typename Base::PipelineState;
  using typename Base::SharedStorage;
  template <class ClusterShape>
  CUTLASS_DEVICE CtaPipelineTmaAsync(SharedStorage& storage, typename Base::Params params, ClusterShape cluster_shape)
      : Base(storage, params, cluster_shape), empty_(&storage.empty_barrier_[0]) {}

  CUTLASS_DEVICE void consumer_release(PipelineState state) { empty_[state.index()].arrive(); }

 private:
  typename Base::EmptyBarrier* empty_;
};

// The same shared-memory address in CTA `rank` of the cluster (a shared::cluster address).
CUTE_DEVICE uint32_t cluster_smem_address(uint32_t local, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}

// 16 bytes into another CTA's shared memory, counted on that CTA's transaction barrier.
CUTE_DEVICE void st_async_f32x4(uint32_t remote_addr, float4 v, uint32_t remote_barrier) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(remote_addr),
      "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(remote_barrier)
      : "memory");
}

// Arrive on another CTA's barrier after this warp's reads of the buffer it frees, with the
// default semantics (release at CTA scope), as CUTLASS's pipelines release a multicast stage to
// the CTAs that write it. The release orders the warp's reads (of this CTA's own shared memory,
// made cumulative by __syncwarp) before the arrive, and the partner writes only after seeing the
// arrive; the PTX memory model's letter would want release.cluster, which measured 15% slower
// (a cluster-scope release also waits for this thread's earlier dQ atomics to reach L2).
CUTE_DEVICE void remote_arrive(uint32_t remote_barrier) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote_barrier) : "memory");
}

// Wait for the phase of `parity` of a local barrier that the partner CTA completes: acquire at
// cluster scope, pairing with st.async's complete-tx (a release at cluster scope) and ordering
// the reads of the partner's values after it. An acquire waits for nothing this thread issued.
CUTE_DEVICE void wait_partner_phase(uint32_t barrier, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(barrier),
      "r"(parity)
      : "memory");
}

// The pair's shared state in each CTA, per MMA warpgroup: the buffer the partner's warpgroup of
// the same index writes, and the two barriers.
template <int kFloats>
struct DqPairSlot {
  alignas(128) float buffer[kFloats];
  uint64_t full;   // partner's st.async bytes (+1 arrive with the expected bytes)
  uint64_t empty;  // partner's warps have read this CTA's last send
};
template <int kFloats, int kWarpgroups>
struct DqPairStorage {
  DqPairSlot<kFloats> slot[kWarpgroups];
};

// One warpgroup's side of the exchange with the partner's warpgroup of the same index (same head
// dims of dQ^T). Each exchange sends one half of the values and receives the other, so that both
// CTAs send, receive and issue atomics alike. `exchanges` counts the exchanges so far; in this
// CTA only this warpgroup uses its slot (the partner's warpgroup of the same index completes its
// barriers), and both CTAs of a pair exchange the same row blocks in the same order, so the
// count gives both barriers' phases.
template <int kFloats, int kThreads>
struct DqPairLink {
  static constexpr int kVecs = kFloats / kThreads / 4;  // float4 per thread and direction
  static constexpr int kWarps = kThreads / 32;
  static_assert(kFloats % (kThreads * 4) == 0);

  // The warpgroup's slot as a 32-bit shared-memory address; its barriers at fixed offsets (few
  // live registers in the mainloop).
  uint32_t slot;
  uint32_t partner;  // the partner's cluster rank (this CTA's ^ 1)
  int exchanges;
  static constexpr uint32_t kFull = offsetof(DqPairSlot<kFloats>, full);
  static constexpr uint32_t kEmpty = offsetof(DqPairSlot<kFloats>, empty);

  template <int kWarpgroups>
  CUTE_DEVICE static void init(DqPairStorage<kFloats, kWarpgroups>& s) {
    for (int wg = 0; wg < kWarpgroups; ++wg) {
      cutlass::arch::ClusterTransactionBarrier::init(&s.slot[wg].full, 1);
      cutlass::arch::ClusterBarrier::init(&s.slot[wg].empty, kWarps);
    }
  }

  template <int kWarpgroups>
  CUTE_DEVICE static DqPairLink make(DqPairStorage<kFloats, kWarpgroups>& s, int wg) {
    return {cute::cast_smem_ptr_to_uint(&s.slot[wg]), cute::block_rank_in_cluster() ^ 1u, 0};
  }
  // Rank 0 keeps the first half of each exchanged slice, rank 1 the second.
  CUTE_DEVICE bool is_rank0() const { return partner == 1; }

  // Send `vec(i)` for i in [kBegin, kBegin + kVecs) (float4 per thread) into the partner's
  // buffer once the partner has read the previous send.
  template <int kBegin, class Vec>
  CUTE_DEVICE void send(int thread_in_wg, Vec const& vec) const {
    wait_partner_phase(slot + kEmpty, uint32_t((exchanges & 1) ^ 1));
    uint32_t const remote_buffer = cluster_smem_address(slot, partner);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVecs; ++i) {
      st_async_f32x4(remote_buffer + uint32_t((i * kThreads + thread_in_wg) * 16), vec(kBegin + i), remote_buffer + kFull);
    }
  }

  // Wait for the partner's send of this exchange, add it with `add(i, value)` for i in
  // [kBegin, kBegin + kVecs), and free the buffer. Called after send(), as late as the caller
  // can: the wait is on the partner reaching the same point.
  template <int kBegin, class Add>
  CUTE_DEVICE void receive(int thread_in_wg, Add&& add) {
    if (thread_in_wg == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(slot + kFull), "r"(uint32_t(kFloats * 4))
                   : "memory");
    }
    wait_partner_phase(slot + kFull, uint32_t(exchanges & 1));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVecs; ++i) {
      float4 v;
      asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                   : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                   : "r"(slot + uint32_t((i * kThreads + thread_in_wg) * 16))
                   : "memory");
      add(kBegin + i, v);
    }
    __syncwarp();
    if (thread_in_wg % 32 == 0) { remote_arrive(cluster_smem_address(slot, partner) + kEmpty); }
    ++exchanges;
  }

  // Before the CTA exits: the partner's last arrive on this CTA's barrier has landed (no access
  // to this CTA's shared memory is left in flight).
  CUTE_DEVICE void drain() const {
    if (exchanges > 0) { wait_partner_phase(slot + kEmpty, uint32_t((exchanges & 1) ^ 1)); }
  }
};

// dQ through a warpgroup's slot (CUFLASH_BWD_DQ=bulk): the MMA warpgroup stores 4 float4 per
// thread (the slot's 8 KB) in fragment order and signals the second producer warp, which adds
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
