// Launch template for the forward kernel: one explicit instantiation per generated
// src/instantiations/flash_fwd_*.cu file.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "api/params.hpp"
#include "cuflash/error.hpp"
#include "sm90/flash_fwd_kernel_sm90.hpp"
#include "sm90/varlen_block_list_sm90.hpp"

namespace cuflash::sm90 {

inline void check_launch(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(Error::Kind::kCuda, "", std::string(what) + ": " + cudaGetErrorString(status));
  }
}

template <class Config>
void launch_flash_fwd_sm90(FwdParams& params, cudaStream_t stream) {
  using Kernel = FlashFwdKernelSm90<Config>;
  typename Kernel::Params kernel_params = Kernel::to_params(params);
  if (kernel_params.scheduler.num_tiles() == 0) return;
  int num_sm = params.num_sm;
  if (num_sm <= 0) {
    int device = 0;
    check_launch(cudaGetDevice(&device), "cuflash forward: cudaGetDevice");
    check_launch(cudaDeviceGetAttribute(&num_sm, cudaDevAttrMultiProcessorCount, device),
                 "cuflash forward: cannot read the SM count");
  }
  // Equal tiles: static persistent (a CTA per SM, the next tile's loads under the epilogue).
  // Tiles of unequal cost (causal/local windows, packed or seqused sequences of different
  // lengths, a mask_mod or block lists) leave a static round-robin unbalanced: they get the
  // dynamic persistent scheduler when dispatch gave a tile counter (CUFLASH_FWD_SCHEDULER,
  // params_builder.cpp) where the kernel has it (not paged), else one CTA per tile, which the
  // hardware balances as SMs free up.
  // With no more tiles than SMs every CTA runs one tile either way: no counter needed.
  int const num_tiles = kernel_params.scheduler.num_tiles();
  bool const unequal_tiles = fwd_tiles_unequal(params);
  bool const dynamic = Kernel::kDynamicScheduling && unequal_tiles &&
                       params.tile_counter != nullptr && num_tiles > num_sm;
  int const max_ctas = unequal_tiles && !dynamic ? num_tiles : num_sm;
  dim3 grid = Kernel::grid_shape(kernel_params, max_ctas);
  // Equal tiles whose last wave leaves SMs idle: a stream-K tail where dispatch planned one and
  // gave its workspace (fwd_stream_k_ctas, for this kernel's tile). This kernel then runs the
  // whole waves, the pieces' kernel the rest.
  StreamKTail tail;
  if constexpr (Kernel::kStreamKEligible) {
    if (!unequal_tiles && params.stream_k_ctas > 0 && params.stream_k_sync != nullptr) {
      int const n_blocks = (params.seqlen_k + Kernel::kBlockN - 1) / Kernel::kBlockN;
      tail = plan_stream_k_tail(num_tiles, n_blocks, num_sm, params.stream_k_ctas);
      if (tail.enabled()) {
        tail.sync = params.stream_k_sync;
        tail.partial = params.stream_k_partial;
        kernel_params.stream_k = tail;
        grid = dim3(unsigned(num_sm));
        std::size_t const sync_ints = std::size_t(num_sm) * (1 + 2 * Kernel::kNumMmaThreads / 32);
        check_launch(cudaMemsetAsync(tail.sync, 0, sync_ints * sizeof(int), stream),
                     "cuflash forward: cannot zero the stream-K counters");
      }
    }
  }
  if (kernel_params.scheduler.row_blocks != nullptr) {
    int const group = kernel_params.packing.group;
    VarlenBlockListParams list = make_varlen_block_list(
        params.cu_seqlens_q, params.batch, group, (long long)params.total_q * group, Kernel::kBlockM,
        int(((long long)params.seqlen_q * group + Kernel::kBlockM - 1) / Kernel::kBlockM),
        Kernel::last_m_blocks_longest(params), reinterpret_cast<int2*>(params.row_block_list));
    list.listed = fwd_row_block_list_listed(params);  // where the kernel's tiles stop
    launch_build_varlen_block_list(list, stream);
    check_launch(cudaGetLastError(), "cuflash forward: the varlen row-block list's launch failed");
  }
  if (dynamic) {
    kernel_params.scheduler.tile_counter = params.tile_counter;
    check_launch(cudaMemsetAsync(params.tile_counter, 0, sizeof(int), stream),
                 "cuflash forward: cannot zero the tile counter");
  }
  auto kernel = &flash_fwd_kernel_sm90<Kernel>;
  check_launch(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    Kernel::kSharedStorageBytes),
               "cuflash forward: cannot reserve shared memory");
  if (!tail.enabled() || tail.dp_tiles > 0) {
    kernel<<<grid, Kernel::kNumThreads, Kernel::kSharedStorageBytes, stream>>>(kernel_params);
    check_launch(cudaGetLastError(), "cuflash forward: kernel launch failed");
#if CUFLASH_FWD_TRACE
    trace::dump_after_launch("fwdtrace", 0, int(grid.x), stream);
#endif
  }
  if constexpr (Kernel::kStreamKEligible) {
    if (tail.enabled()) {
      using PiecesKernel = FlashFwdKernelSm90<StreamKPiecesConfig<Config>>;
      typename PiecesKernel::Params pieces_params = PiecesKernel::to_params(params);
      pieces_params.stream_k = tail;
      auto pieces = &flash_fwd_kernel_sm90<PiecesKernel>;
      check_launch(cudaFuncSetAttribute(pieces, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        PiecesKernel::kSharedStorageBytes),
                   "cuflash forward: cannot reserve shared memory (stream-K pieces)");
      pieces<<<dim3(unsigned(tail.sk_ctas)), PiecesKernel::kNumThreads,
               PiecesKernel::kSharedStorageBytes, stream>>>(pieces_params);
      check_launch(cudaGetLastError(), "cuflash forward: stream-K pieces launch failed");
#if CUFLASH_FWD_TRACE
      trace::dump_after_launch("fwdtrace", 1, tail.sk_ctas, stream);
#endif
    }
  }
}

template <class Element, int kHeadDim, int kHeadDimV, bool kHasSoftcap, bool kIsSplit,
          class Variant = variants::NoVariant, bool kIsPaged = false, bool kPackGqa = false>
void run_flash_fwd_sm90(FwdParams& params, cudaStream_t stream) {
  using Config = FwdConfig<Element, kHeadDim, kHeadDimV, kHasSoftcap, kIsSplit, Variant, kIsPaged, kPackGqa>;
  // The plain kernel of a head dim whose tile has three MMA warpgroups also holds a 128-row tile
  // on two, for short sequences (params.short_kernel, fwd_narrow_tile_pays).
  if constexpr (Config::kNumMmaWarpGroups == 3 && !kHasSoftcap && !kIsSplit && !Variant::kIsFlex &&
                !kIsPaged && !kPackGqa) {
    if (fwd_plain_narrow_tile(params.short_kernel, typical_seqlen_q(params), typical_seqlen_k(params),
                              params.window_left, params.window_right)) {
      launch_flash_fwd_sm90<FwdConfig<Element, kHeadDim, kHeadDimV, kHasSoftcap, kIsSplit, Variant, kIsPaged,
                                      kPackGqa, /*kNarrow=*/true>>(params, stream);
      return;
    }
  }
  // A kernel that issues the next tile's first Q K^T under the epilogue also holds one that does
  // not, for tiles of few n-blocks, where that lost (params.short_kernel, fwd_next_qk_pays).
  if constexpr (MainloopFwdSm90<Config>::kQStages > 1) {
    if (fwd_single_q_kernel(params.short_kernel, typical_seqlen_k(params), params.window_left,
                            params.window_right)) {
      launch_flash_fwd_sm90<FwdConfig<Element, kHeadDim, kHeadDimV, kHasSoftcap, kIsSplit, Variant, kIsPaged,
                                      kPackGqa, /*kNarrow=*/false, /*kStreamKPieces=*/false,
                                      /*kSingleQ=*/true>>(params, stream);
      return;
    }
  }
  launch_flash_fwd_sm90<Config>(params, stream);
}

}  // namespace cuflash::sm90
