// Forward tile sizes for Hopper, per head dimension (DESIGN.md section 9 is the starting point).
// Shared memory bounds kBlockN at large head dims: Q + kStages * (K + V) must fit in 227 KB,
// and O reuses Q's buffer.
#pragma once

#include "api/params.hpp"

namespace cuflash::sm90 {

// The hdim128 key block, a build switch for A/Bs of the tile (host and device must agree: set it
// through CUFLASH_AB_DEFINES, as tools/gpu_ab.sh does). 160 and 176 leave no room for the second
// Q buffer; measured at 160 (bench/NOTES.md, "The hdim128 key block"), equal to 128 with one Q
// buffer non-causal and 2% slower causal at 2k, so 128 with two Q buffers stays.
#ifndef CUFLASH_FWD_HDIM128_BLOCK_N
#define CUFLASH_FWD_HDIM128_BLOCK_N 128
#endif
// Its K / V pipeline depth, a build switch of the same kind: three stages fit beside two Q
// buffers and O's own buffer at up to 80-key blocks (3 x 40 + 64 + 32 KB). Measured at 80 keys
// with three stages (bench/NOTES.md, "the lagged pingpong probe"): 6-10% below 128 keys with two.
#ifndef CUFLASH_FWD_HDIM128_STAGES
#define CUFLASH_FWD_HDIM128_STAGES 2
#endif

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
  if (head_dim <= 128) return {128, CUFLASH_FWD_HDIM128_BLOCK_N, CUFLASH_FWD_HDIM128_STAGES};
  if (head_dim <= 192)
    return head_dim_v <= 128 ? FwdTileSize{128, 128, 2} : FwdTileSize{128, 112, 2};
  return {128, 80, 2};
}

// The flex kernel (score_mod / mask_mod / block sparsity) uses kBlockN 128 or 64 so that a
// FlexAttention block (128 x 128 by default, multiples of 64 in practice) is a whole number of
// kernel blocks: the largest of the two that is not above the plain tile's.
// Softcap kernels keep two MMA warpgroups at head dim 64: their masking on top of tanh does not
// fit the 160 registers of three (ptxas spills 24 bytes).
// `narrow`: the plain hdim64 kernel's second tile, 128 x 128 on two MMA warpgroups, for short
// sequences, where 192-row tiles pad the last block and (causal) compute more of the diagonal.
constexpr FwdTileSize fwd_tile_size(int head_dim, int head_dim_v, bool flex, bool softcap = false,
                                    bool narrow = false) {
  FwdTileSize tile = fwd_tile_size(head_dim, head_dim_v);
  if (narrow && head_dim <= 64) tile = {128, 128, 2};
  if (softcap && head_dim <= 64) tile = {128, 192, 2};
  if (flex) {
    // 128 rows too: a BlockMask row block must hold whole kernel tiles.
    tile.block_m = 128;
    tile.block_n = tile.block_n >= 128 ? 128 : 64;
  }
  return tile;
}

// Whether the hdim128 kernels that issue the next tile's first Q K^T under the epilogue (two Q
// buffers) should, rather than their one-Q twin, for keys seqlen_k and a window (< 0: unbounded):
// when a tile visits more than 8 128-key n-blocks. Measured on the H200 (bf16, 16k tokens, both
// kernels in one call, bench/NOTES.md "the one-Q twin, measured"): against the twin, 512 keys
// (4 n-blocks) -3% non-causal and -4% causal, 1k (8) -0.2% and -0.9%, 2k +0.3%; against the
// kernel before it, 2k-16k +1-2%. A window bounded on both sides caps a tile's keys at the
// window plus its 128 rows.
inline bool fwd_next_qk_pays(int seqlen_k, int window_left, int window_right) {
  constexpr FwdTileSize kTile = fwd_tile_size(128, 128);
  constexpr int kMinBlocks = 9;
  long long keys = seqlen_k;
  if (window_left >= 0 && window_right >= 0) {
    long long const span = (long long)window_left + window_right + kTile.block_m;
    keys = span < keys ? span : keys;
  }
  return (keys + kTile.block_n - 1) / kTile.block_n >= kMinBlocks;
}

// Whether the plain hdim64 kernel should run its 128-row tile rather than the 192-row one for a
// problem of seqlen_q x seqlen_k rows and keys with a window (< 0: unbounded; causal is
// window_right 0, bottom-right aligned). Cost model: the MMA area a tile computes, block_m x
// (its 128-key n-blocks + 1 for the tile's fixed cost: first QK^T, last PV, epilogue), summed
// over the m-blocks of one head, with two warpgroups' n-block taken as kNarrowCost of three's
// (the three-warpgroup tile hides more of the softmax under the GEMMs). Dense lengths only; for
// packed sequences the longest stands for all. kNarrowCost is measured: on the H200 (bf16, 16k
// tokens, 512-8k, causal and not) the time ratio over the area ratio was 1.14-1.21 at every
// point (bench/NOTES.md, "hdim64 narrow tile, calibrated"); with 1.16 the model picks the
// measured winner at all ten. So only the causal diagonal at <= 1k, narrow windows and decoding
// take the narrow tile: the eighth of padding 192 rows waste at 512 / 1k is less than the cost.
inline bool fwd_narrow_tile_pays(int seqlen_q, int seqlen_k, int window_left, int window_right) {
  constexpr double kNarrowCost = 1.16;
  constexpr int kBlockN = 128;
  auto area = [&](int block_m) {
    long long total = 0;
    long long const offset = (long long)seqlen_k - seqlen_q;  // bottom-right alignment
    for (long long m0 = 0; m0 < seqlen_q; m0 += block_m) {
      long long const m1 = m0 + block_m;  // one past the tile's last row
      long long hi = window_right < 0 ? seqlen_k : m1 + offset + window_right;
      long long lo = window_left < 0 ? 0 : m0 + offset - window_left;
      hi = hi < seqlen_k ? hi : seqlen_k;
      lo = lo > 0 ? lo : 0;
      long long const blocks = hi > lo ? (hi + kBlockN - 1) / kBlockN - lo / kBlockN : 0;
      total += (long long)block_m * (blocks + 1);
    }
    return double(total);
  };
  return area(128) * kNarrowCost < area(192);
}

// Whether a kernel with a twin for short work runs the twin: `choice` is FwdParams::short_kernel
// (kLong / kShort forced), `pays()` the twin's rule for the call, asked only under kAuto.
template <class Pays>
bool fwd_short_kernel_runs(FwdShortKernel choice, Pays const& pays) {
  return choice == FwdShortKernel::kAuto ? pays() : choice == FwdShortKernel::kShort;
}

// Whether the plain (not softcap) hdim64 kernel runs its 128-row tile for a call. The launch and
// dispatch's stream-K count both ask this.
inline bool fwd_plain_narrow_tile(FwdShortKernel choice, int seqlen_q, int seqlen_k, int window_left,
                                  int window_right) {
  return fwd_short_kernel_runs(choice, [&] { return fwd_narrow_tile_pays(seqlen_q, seqlen_k, window_left, window_right); });
}

// Whether an hdim128 kernel that issues the next tile's first Q K^T under the epilogue runs its
// one-Q twin for a call.
inline bool fwd_single_q_kernel(FwdShortKernel choice, int seqlen_k, int window_left, int window_right) {
  return fwd_short_kernel_runs(choice, [&] { return !fwd_next_qk_pays(seqlen_k, window_left, window_right); });
}

// A tile's cost beyond its n-blocks, in n-blocks: the first Q K^T and softmax with no P V beside
// them, the last P V, the epilogue. Fitted to the measured throughput over sequence length
// (bench/NOTES.md): about 1.7 at hdim 128, 3.2 at hdim 256.
constexpr double fwd_tile_fixed_cost(int head_dim) { return head_dim <= 128 ? 1.7 : 3.2; }

// Whether the plain kernel of this tile has the stream-K tail (FlashFwdKernelSm90::kStreamKTail):
// two MMA warpgroups and O in a buffer of its own (head dims up to 128). Where O shares Q's
// buffer (hdim 192 / 256) and in the three-warpgroup hdim64 tile, the merge's registers spill
// (ptxas: 328 bytes at hdim256, 208 at hdim64).
constexpr bool fwd_stream_k_tile(FwdTileSize tile, int head_dim, int head_dim_v) {
  return tile.block_m == 128 && head_dim <= 128 && head_dim_v <= 128;
}

// The stream-K tail of the forward's static schedule (stream_k_sm90.hpp): with num_tiles tiles
// of n_blocks n-blocks each on `grid` CTAs, the last (num_tiles mod grid) tiles are cut into one
// range of n-blocks per CTA, run by a second kernel. Returns how many CTAs share them, or 0 where
// the cut does not pay.
// Cost model, in n-blocks: a whole tile in the last wave costs n_blocks + fixed; a CTA's share
// costs its n-blocks plus the fixed cost of each piece it touches (at worst one more than its
// share spans) plus a quarter n-block per other piece its merge reads. Cut when the share costs
// under 0.9 of a whole tile and saves more than kOverhead n-blocks: the second kernel, its
// workspace and the merges cost about that much at hdim128 on the H200 (measured: the cut lost
// 3.7% / 0.5% at 2k / 4k keys, where this model saves 5 / 13 n-blocks, and gained 0.6% / 3.6% at
// 8k / 16k, where it saves 29 / 60; bench/NOTES.md). Shares are at least two n-blocks: a piece of
// one is mostly fixed cost.
// always: cut whenever more CTAs than tail tiles can share the tail, whatever the model says
// (tests, timing).
inline int stream_k_tail_ctas(long long num_tiles, int n_blocks, int grid, double fixed_cost,
                              bool always = false) {
  if (grid < 2 || n_blocks < 2 || num_tiles < 1) return 0;
  long long const tail_tiles = num_tiles % grid;
  if (tail_tiles == 0) return 0;
  long long const units = tail_tiles * n_blocks;
  constexpr int kMinUnits = 2;
  long long const sk_ctas = units / kMinUnits < grid ? units / kMinUnits : grid;
  if (sk_ctas <= tail_tiles) return 0;
  if (always) return int(sk_ctas);
  long long const per_cta = (units + sk_ctas - 1) / sk_ctas;
  long long const pieces_per_cta = (per_cta + n_blocks - 1) / n_blocks + 1;
  long long const pieces_per_tile = (n_blocks + per_cta - 1) / per_cta + 1;
  double const whole = n_blocks + fixed_cost;
  double const cut = double(per_cta) + fixed_cost * double(pieces_per_cta) + 0.25 * double(pieces_per_tile - 1);
  constexpr double kOverhead = 16;
  return cut < 0.9 * whole && whole - cut > kOverhead ? int(sk_ctas) : 0;
}

}  // namespace cuflash::sm90
