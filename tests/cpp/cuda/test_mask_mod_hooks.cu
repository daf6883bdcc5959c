// The built-in mask_mods' block-level hooks against their element-level `visible`, which the
// kernels rely on: `row_interval` is exactly the keys a row sees, `col_range` keeps every key
// that some row of a rectangle sees, `row_range` every query that sees some column of it, and
// `all_visible` is true only when every position of the rectangle is visible; where a mod has
// `row_key` / `col_key`, their equality is `visible`. Host only:
// compiled by nvcc for the CUTLASS headers, run on the CPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "variants/builtin_mods.hpp"

namespace cuflash::variants {
namespace {

constexpr int kRows = 70, kCols = 90, kBlock = 16;

template <class Mod>
void check_hooks(Mod const& mod, const char* what) {
  SCOPED_TRACE(what);
  if constexpr (HasKeyCompare<Mod>::value) {
    // The kernels compare one key per row with one per column instead of calling visible.
    for (int b = 0; b < 2; ++b) {
      for (int q = 0; q < kRows; ++q) {
        for (int kv = 0; kv < kCols; ++kv) {
          EXPECT_EQ(mod.visible(b, 0, q, kv), mod.row_key(b, q) == mod.col_key(b, kv))
              << "b " << b << " q " << q << " kv " << kv;
        }
      }
    }
  }
  for (int q = 0; q < kRows; ++q) {
    for (int first = 0; first < kCols; first += kBlock) {
      if constexpr (HasRowInterval<Mod>::value) {
        int begin = first, end = first + kBlock;
        mod.row_interval(q, begin, end);
        for (int kv = first; kv < first + kBlock; ++kv) {
          EXPECT_EQ(mod.visible(0, 0, q, kv), begin <= kv && kv < end) << "q " << q << " kv " << kv;
        }
      }
    }
  }
  for (int row_min = 0; row_min < kRows; row_min += kBlock) {
    int const row_max = std::min(row_min + kBlock, kRows) - 1;
    for (int col_min = 0; col_min < kCols; col_min += kBlock) {
      int const col_max = std::min(col_min + kBlock, kCols) - 1;
      int col_begin = 0, col_end = kCols, row_begin = 0, row_end = kRows;
      mod.col_range(row_min, row_max, col_begin, col_end);
      mod.row_range(col_min, col_max, row_begin, row_end);
      bool all = true;
      for (int q = row_min; q <= row_max; ++q) {
        for (int kv = col_min; kv <= col_max; ++kv) {
          bool const seen = mod.visible(0, 0, q, kv);
          all = all && seen;
          if (seen) {
            EXPECT_TRUE(col_begin <= kv && kv < col_end) << "col_range drops q " << q << " kv " << kv;
            EXPECT_TRUE(row_begin <= q && q < row_end) << "row_range drops q " << q << " kv " << kv;
          }
        }
      }
      if (mod.all_visible(row_min, row_max, col_min, col_max)) {
        EXPECT_TRUE(all) << "all_visible over rows " << row_min << ".." << row_max << " cols " << col_min << ".."
                         << col_max;
      }
    }
  }
}

TEST(MaskModHooks, CausalAgreesWithVisible) {
  static_assert(HasRowInterval<RowIntervalMaskMod>::value && !HasKeyCompare<RowIntervalMaskMod>::value);
  check_hooks(RowIntervalMaskMod::causal(), "causal");
}

TEST(MaskModHooks, SlidingWindowAgreesWithVisible) {
  // Negative sides are unbounded; 1 << 30 is the largest side the API passes (ModParams::whole).
  for (int left : {-1, 0, 1, 7, 16, 40, 1 << 30}) {
    for (int right : {-1, 0, 1, 5, 16, 33, 1 << 30}) {
      check_hooks(RowIntervalMaskMod::sliding_window(left, right),
                  ("window left " + std::to_string(left) + " right " + std::to_string(right)).c_str());
    }
  }
}

TEST(MaskModHooks, PrefixLMAgreesWithVisible) {
  for (int prefix : {0, 1, 15, 16, 50, 200}) {
    check_hooks(RowIntervalMaskMod::prefix_lm(prefix), ("prefix " + std::to_string(prefix)).c_str());
  }
}

TEST(MaskModHooks, DocumentAgreesWithVisible) {
  // Documents are not intervals of keys in general (ids may interleave): no row_interval.
  static_assert(!HasRowInterval<DocumentMaskMod>::value && HasKeyCompare<DocumentMaskMod>::value);
  // Two batch rows (the second shifted), row stride kCols + 3.
  constexpr int kStride = kCols + 3;
  std::vector<int> ids(2 * kStride, -1);
  for (int i = 0; i < kCols; ++i) {
    ids[i] = (i / 11 + (i % 3 == 0)) % 4;  // runs with interleaved ids
    ids[kStride + i] = (i + 5) / 9;
  }
  check_hooks(DocumentMaskMod{ids.data(), kStride}, "document");
}

}  // namespace
}  // namespace cuflash::variants
