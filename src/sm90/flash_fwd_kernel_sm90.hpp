// Warp-specialised forward kernel entry for Hopper.
// Warpgroup 0 is the producer (TMA loads; it gives registers back with setmaxnreg), the
// other kNumMmaWarpGroups warpgroups are consumers (WGMMA, softmax, epilogue; they take the
// registers). See mainloop_fwd_sm90.hpp for the pipeline and the pingpong schedule.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "api/params.hpp"
#include "cuflash/tensor.hpp"
#include "sm90/epilogue_fwd_sm90.hpp"
#include "sm90/mainloop_fwd_sm90.hpp"
#include "sm90/mask.hpp"
#include "sm90/seqlen_info.hpp"
#include "sm90/softmax.hpp"
#include "sm90/tile_scheduler_sm90.hpp"
#include "sm90/tile_size_sm90.hpp"

namespace cuflash::sm90 {

template <class Element_, int kHeadDim_, int kHeadDimV_, bool kHasSoftcap_>
struct FwdConfig {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr bool kHasSoftcap = kHasSoftcap_;
  static constexpr FwdTileSize kTile = fwd_tile_size(kHeadDim, kHeadDimV);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kNumMmaWarpGroups = kBlockM / 64;
};

template <class Config>
struct FlashFwdKernelSm90 {
  using Element = typename Config::Element;
  using Mainloop = MainloopFwdSm90<Config>;
  using Epilogue = EpilogueFwdSm90<Config>;
  using Scheduler = SingleTileSchedulerSm90;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kNumMmaWarpGroups = Config::kNumMmaWarpGroups;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kNumThreads = kNumMmaThreads + cutlass::NumThreadsPerWarpGroup;
  static_assert(kNumMmaWarpGroups == 2 || kNumMmaWarpGroups == 3);
  // 64K registers per SM: producer 128 x 24 + 256 x 240, or 128 x 32 + 384 x 160.
  static constexpr uint32_t kLoadRegisters = kNumMmaWarpGroups == 2 ? 24 : 32;
  static constexpr uint32_t kMmaRegisters = kNumMmaWarpGroups == 2 ? 240 : 160;
  // Each thread of a WGMMA accumulator holds two rows of its warpgroup's 64.
  static constexpr int kRowsPerThread = 2;

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_q;
    alignas(16) typename Mainloop::PipelineK::SharedStorage pipeline_k;
    alignas(16) typename Mainloop::PipelineV::SharedStorage pipeline_v;
  };
  static constexpr int kSharedStorageBytes = int(sizeof(SharedStorage));
  static_assert(cute::cosize_v<typename Epilogue::SmemLayoutO> <= cute::cosize_v<typename Mainloop::SmemLayoutQ>,
                "O reuses Q's shared memory");

  struct Params {
    typename Mainloop::Params mainloop;
    FwdParams fwd;
    float scale_log2;     // multiplies the (soft-capped) score inside exp2
    float softcap_scale;  // softmax_scale / softcap
    int num_m_blocks;
    bool longest_first;
  };

  static Params to_params(FwdParams const& p) {
    bool const has_softcap = p.softcap > 0.f;
    return {Mainloop::to_params(p), p, float(M_LOG2E) * (has_softcap ? p.softcap : p.softmax_scale),
            has_softcap ? p.softmax_scale / p.softcap : 0.f, cute::ceil_div(p.seqlen_q, kBlockM),
            p.window_right >= 0 || p.window_left >= 0};
  }

  static dim3 grid_shape(Params const& params) {
    return Scheduler::grid_shape(params.num_m_blocks, params.fwd.num_heads, params.fwd.batch);
  }

  CUTLASS_DEVICE static float load_sink_log2(FwdParams const& p, int head) {
    if (p.learnable_sink == nullptr) return -INFINITY;
    float sink;
    switch (DType(p.sink_dtype)) {
      case DType::kFloat32: sink = static_cast<float const*>(p.learnable_sink)[head]; break;
      case DType::kBFloat16: sink = float(static_cast<cutlass::bfloat16_t const*>(p.learnable_sink)[head]); break;
      default: sink = float(static_cast<cutlass::half_t const*>(p.learnable_sink)[head]); break;
    }
    return sink * float(M_LOG2E);
  }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem_buf) {
    using namespace cute;
    using PipelineK = typename Mainloop::PipelineK;
    using PipelineV = typename Mainloop::PipelineV;
    using PipelineState = typename Mainloop::PipelineState;
    SharedStorage& storage = *reinterpret_cast<SharedStorage*>(smem_buf);
    FwdParams const& p = params.fwd;

    int const warp_group_idx = cutlass::canonical_warp_group_idx();
    int const warp_idx = cutlass::canonical_warp_idx_sync();
    bool const lane_predicate = cute::elect_one_sync();
    if (warp_idx == 0 && lane_predicate) {
      Mainloop::prefetch_descriptors(params.mainloop);
      storage.barrier_q.init(/*arrive_count=*/1);
    }
    typename PipelineK::Params pipeline_params_k;
    pipeline_params_k.transaction_bytes = Mainloop::kTmaBytesK;
    pipeline_params_k.role = warp_group_idx == 0 ? PipelineK::ThreadCategory::Producer
                                                 : PipelineK::ThreadCategory::Consumer;
    pipeline_params_k.is_leader = threadIdx.x % cutlass::NumThreadsPerWarpGroup == 0;
    pipeline_params_k.num_consumers = kNumMmaThreads;
    typename PipelineV::Params pipeline_params_v = pipeline_params_k;
    pipeline_params_v.transaction_bytes = Mainloop::kTmaBytesV;
    PipelineK pipeline_k(storage.pipeline_k, pipeline_params_k, Shape<_1, _1, _1>{});
    PipelineV pipeline_v(storage.pipeline_v, pipeline_params_v, Shape<_1, _1, _1>{});
    __syncthreads();  // barrier initialisation is visible to every thread

    FwdTile const tile = Scheduler::tile(params.num_m_blocks, params.longest_first);
    SeqlenInfo const seqlen(tile.batch, p.seqlen_q, p.seqlen_k, p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q,
                            p.seqused_k);
    if (tile.m_block * kBlockM >= seqlen.seqlen_q_range) return;  // past this sequence: nothing to write
    FwdMask<kBlockM, kBlockN> const mask{seqlen.seqlen_q, seqlen.seqlen_k, p.window_left, p.window_right};
    int n_block_min, n_block_max;
    mask.n_block_range(tile.m_block, n_block_min, n_block_max);
    int const head_kv = tile.head / (p.num_heads / p.num_heads_kv);

    if (warp_group_idx == 0) {
      cutlass::arch::warpgroup_reg_dealloc<kLoadRegisters>();
      if (warp_idx == 0 && lane_predicate && n_block_min < n_block_max) {
        PipelineState smem_pipe_write = cutlass::make_producer_start_state<PipelineK>();
        Mainloop::load(params.mainloop, storage.tensors, storage.barrier_q, pipeline_k, pipeline_v, smem_pipe_write,
                       seqlen, tile.m_block, tile.head, head_kv, tile.batch, n_block_min, n_block_max);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<kMmaRegisters>();
      int const thread_idx = int(threadIdx.x) - cutlass::NumThreadsPerWarpGroup;
      typename Mainloop::TiledMmaPV tiled_mma_pv;
      Tensor tOrO = partition_fragment_C(tiled_mma_pv, select<0, 1>(typename Mainloop::TileShapePV{}));
      OnlineSoftmax<kRowsPerThread> softmax(params.scale_log2);
      float out_scale[kRowsPerThread], lse[kRowsPerThread];
      if (n_block_min < n_block_max) {
        Mainloop::mma_init(thread_idx / cutlass::NumThreadsPerWarpGroup);
        PipelineState smem_pipe_read;
        Mainloop::mma(storage.tensors, storage.barrier_q, pipeline_k, pipeline_v, smem_pipe_read, tOrO, softmax, mask,
                      params.softcap_scale, thread_idx, tile.m_block, n_block_min, n_block_max);
        softmax.finalize(load_sink_log2(p, tile.head), out_scale, lse);
      } else {
        clear(tOrO);
        softmax.row_max[0] = softmax.row_max[1] = -INFINITY;
        softmax.row_sum[0] = softmax.row_sum[1] = 0.f;
        softmax.finalize(load_sink_log2(p, tile.head), out_scale, lse);
      }
      // Normalise; rows past seqused_q (and any row without a visible key) give 0 and lse -inf.
      auto thr_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
      Tensor tOcO = thr_mma_pv.partition_C(make_identity_tensor(select<0, 1>(typename Mainloop::TileShapePV{})));
      Tensor coords = make_tensor(tOcO.data(), acc_rowcol_layout(tOcO.layout()));
      Tensor out = make_tensor(tOrO.data(), acc_rowcol_layout(tOrO.layout()));
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < kRowsPerThread; ++m) {
        bool const row_valid = tile.m_block * kBlockM + get<0>(coords(m, 0)) < seqlen.seqlen_q;
        if (!row_valid) lse[m] = -INFINITY;
        CUTLASS_PRAGMA_UNROLL
        for (int n = 0; n < size<1>(out); ++n) out(m, n) = row_valid ? out(m, n) * out_scale[m] : 0.f;
      }
      Epilogue::store(p, storage.tensors.smem_q.data(), tOrO, lse, tiled_mma_pv, thread_idx, seqlen, tile.m_block,
                      tile.head, tile.batch);
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads, 1)
    flash_fwd_kernel_sm90(CUTE_GRID_CONSTANT typename Kernel::Params const params) {
  extern __shared__ __align__(1024) char smem_buf[];
  Kernel{}(params, smem_buf);
}

}  // namespace cuflash::sm90
