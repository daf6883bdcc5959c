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
  // Head dim 64: exp2 throughput is close to the tensor cores', so three MMA warpgroups
  // (kBlockM 192) give the softmax of two of them the GEMMs of the third to hide under, and
  // each K/V stage serves 192 rows. Their consumers get 160 registers (the launch's 512 x 128
  // less the producer's), which holds S and P of a 64 x 128 block and O, not a wider n-block.
  if (head_dim <= 64) return {192, 128, 2};
  if (head_dim <= 96) return {128, 160, 2};
  if (head_dim <= 128) return {128, 128, 2};
  if (head_dim <= 192)
    return head_dim_v <= 128 ? FwdTileSize{128, 128, 2} : FwdTileSize{128, 112, 2};
  return {128, 80, 2};
}

// The flex kernel (score_mod / mask_mod / block sparsity) uses kBlockN 128 or 64 so that a
// FlexAttention block (128 x 128 by default, multiples of 64 in practice) is a whole number of
// kernel blocks: the largest of the two that is not above the plain tile's.
// Softcap kernels keep two MMA warpgroups at head dim 64: their masking on top of tanh does not
// fit the 160 registers of three (ptxas spills 24 bytes).
constexpr FwdTileSize fwd_tile_size(int head_dim, int head_dim_v, bool flex, bool softcap = false) {
  FwdTileSize tile = fwd_tile_size(head_dim, head_dim_v);
  if (softcap && head_dim <= 64) tile = {128, 192, 2};
  if (flex) {
    // 128 rows too: a BlockMask row block must hold whole kernel tiles.
    tile.block_m = 128;
    tile.block_n = tile.block_n >= 128 ? 128 : 64;
  }
  return tile;
}

}  // namespace cuflash::sm90
