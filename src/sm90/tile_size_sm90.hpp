// Forward tile sizes for Hopper, per head dimension (DESIGN.md section 9 is the starting point).
// Shared memory bounds kBlockN at large head dims: Q + kStages * (K + V) must fit in 227 KB,
// and O reuses Q's buffer.
#pragma once

namespace cuflash::sm90 {

struct FwdTileSize {
  int block_m;  // rows of Q per CTA: 64 per MMA warpgroup
  int block_n;  // rows of K/V per pipeline stage
  int stages;   // K/V pipeline depth
};

constexpr FwdTileSize fwd_tile_size(int head_dim, int head_dim_v) {
  // Two MMA warpgroups everywhere: with three (kBlockM 192) the 512-thread launch caps
  // registers at 128 before setmaxnreg and the consumers spill.
  if (head_dim <= 64) return {128, 192, 2};
  if (head_dim <= 96) return {128, 160, 2};
  if (head_dim <= 128) return {128, 128, 2};
  if (head_dim <= 192)
    return head_dim_v <= 128 ? FwdTileSize{128, 128, 2} : FwdTileSize{128, 112, 2};
  return {128, 80, 2};
}

// The flex kernel (score_mod / mask_mod / block sparsity) uses kBlockN 128 or 64 so that a
// FlexAttention block (128 x 128 by default, multiples of 64 in practice) is a whole number of
// kernel blocks: the largest of the two that is not above the plain tile's.
constexpr FwdTileSize fwd_tile_size(int head_dim, int head_dim_v, bool flex) {
  FwdTileSize tile = fwd_tile_size(head_dim, head_dim_v);
  if (flex) tile.block_n = tile.block_n >= 128 ? 128 : 64;
  return tile;
}

}  // namespace cuflash::sm90
