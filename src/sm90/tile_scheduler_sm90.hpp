// Persistent tile scheduler for the forward kernel: a grid of at most one CTA per SM, each
// walking the tile list with a stride of the grid size, so that the next tile's loads overlap
// the current tile's epilogue and no SM waits on a new CTA launch.
// Tile order: without causal/local masking, m-block fastest so that the CTAs working on one
// K/V head at a time share it through L2; with it, the m-blocks that see the most keys (the
// last ones, bottom-right alignment) come first for every head, so that the short ones fill
// the tail (longest-processing-time first).
#pragma once

#include <algorithm>

#include <cuda_runtime.h>
#include <cutlass/cutlass.h>

namespace cuflash::sm90 {

struct FwdTile {
  int m_block, head, batch;
};

struct PersistentTileSchedulerSm90 {
  int num_m_blocks, num_heads, batch;
  bool longest_first;

  CUTLASS_HOST_DEVICE int num_tiles() const { return num_m_blocks * num_heads * batch; }

  static dim3 grid_shape(int num_tiles, int num_sm) { return dim3(unsigned(std::max(1, std::min(num_tiles, num_sm)))); }

  CUTLASS_DEVICE FwdTile tile(int index) const {
    if (longest_first) {
      int const heads_batches = num_heads * batch;
      int const rest = index % heads_batches;
      return {num_m_blocks - 1 - index / heads_batches, rest % num_heads, rest / num_heads};
    }
    int const rest = index / num_m_blocks;
    return {index % num_m_blocks, rest % num_heads, rest / num_heads};
  }
};

}  // namespace cuflash::sm90
