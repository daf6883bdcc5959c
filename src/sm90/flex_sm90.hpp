// The flex path of the forward kernel (variants::FlexVariant): which n-blocks a tile visits
// (FlexBlockWalk, from the mask_mod's block-level hook or from FlexAttention block lists) and
// the score_mod / mask_mod applied to a tile of scores (FlexTileMods).
#pragma once

#include <cutlass/cutlass.h>

#include <cmath>
#include <cute/tensor.hpp>
#include <type_traits>

#include "sm90/pack_gqa_sm90.hpp"
#include "sm90/utils_sm90.hpp"
#include "variants/variant.hpp"

namespace cuflash::sm90 {

// The n-blocks of one tile, in the order the producer loads them and the consumers use them.
// Without block lists: n_block_max - 1 down to n_block_min, all with mask_mod. With them (as
// the seed's block_sparse_utils): the row block's mask-list blocks, then its full-list blocks,
// each list from its last entry; a list block of block_n keys is block_n / kBlockN kernel
// n-blocks (last first), and those outside [n_block_min, n_block_max) (causal / window /
// sequence length) are skipped. Lists are assumed disjoint and free of repeats, as
// FlexAttention builds them; entries outside [0, ceil(seqlen_k / block_n)) are skipped.
template <int kBlockM, int kBlockN>
struct FlexBlockWalk {
  int n_block_min, n_block_max;
  int const* mask_idx;
  int const* full_idx;
  int mask_cnt, full_cnt;
  int sub_blocks;  // kernel n-blocks per list block; 0 without lists
  int pos;         // entry, counting through the mask list then the full list
  int sub;         // kernel n-block within the entry, counting down
  int current;     // the n-block the walk stands on
  bool masked;     // whether `current` needs mask_mod
  bool any;        // whether the tile has any n-block

  // first_row: the tile's first query row (m_block * kBlockM, divided by the group when packed).
  CUTLASS_DEVICE static FlexBlockWalk make(BlockSparseParams const& bs, int batch, int head,
                                           int first_row, int n_block_min, int n_block_max) {
    FlexBlockWalk walk{
        n_block_min, n_block_max, nullptr, nullptr,         0,    0,
        0,           0,           0,       n_block_max - 1, true, n_block_min < n_block_max};
    // Tiles without an n-block range (rows past seqused_q, fully masked) read no list.
    if (!bs.enabled || !walk.any) return walk;
    // Dispatch guarantees that a tile's query rows lie in one list row block (bs.block_m a
    // multiple of the tile's query rows) and bs.block_n % kBlockN == 0.
    int const row_block = first_row / bs.block_m;
    long long const list =
        (static_cast<long long>(batch) * bs.num_heads_b + (bs.num_heads_b == 1 ? 0 : head)) *
            bs.num_row_blocks +
        row_block;
    if (bs.mask_block_cnt != nullptr) {
      walk.mask_cnt = min(max(bs.mask_block_cnt[list], 0), bs.num_col_blocks);
      walk.mask_idx = bs.mask_block_idx + list * bs.num_col_blocks;
    }
    if (bs.full_block_cnt != nullptr) {
      walk.full_cnt = min(max(bs.full_block_cnt[list], 0), bs.num_col_blocks);
      walk.full_idx = bs.full_block_idx + list * bs.num_col_blocks;
    }
    walk.sub_blocks = bs.block_n / kBlockN;
    walk.sub = walk.sub_blocks - 1;
    walk.any = walk.seek();
    return walk;
  }

  CUTLASS_DEVICE bool has_blocks() const { return any; }
  CUTLASS_DEVICE int first() const { return current; }

  // Moves to the next n-block; false past the last.
  CUTLASS_DEVICE bool next(int& n_block) {
    if (sub_blocks == 0) return --n_block >= n_block_min;
    --sub;
    bool const found = seek();
    n_block = current;
    return found;
  }

 private:
  // From (pos, sub) on, stands on the first n-block inside [n_block_min, n_block_max).
  CUTLASS_DEVICE bool seek() {
    for (; pos < mask_cnt + full_cnt; ++pos, sub = sub_blocks - 1) {
      bool const in_mask = pos < mask_cnt;
      int const block =
          in_mask ? mask_idx[mask_cnt - 1 - pos] : full_idx[full_cnt - 1 - (pos - mask_cnt)];
      int const base = block * sub_blocks;
      sub = min(sub, n_block_max - 1 - base);
      if (sub >= 0 && base + sub >= n_block_min) {
        current = base + sub;
        masked = in_mask;
        return true;
      }
    }
    return false;
  }
};

// score_mod and mask_mod over one tile of scores, for one (batch, head) and sequence. Packed
// (kPackGqa): `head` is the tile's kv head, `seqlen_q` counts tile rows (query rows times the
// group), and each row is split into its query row and query head before a mod sees it.
template <class Variant, int kBlockM, int kBlockN, bool kPackGqa = false>
struct FlexTileMods {
  typename Variant::Params const& params;
  int batch, head;
  int seqlen_q, seqlen_k;
  // Group 1 when not packed. A reference into the kernel's parameters (constant memory), as
  // `params`: its divisor constants are then operands, not registers held across the mainloop.
  PackGqa const& packing;

  // Query row and head of tile row `tile_row`.
  CUTLASS_DEVICE void place(int tile_row, int& row, int& row_head) const {
    if constexpr (kPackGqa) {
      packing.split(tile_row, head, row, row_head);
    } else {
      row = tile_row;
      row_head = head;
    }
  }

  // The first and last query rows of m_block's tile rows inside the sequence.
  CUTLASS_DEVICE void query_rows(int m_block, int& row_min, int& row_max) const {
    int unused;
    place(m_block * kBlockM, row_min, unused);
    place(min(m_block * kBlockM + kBlockM, seqlen_q) - 1, row_max, unused);
  }

  // Narrows [n_block_min, n_block_max) by the mask_mod's block-level hook (only without block
  // lists: full-list blocks do not apply mask_mod).
  CUTLASS_DEVICE void narrow(int m_block, int& n_block_min, int& n_block_max) const {
    params.mask_mod.visit([&](auto const& mod) {
      if constexpr (!std::is_same_v<std::decay_t<decltype(mod)>, variants::NoMaskMod>) {
        int row_min, row_max;
        query_rows(m_block, row_min, row_max);
        int col_begin = n_block_min * kBlockN, col_end = n_block_max * kBlockN;
        mod.col_range(row_min, row_max, col_begin, col_end);
        n_block_min = max(n_block_min, max(col_begin, 0) / kBlockN);
        n_block_max = min(n_block_max, cute::ceil_div(max(col_end, 0), kBlockN));
        n_block_max = max(n_block_max, n_block_min);
      }
    });
  }

  // Raw <q, k> to the final score: scale (or softcap) and score_mod.
  template <class TensorS, class TensorC>
  CUTLASS_DEVICE void score(TensorS& tSrS, TensorC const& tScS, int m_block, int n_block) const {
    using namespace cute;
    Tensor scores = make_tensor(tSrS.data(), acc_rowcol_layout(tSrS.layout()));
    Tensor coords = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));
    float const score_scale = params.score_scale;
    float const tanh_scale = params.tanh_scale;
    if (tanh_scale != 0.f) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(scores); ++i)
        scores(i) = score_scale * tanh_approx(scores(i) * tanh_scale);
    } else if (score_scale != 1.f) {  // 1 without softcap and score_mod: the scale is in the exponent
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(scores); ++i) scores(i) *= score_scale;
    }
    params.score_mod.visit([&](auto const& mod) {
      if constexpr (!std::is_same_v<std::decay_t<decltype(mod)>, variants::NoScoreMod>) {
        CUTLASS_PRAGMA_UNROLL
        for (int m = 0; m < size<0>(scores); ++m) {
          int row, row_head;
          place(m_block * kBlockM + get<0>(coords(m, 0)), row, row_head);
          CUTLASS_PRAGMA_UNROLL
          for (int n = 0; n < size<1>(scores); ++n) {
            int const col = n_block * kBlockN + get<1>(coords(m, n));
            scores(m, n) = mod.score(scores(m, n), batch, row_head, row, col);
          }
        }
      }
    });
  }

  // Sets the scores that mask_mod hides to -inf. Positions past the sequence are not asked
  // (their keys are hidden by the length mask, their rows are never stored), so an aux array of
  // the sequence's length is never read past its end.
  template <class TensorS, class TensorC>
  CUTLASS_DEVICE void mask(TensorS& tSrS, TensorC const& tScS, int m_block, int n_block) const {
    using namespace cute;
    params.mask_mod.visit([&](auto const& mod) {
      if constexpr (!std::is_same_v<std::decay_t<decltype(mod)>, variants::NoMaskMod>) {
        int row_min, row_max;
        query_rows(m_block, row_min, row_max);
        int const col_first = n_block * kBlockN;
        if (mod.all_visible(row_min, row_max, col_first, min(col_first + kBlockN, seqlen_k) - 1)) {
          return;
        }
        Tensor scores = make_tensor(tSrS.data(), acc_rowcol_layout(tSrS.layout()));
        Tensor coords = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));
        using Mod = std::decay_t<decltype(mod)>;
        if constexpr (variants::HasKeyCompare<Mod>::value) {
          // Key compares: one key per row and one per column instead of two loads (each behind a
          // branch) per score. Rows and columns are clamped into the sequence: columns past
          // seqlen_k are hidden by the length mask, rows past seqlen_q are never stored.
          constexpr int kRows = decltype(size<0>(scores))::value;
          int row_keys[kRows];
          CUTLASS_PRAGMA_UNROLL
          for (int m = 0; m < kRows; ++m) {
            int row, row_head;
            place(min(m_block * kBlockM + int(get<0>(coords(m, 0))), seqlen_q - 1), row, row_head);
            row_keys[m] = mod.row_key(batch, row);
          }
          CUTLASS_PRAGMA_UNROLL
          for (int n = 0; n < size<1>(scores); ++n) {
            int const col_key = mod.col_key(batch, min(col_first + int(get<1>(coords(0, n))), seqlen_k - 1));
            CUTLASS_PRAGMA_UNROLL
            for (int m = 0; m < kRows; ++m) {
              if (row_keys[m] != col_key) scores(m, n) = -INFINITY;
            }
          }
        } else {
          CUTLASS_PRAGMA_UNROLL
          for (int m = 0; m < size<0>(scores); ++m) {
            int const tile_row = m_block * kBlockM + get<0>(coords(m, 0));
            if (tile_row >= seqlen_q) continue;
            int row, row_head;
            place(tile_row, row, row_head);
            if constexpr (variants::HasRowInterval<Mod>::value) {
              // The row's keys as one interval, relative to the block: two compares per element
              // (evaluating the mask per element cost more than the block's softmax). Columns past
              // seqlen_k are hidden by the length mask either way.
              int col_begin = col_first, col_end = col_first + kBlockN;
              mod.row_interval(row, col_begin, col_end);
              col_begin -= col_first;
              col_end -= col_first;
              CUTLASS_PRAGMA_UNROLL
              for (int n = 0; n < size<1>(scores); ++n) {
                int const col = get<1>(coords(m, n));
                if (col < col_begin || col >= col_end) scores(m, n) = -INFINITY;
              }
            } else {
              CUTLASS_PRAGMA_UNROLL
              for (int n = 0; n < size<1>(scores); ++n) {
                int const col = col_first + get<1>(coords(m, n));
                if (col < seqlen_k && !mod.visible(batch, row_head, row, col)) scores(m, n) = -INFINITY;
              }
            }
          }
        }
      }
    });
  }
};

}  // namespace cuflash::sm90
