// Which m-blocks (row blocks of Q / dO) one column block of the sm90 backward visits, in the
// order the producer warp loads them, the dQ warp stores them and the MMA warpgroups use them:
// MBlockRange for the plain kernel, FlexColumnWalk for the flex variant (variants::FlexVariant,
// from the mask_mod's block-level hook or from the FlexAttention block lists as dispatch
// tabulates them).
#pragma once

#include <cutlass/cutlass.h>

#include <cute/tensor.hpp>
#include <type_traits>

#include "variants/variant.hpp"

namespace cuflash::sm90::bwd {

// [m_block_min, m_block_max) upwards from `start`, wrapping around to m_block_min when kWrap:
// the deterministic backward without a window starts each column block at a different row block
// (MainloopBwdSm90::dq_rank). Without kWrap, start is m_block_min and the walk holds no more than
// the two bounds.
template <bool kWrap>
struct MBlockRange;

template <>
struct MBlockRange<false> {
  int m_block, m_block_max;
  CUTE_DEVICE static MBlockRange make(int m_block_min, int m_block_max, int) { return {m_block_min, m_block_max}; }
  CUTE_DEVICE bool valid() const { return m_block < m_block_max; }
  CUTE_DEVICE void next() { ++m_block; }
};

template <>
struct MBlockRange<true> {
  int m_block, m_block_min, m_block_max, remaining;
  CUTE_DEVICE static MBlockRange make(int m_block_min, int m_block_max, int start) {
    return {start, m_block_min, m_block_max, m_block_max - m_block_min};
  }
  CUTE_DEVICE bool valid() const { return remaining > 0; }
  CUTE_DEVICE void next() {
    if (++m_block == m_block_max) { m_block = m_block_min; }
    --remaining;
  }
};

// Without block lists: [m_block_min, m_block_max) narrowed by the mask_mod's row_range, all with
// mask_mod. With them (as the seed's backward block sparsity): the row blocks that the column
// block's lists name, upwards, through the row-block classes that dispatch tabulates from the
// lists, the column-block ones or the forward's, in any order (BlockSparseParams::row_class: 0
// not listed, 1 mask list, 2 full list); a list block of block_m queries is block_m / kBlockM
// kernel m-blocks, and those outside [m_block_min, m_block_max) (causal / window / sequence
// length) are skipped. Either way the walk goes upwards. Deterministic runs rank a row block's
// contributors (the mainloop's dq_rank_flex) from the same row-class table with lists and by
// making their walks without: what this walk visits and what those ranks count must stay the
// same function of the column block.
template <int kBlockM, int kBlockN>
struct FlexColumnWalk {
  int m_block_min, m_block_max;  // the window's m-blocks, narrowed by mask_mod or by the lists' bounds
  unsigned char const* row_class;  // with lists: this column block's row-block classes
  int sub_blocks;  // kernel m-blocks per list block; 0 without lists
  int m_block;     // the m-block the walk stands on
  bool masked;     // whether `m_block` needs mask_mod
  bool any;        // whether the walk stands on an m-block

  template <class FlexParams>
  CUTE_DEVICE static FlexColumnWalk make(FlexParams const& flex, int seqlen_k,
                                         int batch, int head, int n_block, int m_block_min,
                                         int m_block_max) {
    FlexColumnWalk walk{m_block_min, m_block_max, nullptr, 0, m_block_min, true, false};
    // Column blocks without a row range (keys past seqused_k, fully masked) read no list.
    if (m_block_min >= m_block_max) {
      return walk;
    }
    BlockSparseParams const& bs = flex.block_sparse;
    if (!bs.enabled) {
      flex.mask_mod.visit([&](auto const& mod) {
        if constexpr (!std::is_same_v<std::decay_t<decltype(mod)>, variants::NoMaskMod>) {
          int const col_min = n_block * kBlockN;
          int const col_max = cute::min(col_min + kBlockN, seqlen_k) - 1;
          int row_begin = walk.m_block_min * kBlockM, row_end = walk.m_block_max * kBlockM;
          mod.row_range(col_min, col_max, row_begin, row_end);
          walk.m_block_min = cute::max(walk.m_block_min, cute::max(row_begin, 0) / kBlockM);
          walk.m_block_max =
              cute::min(walk.m_block_max, cute::ceil_div(cute::max(row_end, 0), kBlockM));
        }
      });
      walk.m_block = walk.m_block_min;
      walk.any = walk.m_block < walk.m_block_max;
      return walk;
    }
    // Dispatch guarantees bs.block_m % kBlockM == 0 and bs.block_n % kBlockN == 0.
    int const col_block = n_block * kBlockN / bs.block_n;
    long long const list =
        (static_cast<long long>(batch) * bs.num_heads_b + (bs.num_heads_b == 1 ? 0 : head)) *
            bs.num_col_blocks +
        col_block;
    walk.row_class = bs.row_class + list * bs.num_row_blocks;
    walk.sub_blocks = bs.block_m / kBlockM;
    // Only the row blocks between the first and the last that the lists name: a long sequence
    // has many row blocks, and seeking through each unlisted one is a dependent load.
    int const first_listed = bs.num_row_blocks - bs.row_bounds[2 * list];
    int const end_listed = bs.row_bounds[2 * list + 1];
    walk.m_block_min = cute::max(walk.m_block_min, first_listed * walk.sub_blocks);
    walk.m_block_max = cute::min(walk.m_block_max, end_listed * walk.sub_blocks);
    walk.m_block = walk.m_block_min;
    walk.any = walk.seek();
    return walk;
  }

  CUTE_DEVICE bool valid() const { return any; }

  CUTE_DEVICE void next() {
    ++m_block;
    any = sub_blocks == 0 ? m_block < m_block_max : seek();
  }

 private:
  // From m_block upwards, stands on the first m-block that a list names.
  CUTE_DEVICE bool seek() {
    for (; m_block < m_block_max; ++m_block) {
      unsigned char const c = row_class[m_block / sub_blocks];
      if (c != 0) {
        masked = c == 1;
        return true;
      }
    }
    return false;
  }
};

}  // namespace cuflash::sm90::bwd
