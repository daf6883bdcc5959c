// Backward main kernel for sm90: one CTA per (column block, query head, batch); the grid's x is
// the column block, or a head of a head group (launch order, see the launcher); with packed keys
// the column block may be an entry of the column-block list (varlen_block_list_sm90.hpp).
// Warpgroup 0 is the producer (warp 0: TMA loads; warp 1: dQ bulk reduce-adds, or with dQ by
// atomics the deterministic order; in the sliced kernels' bulk path warps 1 and 2, one per MMA
// warpgroup), the other warpgroups run the MMAs and the dK / dV epilogue.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "sm90/epilogue_bwd_sm90.hpp"
#include "sm90/mainloop_bwd_sm90.hpp"

namespace cuflash::sm90::bwd {

template <class Mainloop_, class Epilogue_>
struct FlashBwdKernelSm90 {
  using Mainloop = Mainloop_;
  using Epilogue = Epilogue_;
  static constexpr int NumMmaWG = Mainloop::NumMmaWG;
  static constexpr int NumThreads = Mainloop::NumMmaThreads + cutlass::NumThreadsPerWarpGroup;
  // The producer warpgroup gives its registers to the MMA warpgroups.
  static constexpr int kProducerRegs = NumMmaWG == 2 ? 24 : 32;
  static constexpr int kMmaRegs = NumMmaWG == 2 ? 240 : 160;

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename Mainloop::PipelineQ::SharedStorage pipeline_q;
    alignas(16) typename Mainloop::PipelinedO::SharedStorage pipeline_do;
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_kv;
    typename Mainloop::DqSlotStorage dq_slots;
    int dq_writers_left;  // dq_done: the CTA's dQ writers still adding
  };
  static constexpr int kSharedStorageSize = sizeof(SharedStorage);
  static_assert(kSharedStorageSize <= 227 * 1024, "shared memory of the backward tile exceeds 227 KB");

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
  };

  struct BlockCoords {
    int n_block, head, batch;
  };
  // The CTA's column block, query head and batch from its grid position (see the launcher): with
  // the column-block list, the list's entry at the grid's column index.
  CUTE_DEVICE static BlockCoords block_coords(typename Mainloop::Params const& p, uint32_t x, uint32_t y, uint32_t z,
                                              uint32_t nx, uint32_t ny) {
    bool const heads_inner = Mainloop::HasWindow && p.head_group > 0;
    int const index = int(heads_inner ? y : x);
    int const head = heads_inner ? int(z) % p.num_head_groups * p.head_group + int(x) : int(y);
    if (p.col_blocks != nullptr) {
      int2 const entry = __ldg(p.col_blocks + index);
      return {entry.y, head, entry.x};
    }
    return {Mainloop::column_block(p, index, int(heads_inner ? ny : nx)), head,
            heads_inner ? int(z) / p.num_head_groups : int(z)};
  }

  // The CTA's writers of dQ sums: the dQ warp (dQ through shared memory), one warp per MMA
  // warpgroup (the ring of bulk copies) or every MMA thread (atomics).
  CUTE_DEVICE static int dq_writers(typename Mainloop::Params const& p) {
    if constexpr (Mainloop::kDqViaSmem) { return 1; }
    if (Mainloop::kHasDqBulk && p.dq_bulk) { return NumMmaWG; }
    return Mainloop::NumMmaThreads;
  }

  // The (batch, head) counter of BwdParams::dq_done.
  CUTE_DEVICE static int* dq_counter(typename Mainloop::Params const& p, int head, int batch) {
    return p.dq_done + int64_t(batch) * p.num_heads + head;
  }

  // A writer whose dQ sums are visible at gpu scope (a full bulk wait, or its atomics) counts
  // itself out; the last of the CTA releases the CTA to the head's counter, cumulatively over
  // the others' sums (each fenced before its count).
  CUTE_DEVICE static void dq_writer_done(typename Mainloop::Params const& p, int& writers_left, int head, int batch) {
    __threadfence();
    if (atomicSub(&writers_left, 1) == 1) {
      __threadfence();
      semaphore_increment(dq_counter(p, head, batch));
    }
  }

  // A dQ warp's bulk reduce-adds have landed: waited for in full, not only read, by every lane
  // (only the lane that issued them has any; the others pass at once), then counted by one.
  CUTE_DEVICE static void dq_copies_landed(typename Mainloop::Params const& p, int& writers_left, int head, int batch) {
    if (p.dq_done == nullptr) { return; }
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    __syncwarp();
    if (cute::elect_one_sync()) { dq_writer_done(p, writers_left, head, batch); }
    __syncwarp();
  }

  CUTE_DEVICE void operator()(Params const& params, char* smem_buf) {
    using namespace cute;
    // The dQ postprocess, launched as this kernel's programmatic dependent, may start once every
    // CTA has started: it waits for its heads' counters (BwdParams::dq_done), not for this grid.
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    using PipelineQ = typename Mainloop::PipelineQ;
    using PipelinedO = typename Mainloop::PipelinedO;
    SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_buf);

    int const warp_group_idx = cutlass::canonical_warp_group_idx();
    // The grid is (column blocks, heads, batch), or with a head group (heads of a group, column
    // blocks, groups x batch): block_coords. Only kernels with a window launch heads inner (the
    // launcher); the others keep the plain mapping at compile time (the sliced hdim256 kernels
    // spill a few bytes otherwise).
    BlockCoords const bc = block_coords(params.mainloop, blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.y);
    int const n_block = bc.n_block;
    int const head = bc.head;
    int const batch = bc.batch;

    if (threadIdx.x == 0) {
      Mainloop::prefetch_tma_descriptors(params.mainloop);
      ss.barrier_kv.init(1);
      ss.dq_slots.init();
      ss.dq_writers_left = dq_writers(params.mainloop);
      cutlass::arch::fence_barrier_init();
    }

    typename PipelineQ::Params pipeline_params_q;
    pipeline_params_q.transaction_bytes = Mainloop::kBytesQ + Mainloop::kBytesStats;
    pipeline_params_q.role = warp_group_idx == 0 ? PipelineQ::ThreadCategory::Producer : PipelineQ::ThreadCategory::Consumer;
    pipeline_params_q.is_leader = threadIdx.x == 0;
    pipeline_params_q.num_consumers = Mainloop::NumMmaThreads;
    PipelineQ pipeline_q(ss.pipeline_q, pipeline_params_q, Shape<_1, _1, _1>{});

    typename PipelinedO::Params pipeline_params_do;
    pipeline_params_do.transaction_bytes = Mainloop::kBytesdO + Mainloop::kBytesStats;
    pipeline_params_do.role = warp_group_idx == 0 ? PipelinedO::ThreadCategory::Producer : PipelinedO::ThreadCategory::Consumer;
    pipeline_params_do.is_leader = threadIdx.x == 0;
    pipeline_params_do.num_consumers = Mainloop::NumMmaThreads;
    PipelinedO pipeline_do(ss.pipeline_do, pipeline_params_do, Shape<_1, _1, _1>{});

    __syncthreads();

    BwdSeqlen const seq = BwdSeqlen::make<Mainloop::kBlockM, Mainloop::kBlockN>(params.mainloop, batch);
    // Grids are sized for the longest sequence; this block has no key rows of this batch (or,
    // in the last head group, no head). With the column-block list only its empty entries past
    // the last column block have none; the dQ conversion does not count them.
    if (n_block * Mainloop::kBlockN >= seq.capacity_k || head >= params.mainloop.num_heads) {
      if (params.mainloop.dq_done != nullptr && threadIdx.x == 0 && head < params.mainloop.num_heads &&
          params.mainloop.col_blocks == nullptr) {
        semaphore_increment(dq_counter(params.mainloop, head, batch));  // no dQ to add
      }
      return;
    }

    // The sliced hdim 256 mainloop (kSliceDQKV) takes every register of the MMA warpgroups, and ptxas
    // then spills the values that are live from here into either role; the window kernels' mainloops
    // (causal / local bounds) come close to it too (hdim128: 132 / 224 bytes of spills without this,
    // 100 / 44 with it). There each role derives the block's coordinates and sequence geometry again
    // after its register reconfiguration (volatile special-register reads and a compiler memory
    // barrier keep them from being merged with these), and the MMA warpgroups once more for the
    // epilogue.
    struct Coords {
      int n_block, head, batch, thread_idx;
      BwdSeqlen seq;
    };
    auto coords = [&]() {
      if constexpr (Mainloop::kSliceDQKV || Mainloop::HasWindow) {
        asm volatile("" ::: "memory");
        BlockCoords const v = block_coords(params.mainloop, ctaid_volatile<0>(), ctaid_volatile<1>(), ctaid_volatile<2>(),
                                           nctaid_volatile<0>(), nctaid_volatile<1>());
        return Coords{v.n_block, v.head, v.batch, int(tid_x_volatile()) - cutlass::NumThreadsPerWarpGroup,
                      BwdSeqlen::make<Mainloop::kBlockM, Mainloop::kBlockN>(params.mainloop, v.batch)};
      } else {
        return Coords{n_block, head, batch, int(threadIdx.x) - cutlass::NumThreadsPerWarpGroup, seq};
      }
    };

    if (warp_group_idx == 0) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
      Coords const c = coords();
      // Taken here, not kept from the start: held across the setup it spilled in the plain
      // sliced hdim256 kernel.
      int const warp_idx_in_wg = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
      trace::mark_bwd_dq_warp(trace::kStart);
      if (warp_idx_in_wg == 0) {
        Mainloop::load(params.mainloop, ss.tensors, pipeline_q, pipeline_do, ss.barrier_kv, c.seq, c.n_block, c.head,
                       c.batch);
      } else if (warp_idx_in_wg == 1 && Mainloop::kDqViaSmem) {
        // Every MMA warpgroup starts with an empty dQ buffer.
        for (int wg = 0; wg < NumMmaWG; ++wg) {
          cutlass::arch::NamedBarrier::arrive(cutlass::NumThreadsPerWarpGroup + cutlass::NumThreadsPerWarp,
                                              uint32_t(BwdBarrier::kDqEmpty) + wg);
        }
        Mainloop::store_dq(params.mainloop, ss.tensors, c.seq, c.n_block, c.head, c.batch);
        dq_copies_landed(params.mainloop, ss.dq_writers_left, c.head, c.batch);
      } else if (Mainloop::kHasDqBulk && params.mainloop.dq_bulk && warp_idx_in_wg >= 1 && warp_idx_in_wg <= NumMmaWG) {
        // Warp 1 + wg copies warpgroup wg's dQ (its ring starts empty).
        Mainloop::store_dq_bulk(params.mainloop, ss.dq_slots, c.seq, c.n_block, c.head, c.batch, warp_idx_in_wg - 1);
        dq_copies_landed(params.mainloop, ss.dq_writers_left, c.head, c.batch);
      } else if (warp_idx_in_wg == 1 && params.mainloop.dq_order_warp) {
        Mainloop::order_dq(params.mainloop, c.seq, c.n_block, c.head, c.batch);
      }
      trace::mark_bwd_dq_warp(trace::kEnd);
    } else {
      cutlass::arch::warpgroup_reg_alloc<kMmaRegs>();
      Coords const c = coords();
      trace::mark_bwd(c.thread_idx, trace::kStart);
      Tensor tdKrdK = partition_fragment_C(typename Mainloop::TiledMmadK{}, typename Epilogue::ShapedKAcc{});
      Tensor tdVrdV = partition_fragment_C(typename Mainloop::TiledMmadV{}, typename Epilogue::ShapedVAcc{});
      bool const any_rows = Mainloop::mma(params.mainloop, ss.tensors, pipeline_q, pipeline_do, ss.barrier_kv, c.seq,
                                          tdKrdK, tdVrdV, ss.dq_slots, c.thread_idx, c.n_block, c.head, c.batch);
      if (!any_rows) {
        clear(tdKrdK);
        clear(tdVrdV);
      }
      Coords const ce = coords();
      if (params.mainloop.dq_done != nullptr && !Mainloop::kDqViaSmem && !(Mainloop::kHasDqBulk && params.mainloop.dq_bulk)) {
        dq_writer_done(params.mainloop, ss.dq_writers_left, ce.head, ce.batch);  // its atomics
      }
      Epilogue::store(params.epilogue, ss.tensors, tdKrdK, tdVrdV, any_rows, ce.thread_idx, ce.seq, ce.n_block, ce.head,
                      ce.batch);
      trace::mark_bwd(ce.thread_idx, trace::kEnd);
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::NumThreads, 1) flash_bwd_kernel_sm90(CUTE_GRID_CONSTANT typename Kernel::Params const params) {
  // Aligned as the swizzled TMA buffers need, also when a diagnostic build adds static shared
  // memory before it (trace_sm90.hpp).
  extern __shared__ __align__(1024) char smem_buf[];
  Kernel{}(params, smem_buf);
}

}  // namespace cuflash::sm90::bwd
