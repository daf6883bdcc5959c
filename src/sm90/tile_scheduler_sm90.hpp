// Tile scheduler for the forward kernel: each CTA walks the tile list with a stride of the grid
// size. With a grid of one CTA per SM it is persistent (the next tile's loads overlap the
// current tile's epilogue); with one CTA per tile the hardware balances tiles of unequal cost
// (the launch chooses, flash_fwd_launch_sm90.hpp).
// Tiles are (m_block, head, batch, split); split-KV splits count as more (batch, head) pairs.
// Tile order: (batch, head) pairs in sections whose K/V fit in L2 together. Without causal/local
// masking, m-block fastest within a section; with it, the m-blocks that see the most keys (the
// last ones, bottom-right alignment) come first for every head of the section, so that the
// short ones fill the tail (longest-processing-time first).
#pragma once

#include <cuda_runtime.h>
#include <cutlass/cutlass.h>

#include <algorithm>

namespace cuflash::sm90 {

struct FwdTile {
  int m_block, head, batch;
  int split;  // split-KV: which part of the key range (0 without split-KV)
};

struct PersistentTileSchedulerSm90 {
  int num_m_blocks, num_heads, batch, num_splits;
  bool longest_first;
  // (batch, head) pairs are walked in sections of this many, so that the K/V being read at
  // any time stay within L2 (host side: a fraction of L2 over one head's K/V bytes).
  int section_size;

  CUTLASS_HOST_DEVICE int num_heads_batches() const { return num_heads * batch * num_splits; }
  CUTLASS_HOST_DEVICE int num_tiles() const { return num_m_blocks * num_heads_batches(); }

  static dim3 grid_shape(int num_tiles, int num_sm) {
    return dim3(unsigned(std::max(1, std::min(num_tiles, num_sm))));
  }

  static int choose_section_size(long long kv_bytes_per_head, int heads_per_kv_head,
                                 int num_heads_batches) {
    constexpr long long kL2Budget = 16ll
                                    << 20;  // of the H200's 50 MB, leaving room for Q/O streams
    long long const kv_heads = std::max(1ll, kL2Budget / std::max(1ll, kv_bytes_per_head));
    return int(std::max(1ll, std::min<long long>(kv_heads * heads_per_kv_head, num_heads_batches)));
  }

  CUTLASS_DEVICE FwdTile tile(int index) const {
    int const tiles_per_section = num_m_blocks * section_size;
    int const section = index / tiles_per_section;
    int const first_head_batch = section * section_size;
    int const heads_batches_here = min(section_size, num_heads_batches() - first_head_batch);
    int const rest = index - section * tiles_per_section;
    int m_block, head_batch;
    if (longest_first) {
      m_block = num_m_blocks - 1 - rest / heads_batches_here;
      head_batch = first_head_batch + rest % heads_batches_here;
    } else {
      m_block = rest % num_m_blocks;
      head_batch = first_head_batch + rest / num_m_blocks;
    }
    int const batch_split = head_batch / num_heads;
    return {m_block, head_batch % num_heads, batch_split / num_splits, batch_split % num_splits};
  }
};

}  // namespace cuflash::sm90
