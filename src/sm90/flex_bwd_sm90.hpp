// Which m-blocks (row blocks of Q / dO) one column block of the sm90 backward visits, in the
// order the producer warp loads them, the dQ warp stores them and the MMA warpgroups use them:
// MBlockRange for the plain kernel, FlexColumnWalk for the flex variant (variants::FlexVariant,
// from the mask_mod's block-level hook or from the transposed FlexAttention block lists).
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
// mask_mod. With them (as the seed's backward block sparsity): the column block's mask-list row
// blocks, then its full-list ones, each list from its first entry; a list block of block_m
// queries is block_m / kBlockM kernel m-blocks (upwards), and those outside
// [m_block_min, m_block_max) (causal / window / sequence length) are skipped. Lists are assumed
// disjoint and free of repeats, as FlexAttention builds them.
// Deterministic runs with block lists walk upwards instead, through the row-block classes that
// dispatch tabulates from the lists (BlockSparseParams::row_class: 0 not listed, 1 mask list,
// 2 full list), so that the m-blocks a walk leaves out are the gaps between the ones it visits:
// the dQ writer passes the deterministic turn of each of them (pass_turns in the mainloop), and
// the window's [window_min, window_max) bounds them.
template <int kBlockM, int kBlockN>
struct FlexColumnWalk {
  int window_min, window_max;  // the window's m-blocks, before mask_mod narrowing or lists
  int m_block_min, m_block_max;
  int const* mask_idx;
  int const* full_idx;
  unsigned char const* row_class;  // deterministic with lists: this column block's row classes
  int mask_cnt, full_cnt;
  int sub_blocks;  // kernel m-blocks per list block; 0 without lists
  int pos;         // entry, counting through the mask list then the full list
  int sub;         // kernel m-block within the entry, counting up
  int m_block;     // the m-block the walk stands on
  bool masked;     // whether `m_block` needs mask_mod
  bool any;        // whether the walk stands on an m-block

  template <class FlexParams>
  CUTE_DEVICE static FlexColumnWalk make(FlexParams const& flex, int seqlen_k,
                                         int batch, int head, int n_block, int m_block_min,
                                         int m_block_max) {
    FlexColumnWalk walk{m_block_min, m_block_max, m_block_min, m_block_max, nullptr, nullptr, nullptr,
                        0,           0,           0,           0,           0,       m_block_min, true, false};
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
    walk.sub_blocks = bs.block_m / kBlockM;
    if (bs.row_class != nullptr) {
      walk.row_class = bs.row_class + list * bs.num_row_blocks;
      walk.any = walk.seek_class();
      return walk;
    }
    if (bs.mask_block_cnt != nullptr) {
      walk.mask_cnt = cute::min(cute::max(bs.mask_block_cnt[list], 0), bs.num_row_blocks);
      walk.mask_idx = bs.mask_block_idx + list * bs.num_row_blocks;
    }
    if (bs.full_block_cnt != nullptr) {
      walk.full_cnt = cute::min(cute::max(bs.full_block_cnt[list], 0), bs.num_row_blocks);
      walk.full_idx = bs.full_block_idx + list * bs.num_row_blocks;
    }
    walk.any = walk.seek();
    return walk;
  }

  CUTE_DEVICE bool valid() const { return any; }

  CUTE_DEVICE void next() {
    if (sub_blocks == 0) {
      any = ++m_block < m_block_max;
    } else if (row_class != nullptr) {
      ++m_block;
      any = seek_class();
    } else {
      ++sub;
      any = seek();
    }
  }

 private:
  // From (pos, sub) on, stands on the first m-block inside [m_block_min, m_block_max).
  CUTE_DEVICE bool seek() {
    for (; pos < mask_cnt + full_cnt; ++pos, sub = 0) {
      bool const in_mask = pos < mask_cnt;
      int const block = in_mask ? mask_idx[pos] : full_idx[pos - mask_cnt];
      int const base = block * sub_blocks;
      sub = cute::max(sub, m_block_min - base);
      if (sub < sub_blocks && base + sub < m_block_max) {
        m_block = base + sub;
        masked = in_mask;
        return true;
      }
    }
    return false;
  }

  // From m_block upwards, stands on the first m-block that a list names.
  CUTE_DEVICE bool seek_class() {
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
