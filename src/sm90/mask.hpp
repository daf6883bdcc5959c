// Causal / sliding-window / sequence-length masking for the forward kernel.
// Windows are aligned bottom-right: key j is visible to query i iff
//   i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right,
// with a negative window side meaning unbounded (causal is window_right = 0).
// Two levels: the range of n-blocks a row block visits at all, and whether one n-block
// needs per-element masking (only blocks on a mask edge pay for it).
// Packed GQA (pack_group > 1): a tile's rows are (query row, head of the group) pairs, tile row
// r being query row r / pack_group of head r % pack_group; the mask sees the query row.
#pragma once

#include <cutlass/cutlass.h>

#include <climits>

#include <cute/tensor.hpp>

#include "sm90/utils_sm90.hpp"

namespace cuflash::sm90 {

// The n-blocks of a tile without block lists: n_block_max - 1 down to n_block_min.
struct NBlockRange {
  int n_block_min, n_block_max;
  CUTLASS_DEVICE bool has_blocks() const { return n_block_min < n_block_max; }
  CUTLASS_DEVICE int first() const { return n_block_max - 1; }
  // Moves to the next n-block; false past the last.
  CUTLASS_DEVICE bool next(int& n_block) const { return --n_block >= n_block_min; }
};

// The plain kernel's score hooks: none (the flex variant's are FlexTileMods, flex_sm90.hpp).
struct NoTileMods {};

template <int kBlockM, int kBlockN>
struct FwdMask {
  int seqlen_q, seqlen_k;         // query rows (not packed) and keys
  int window_left, window_right;  // < 0: unbounded
  // Query heads per kv head in a packed GQA tile, else 1. Inside the mainloop the packed tests
  // are multiplications (floor(r / g) >= t  <=>  r >= g * t): the mask lives in registers there,
  // beside S, P and O, where a division's temporaries (or a FastDivmod's state) spill at hdim 256.
  int pack_group = 1;

  CUTLASS_DEVICE int diagonal_offset() const { return seqlen_k - seqlen_q; }

  // The query row of tile row `row` (m_block * kBlockM + its index in the tile).
  CUTLASS_DEVICE int query_row(int row) const {
    return pack_group == 1 ? row : row / pack_group;
  }

  // [n_block_min, n_block_max) holds every key visible to some row of m_block.
  CUTLASS_DEVICE void n_block_range(int m_block, int& n_block_min, int& n_block_max) const {
    n_block_min = 0;
    n_block_max = cute::ceil_div(seqlen_k, kBlockN);
    int const first = m_block * kBlockM;
    int const last = min((m_block + 1) * kBlockM, seqlen_q * pack_group) - 1;
    if (last < first) {  // no query row in this block
      n_block_max = 0;
      return;
    }
    int const row_min = query_row(first);
    int const row_max = query_row(last);
    if (window_right >= 0) {
      int const col_end = row_max + diagonal_offset() + window_right + 1;
      n_block_max = min(n_block_max, cute::ceil_div(max(col_end, 0), kBlockN));
    }
    if (window_left >= 0) {
      int const col_begin = row_min + diagonal_offset() - window_left;
      n_block_min = max(col_begin, 0) / kBlockN;
    }
    n_block_max = max(n_block_max, n_block_min);
  }

  // True when some element of (m_block, n_block) is hidden (conservative).
  CUTLASS_DEVICE bool needs_mask(int m_block, int n_block) const {
    int const col_first = n_block * kBlockN;
    int const col_last = col_first + kBlockN - 1;
    bool const past_seqlen = col_last >= seqlen_k;
    // Right edge: col_last > query_row(first row) + offset, i.e. first row < g * (col_last -
    // offset); left edge: col_first < query_row(last row) + offset - window_left.
    int const first_row = m_block * kBlockM;
    bool const right_edge =
        window_right >= 0 &&
        first_row < pack_group * (col_last - diagonal_offset() - window_right);
    bool const left_edge =
        window_left >= 0 && first_row + kBlockM - 1 >= pack_group * (col_first + 1 -
                                                                      diagonal_offset() +
                                                                      window_left);
    return past_seqlen || right_edge || left_edge;
  }

  // Sets hidden scores to -inf. tSrS: the thread's WGMMA accumulator; tScS: the matching
  // (row, col) coordinates within the tile.
  template <class TensorS, class TensorC>
  CUTLASS_DEVICE void apply(TensorS& tSrS, TensorC const& tScS, int m_block, int n_block) const {
    using namespace cute;
    Tensor scores = make_tensor(tSrS.data(), acc_rowcol_layout(tSrS.layout()));
    Tensor coords = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));
    int const col_offset = n_block * kBlockN;
    if (pack_group != 1) {
      apply_packed(scores, coords, m_block, col_offset);
      return;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < size<0>(scores); ++m) {
      int const row = query_row(m_block * kBlockM + get<0>(coords(m, 0)));
      int col_end = seqlen_k - col_offset;  // exclusive, relative to the block
      if (window_right >= 0)
        col_end = min(col_end, row + diagonal_offset() + window_right + 1 - col_offset);
      int const col_begin =
          window_left >= 0 ? row + diagonal_offset() - window_left - col_offset : -1;
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < size<1>(scores); ++n) {
        int const col = get<1>(coords(m, n));
        if (col >= col_end || col < col_begin) scores(m, n) = -INFINITY;
      }
    }
  }

  // apply for packed GQA tiles: tile row r is query row floor(r / g), and key c (relative to
  // the block) is visible iff  r >= g * (c + col_offset - offset - window_right)  (right) and
  // r < g * (c + col_offset - offset + window_left + 1)  (left).
  template <class TensorS, class TensorC>
  CUTLASS_DEVICE void apply_packed(TensorS& scores, TensorC const& coords, int m_block,
                                   int col_offset) const {
    using namespace cute;
    int const g = pack_group;
    int const col_end = seqlen_k - col_offset;
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < size<0>(scores); ++m) {
      int const row = m_block * kBlockM + get<0>(coords(m, 0));
      // row - g * (col_offset - offset - window_right) >= g * c
      int const right = window_right >= 0
                            ? row - g * (col_offset - diagonal_offset() - window_right)
                            : INT_MAX;
      // row - g * (col_offset - offset + window_left + 1) < g * c
      int const left = window_left >= 0
                           ? row - g * (col_offset - diagonal_offset() + window_left + 1)
                           : INT_MIN;
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < size<1>(scores); ++n) {
        int const col = get<1>(coords(m, n));
        int const g_col = g * col;
        if (col >= col_end || right < g_col || left >= g_col) scores(m, n) = -INFINITY;
      }
    }
  }
};

}  // namespace cuflash::sm90
