// Variant policies of the forward and backward kernels (DESIGN.md section 3): a compile-time type
// that says which optional features the kernel contains, with the runtime Params those features
// read. NoVariant is the plain kernel: its code has none of the hooks below. FlexVariant carries
// the built-in score_mod and mask_mod (chosen at run time inside the functors, builtin_mods.hpp)
// and FlexAttention block sparsity; with it the kernel keeps final scores in its accumulators
// (scaled, soft-capped and modified) rather than folding the scale into the exponent.
#pragma once

#include "api/params.hpp"
#include "variants/builtin_mods.hpp"

namespace cuflash::variants {

struct NoVariant {
  static constexpr bool kIsFlex = false;
  static constexpr bool kUnitScoreGrad = true;  // d score / d s = 1 (backward)
  static constexpr bool kBlockListTile = false;  // see BlockListTileOf
  struct Params {};
  static Params to_params(FwdParams const&) { return {}; }
};

// ScoreSwitch / MaskSwitch: what the kernels `visit` for the score_mod and the mask_mod (the
// built-ins chosen at run time, ScoreModSwitch / MaskModSwitch, or functors generated from
// Python callables, python/cuflash/_codegen.py), each with `from(ModParams)`; ScoreSwitch also
// says whether d score / d s is 1 (kUnitGrad).
template <class ScoreSwitch, class MaskSwitch>
struct FlexVariantOf {
  static constexpr bool kIsFlex = true;
  static constexpr bool kUnitScoreGrad = ScoreSwitch::kUnitGrad;
  static constexpr bool kBlockListTile = false;  // see BlockListTileOf
  struct Params {
    ScoreSwitch score_mod;
    MaskSwitch mask_mod;
    // Score = score_scale * tanh(raw * tanh_scale) with softcap (score_scale = softcap), else
    // score_scale * raw; raw = <q, k>.
    float score_scale;
    float tanh_scale;  // softmax_scale / softcap; 0 without softcap
    BlockSparseParams block_sparse;
  };

  // From FwdParams or BwdParams (the backward's block lists are the transposed ones).
  template <class CallParams>
  static Params to_params(CallParams const& p) {
    bool const has_softcap = p.softcap > 0.f;
    return {ScoreSwitch::from(p.score_mod), MaskSwitch::from(p.mask_mod),
            has_softcap ? p.softcap : p.softmax_scale,
            has_softcap ? p.softmax_scale / p.softcap : 0.f, p.block_sparse};
  }
};

// The flex kernels built with the library: the built-in mods.
using FlexVariant = FlexVariantOf<ScoreModSwitch, MaskModSwitch>;

// The same mods in the backward kernel whose column blocks are whole parts of a BlockMask's
// 128-key blocks, for calls with block lists where the faster tile's are not (head dims
// 129-192, bwd::bwd_tile).
template <class Variant>
struct BlockListTileOf : Variant {
  static constexpr bool kBlockListTile = true;
};

}  // namespace cuflash::variants
