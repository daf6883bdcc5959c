// The built-in score_mod and mask_mod functors (ScoreModKind / MaskModKind in options.hpp).
// Each is a small type holding its runtime parameters (scalars, aux pointers) with an
// element-level hook, `score(s, b, h, q_idx, kv_idx)` or `visible(b, h, q_idx, kv_idx)`, where
// q_idx and kv_idx count from the start of the sequence (top-left, as in FlexAttention) and s is
// the scaled, soft-capped score. Score mods also give their derivative d score / d s for the
// backward, `grad(s, b, h, q_idx, kv_idx)`. Mask mods also have block-level hooks over a
// rectangle of positions: `col_range` narrows the keys any of the rows can see (forward),
// `row_range` the queries that can see any of the columns (backward), `all_visible` tells when
// no element of the rectangle is hidden (so the per-element check can be skipped). Masks whose
// rows each see one interval of keys also have `row_interval(q_idx, col_begin, col_end)`, which
// narrows [col_begin, col_end) to the keys row q_idx sees, so that a tile is masked with two
// compares per element, as the plain kernels' causal and window masks (HasRowInterval).
// The mask mods' hooks are host-callable too, so that their agreement is checked on the CPU
// (tests/cpp/cuda/test_mask_mod_hooks.cu). ScoreModSwitch / MaskModSwitch hold one built-in
// chosen at run time; `visit` calls a generic callable with the concrete functor, so the kind is
// tested once per tile, not per element.
#pragma once

#include <cutlass/cutlass.h>

#include <type_traits>
#include <utility>

#include "api/params.hpp"
#include "cuflash/options.hpp"

namespace cuflash::variants {

struct NoScoreMod {};

// s + slopes[h] * (kv_idx - q_idx); slopes: fp32 (H,).
struct AlibiScoreMod {
  float const* slopes;
  CUTLASS_DEVICE float score(float s, int /*b*/, int h, int q_idx, int kv_idx) const {
    return s + slopes[h] * float(kv_idx - q_idx);
  }
  CUTLASS_DEVICE float grad(float /*s*/, int /*b*/, int /*h*/, int /*q_idx*/,
                            int /*kv_idx*/) const {
    return 1.f;
  }
};

// s + table[h, clamp(kv_idx - q_idx, -R, R) + R]; table: fp32 (H, 2R + 1).
struct RelativeBiasScoreMod {
  float const* table;
  int width;  // 2R + 1
  CUTLASS_DEVICE float score(float s, int /*b*/, int h, int q_idx, int kv_idx) const {
    int const radius = (width - 1) / 2;
    int const distance = min(max(kv_idx - q_idx, -radius), radius);
    return s + table[h * width + distance + radius];
  }
  CUTLASS_DEVICE float grad(float /*s*/, int /*b*/, int /*h*/, int /*q_idx*/,
                            int /*kv_idx*/) const {
    return 1.f;
  }
};

// Every mask below narrows columns with col_range(row_min, row_max, col_begin, col_end):
// [col_begin, col_end) is narrowed to the keys that some row in [row_min, row_max] can see;
// and rows with row_range(col_min, col_max, row_begin, row_end): [row_begin, row_end) is
// narrowed to the queries that see some column in [col_min, col_max].
struct NoMaskMod {};

// The masks whose rows each see one interval of keys, as one functor: kv_idx within
// [q_idx - left, q_idx + right] (a negative side unbounded), or kv_idx < prefix.
//   causal:          left -1, right 0, prefix 0    (kv_idx <= q_idx)
//   sliding window:  left, right, prefix 0
//   prefix LM:       left -1, right 0, prefix P    (kv_idx <= q_idx or kv_idx < P)
// A prefix only comes with an unbounded left side, so a row's keys are one interval.
struct RowIntervalMaskMod {
  int left = -1, right = 0, prefix = 0;

  static constexpr RowIntervalMaskMod causal() { return {-1, 0, 0}; }
  static constexpr RowIntervalMaskMod sliding_window(int left_keys, int right_keys) {
    return {left_keys, right_keys, 0};
  }
  static constexpr RowIntervalMaskMod prefix_lm(int prefix_keys) { return {-1, 0, prefix_keys}; }

  CUTLASS_HOST_DEVICE bool visible(int /*b*/, int /*h*/, int q_idx, int kv_idx) const {
    return ((left < 0 || q_idx - kv_idx <= left) && (right < 0 || kv_idx - q_idx <= right)) ||
           kv_idx < prefix;
  }
  CUTLASS_HOST_DEVICE void col_range(int row_min, int row_max, int& col_begin, int& col_end) const {
    if (left >= 0) col_begin = max(col_begin, row_min - left);
    if (right >= 0) col_end = min(col_end, max(row_max + right + 1, prefix));
  }
  CUTLASS_HOST_DEVICE void row_interval(int q_idx, int& col_begin, int& col_end) const {
    if (left >= 0) col_begin = max(col_begin, q_idx - left);
    // min(col_end, max(q_idx + right + 1, prefix)) without overflow for a large right.
    if (right >= 0 && right < col_end - q_idx) col_end = max(q_idx + right + 1, min(col_end, prefix));
  }
  CUTLASS_HOST_DEVICE void row_range(int col_min, int col_max, int& row_begin, int& row_end) const {
    if (col_min < prefix) return;  // every query sees the prefix's keys
    if (right >= 0) row_begin = max(row_begin, col_min - right);
    if (left >= 0) row_end = min(row_end, col_max + left + 1);
  }
  CUTLASS_HOST_DEVICE bool all_visible(int row_min, int row_max, int col_first, int col_last) const {
    return ((left < 0 || row_max - col_first <= left) && (right < 0 || col_last - row_min <= right)) ||
           col_last < prefix;
  }
};

// ids[b, q_idx] == ids[b, kv_idx]; ids: int32 (B, L), row stride `stride`.
struct DocumentMaskMod {
  int const* ids;
  long long stride;
  CUTLASS_HOST_DEVICE bool visible(int b, int /*h*/, int q_idx, int kv_idx) const {
    int const* row = ids + b * stride;
    return row[q_idx] == row[kv_idx];
  }
  // visible(b, h, q, kv) == (row_key(b, q) == col_key(b, kv)): the kernels load one key per row
  // and per column of a block instead of two per score (HasKeyCompare).
  CUTLASS_HOST_DEVICE int row_key(int b, int q_idx) const { return ids[b * stride + q_idx]; }
  CUTLASS_HOST_DEVICE int col_key(int b, int kv_idx) const { return ids[b * stride + kv_idx]; }
  CUTLASS_HOST_DEVICE void col_range(int, int, int&, int&) const {}
  CUTLASS_HOST_DEVICE void row_range(int, int, int&, int&) const {}
  CUTLASS_HOST_DEVICE bool all_visible(int, int, int, int) const { return false; }
};

// One built-in score_mod, chosen at run time (ScoreModKind value).
struct ScoreModSwitch {
  // Every built-in adds a bias to s, so d score / d s = 1: without softcap the backward needs no
  // per-element derivative.
  static constexpr bool kUnitGrad = true;

  int kind = 0;
  float const* table = nullptr;  // alibi slopes or the relative-bias table
  int width = 0;                 // relative bias: 2R + 1

  static ScoreModSwitch from(ModParams const& mod) {
    ScoreModSwitch result;
    result.kind = mod.kind;
    if (mod.kind != 0) {
      result.table = static_cast<float const*>(mod.aux[0]);
      result.width = int(mod.aux_cols[0]);
    }
    return result;
  }

  template <class Fn>
  CUTLASS_HOST_DEVICE void visit(Fn&& fn) const {
    switch (kind) {
      case int(ScoreModKind::kAlibi):
        fn(AlibiScoreMod{table});
        break;
      case int(ScoreModKind::kRelativeBias):
        fn(RelativeBiasScoreMod{table, width});
        break;
      default:
        fn(NoScoreMod{});
        break;
    }
  }
};

// Whether a mask_mod has the row_interval hook (the built-ins above but DocumentMaskMod; not the
// functors generated from Python callables).
template <class Mod, class = void>
struct HasRowInterval : std::false_type {};
template <class Mod>
struct HasRowInterval<Mod, std::void_t<decltype(std::declval<Mod const&>().row_interval(
                               0, std::declval<int&>(), std::declval<int&>()))>> : std::true_type {};

// Whether a mask_mod is an equality of a key per query and a key per key position (row_key /
// col_key, DocumentMaskMod).
template <class Mod, class = void>
struct HasKeyCompare : std::false_type {};
template <class Mod>
struct HasKeyCompare<Mod, std::void_t<decltype(std::declval<Mod const&>().row_key(0, 0)),
                                      decltype(std::declval<Mod const&>().col_key(0, 0))>> : std::true_type {};

// One built-in mask_mod, chosen at run time (MaskModKind value).
struct MaskModSwitch {
  int kind = 0;
  RowIntervalMaskMod interval;  // sliding window, prefix LM
  int const* ids = nullptr;     // document ids
  long long ids_stride = 0;

  static MaskModSwitch from(ModParams const& mod) {
    MaskModSwitch result;
    result.kind = mod.kind;
    // Causal needs no constants here: `visit` passes its own (RowIntervalMaskMod::causal()).
    switch (mod.kind) {
      case int(MaskModKind::kSlidingWindow):
        result.interval = RowIntervalMaskMod::sliding_window(ModParams::whole(mod.scalars[0]),
                                                             ModParams::whole(mod.scalars[1]));
        break;
      case int(MaskModKind::kPrefixLM):
        result.interval = RowIntervalMaskMod::prefix_lm(ModParams::whole(mod.scalars[0]));
        break;
      case int(MaskModKind::kDocument):
        result.ids = static_cast<int const*>(mod.aux[0]);
        result.ids_stride = mod.aux_cols[0];
        break;
      default:
        break;
    }
    return result;
  }

  template <class Fn>
  CUTLASS_DEVICE void visit(Fn&& fn) const {
    switch (kind) {
      // One case per kind, each with its constants, which fold away where `fn` is inlined into
      // each case (as in the flex kernels). One case for the three (the functor as it is) was
      // measured: no faster forward on block lists, backward hdim64 2-3% slower (bench/NOTES.md).
      case int(MaskModKind::kCausal):
        fn(RowIntervalMaskMod::causal());
        break;
      case int(MaskModKind::kSlidingWindow):
        fn(RowIntervalMaskMod::sliding_window(interval.left, interval.right));
        break;
      case int(MaskModKind::kPrefixLM):
        fn(RowIntervalMaskMod::prefix_lm(interval.prefix));
        break;
      case int(MaskModKind::kDocument):
        fn(DocumentMaskMod{ids, ids_stride});
        break;
      default:
        fn(NoMaskMod{});
        break;
    }
  }
};

}  // namespace cuflash::variants
