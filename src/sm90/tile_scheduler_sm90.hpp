// Maps CTAs to (m_block, head, batch) tiles: one tile per CTA, the m-block index fastest so
// that CTAs sharing a K/V head run together and share it through L2. With causal or local
// masking the later row blocks see more keys (bottom-right alignment), so they start first.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/cutlass.h>

namespace cuflash::sm90 {

struct FwdTile {
  int m_block, head, batch;
};

struct SingleTileSchedulerSm90 {
  static dim3 grid_shape(int num_m_blocks, int num_heads, int batch) {
    return dim3(unsigned(num_m_blocks), unsigned(num_heads), unsigned(batch));
  }

  CUTLASS_DEVICE static FwdTile tile(int num_m_blocks, bool longest_first) {
    int const m = int(blockIdx.x);
    return {longest_first ? num_m_blocks - 1 - m : m, int(blockIdx.y), int(blockIdx.z)};
  }
};

}  // namespace cuflash::sm90
