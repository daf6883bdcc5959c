// Launch template for the forward kernel: one explicit instantiation per generated
// src/instantiations/flash_fwd_*.cu file.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "api/params.hpp"
#include "cuflash/error.hpp"
#include "sm90/flash_fwd_kernel_sm90.hpp"

namespace cuflash::sm90 {

inline void check_launch(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(Error::Kind::kCuda, "", std::string(what) + ": " + cudaGetErrorString(status));
  }
}

template <class Element, int kHeadDim, int kHeadDimV, bool kHasSoftcap, bool kIsSplit,
          class Variant = variants::NoVariant, bool kIsPaged = false>
void run_flash_fwd_sm90(FwdParams& params, cudaStream_t stream) {
  using Kernel = FlashFwdKernelSm90<
      FwdConfig<Element, kHeadDim, kHeadDimV, kHasSoftcap, kIsSplit, Variant, kIsPaged>>;
  typename Kernel::Params const kernel_params = Kernel::to_params(params);
  if (kernel_params.scheduler.num_tiles() == 0) return;
  int num_sm = params.num_sm;
  if (num_sm <= 0) {
    int device = 0;
    check_launch(cudaGetDevice(&device), "cuflash forward: cudaGetDevice");
    check_launch(cudaDeviceGetAttribute(&num_sm, cudaDevAttrMultiProcessorCount, device),
                 "cuflash forward: cannot read the SM count");
  }
  // Tiles of unequal cost (causal/local windows, packed sequences of different lengths) balance
  // better when the hardware hands out one tile per CTA as SMs free up than with a static
  // round-robin; equal tiles gain from the persistent loop (next loads under the epilogue).
  // A mask_mod or block lists make tiles unequal too.
  bool const unequal_tiles =
      kernel_params.scheduler.longest_first || params.cu_seqlens_q != nullptr ||
      params.cu_seqlens_k != nullptr || params.seqused_q != nullptr ||
      params.seqused_k != nullptr ||
      (Variant::kIsFlex && (params.mask_mod.kind != 0 || params.block_sparse.enabled));
  int const max_ctas = unequal_tiles ? kernel_params.scheduler.num_tiles() : num_sm;
  dim3 const grid = Kernel::grid_shape(kernel_params, max_ctas);
  auto kernel = &flash_fwd_kernel_sm90<Kernel>;
  check_launch(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    Kernel::kSharedStorageBytes),
               "cuflash forward: cannot reserve shared memory");
  kernel<<<grid, Kernel::kNumThreads, Kernel::kSharedStorageBytes, stream>>>(kernel_params);
  check_launch(cudaGetLastError(), "cuflash forward: kernel launch failed");
}

}  // namespace cuflash::sm90
