// Tile configuration of the sm90 backward kernel: the one table that both the kernel
// templates (compile time) and the workspace sizing (run time) read.
#pragma once

namespace cuflash::sm90::bwd {

struct BwdTile {
  int block_m;          // rows of Q / dO per step
  int block_n;          // rows of K / V per CTA
  int num_mma_wg;       // MMA warpgroups (plus one producer warpgroup)
  int stages_do;        // dO pipeline stages (Q always has 2)
  int stages_ds;        // P / dS smem buffers: 1 or 2
  bool sdp_swap_ab;     // compute S^T and dP^T (keys on the MMA M side)
  bool dkv_swap_ab;     // compute dK^T and dV^T
  bool dq_swap_ab;      // compute dQ^T
  int atom_m_sdp;       // warpgroups along the M side of the S / dP MMA
  int atom_n_dkv;       // warpgroups along the N side of the dK / dV MMA
  int atom_m_dq;        // warpgroups along the M side of the dQ MMA
};

// head_dim / head_dim_v are the padded compile-time head dims of an instantiation
// (64, 96, 128, 192, 256, or 192 with head_dim_v 128). `window` covers causal and local;
// `score_grad`: the kernel multiplies dS by a per-element derivative (softcap's, or a score_mod's
// that is not 1), which keeps one more value per accumulator element live. `flex`: the kernel
// with score_mod / mask_mod / block sparsity (more state live in the mainloop). `block_lists`:
// the flex kernel for calls with block lists, whose column blocks must divide the BlockMask's.
constexpr BwdTile bwd_tile(int head_dim, int head_dim_v, bool window, bool score_grad, bool flex = false,
                           bool block_lists = false) {
  // S^T tiles let dV / dK take P^T / dS^T from registers, which keeps P out of smem.
  if (head_dim <= 64) {
    // 128 x 128 spills 460-950 bytes with a score derivative (ptxas, CUDA 13.0): those kernels
    // take hdim 96's 64-row tile.
    if (score_grad) return {64, 128, 2, 2, 2, true, false, false, 1, 2, 1};
    return {128, 128, 2, 2, 2, true, false, false, 1, 2, 2};
  }
  if (head_dim <= 96) return {64, 128, 2, 2, 2, true, false, false, 1, 2, 1};
  if (head_dim <= 128) {
    // 80-row tiles only fit the register budget without the mask / softcap temporaries;
    // their M extent is not a multiple of 64, so the dQ MMA runs transposed.
    bool const wide = !window && !score_grad;
    return {wide ? 80 : 64, 128, 2, 2, 2, true, false, wide, 1, 2, 1};
  }
  if (head_dim <= 192) {
    // With block lists the flex kernel takes 64-key column blocks so that a BlockMask's 128-key
    // blocks (the default, and what the Python block lists use) are whole column blocks; 96
    // keys would straddle them. Two warpgroups split the head dim of dK, dV and dQ (m64n96, or
    // m64n64 for dV at 192 x 128), unswapped, and P / dS go through shared memory (two
    // buffers). 8-15% slower than the 96-key tile with a mask_mod alone (bench/NOTES.md), so
    // calls without block lists keep that one.
    if (flex && block_lists) return {64, 64, 2, 1, 2, false, false, false, 1, 1, 1};
    if (head_dim_v == head_dim) return {64, 96, 3, 1, 1, false, true, false, 1, 1, 1};
    // 192 x 128: three warpgroups cannot split the 128-wide dV^T, so two do all of it.
    return {64, 96, 2, 1, 1, false, true, false, 1, 2, 1};
  }
  // The flex kernel does not fit the sliced 64 x 80 tile below in 240 registers (ptxas, CUDA 13.0:
  // 20 bytes of spills in the mainloop, 106 with softcap); it takes 64-wide column blocks with the
  // warpgroups splitting the head dim of dK^T / dV^T (m64n64 WGMMAs) and dQ unswapped (64 x 128
  // per warpgroup, m64n128), two P / dS buffers (199 KB of smem): 0 bytes of spills.
  if (flex) return {64, 64, 2, 1, 2, false, true, false, 1, 1, 1};
  // FlashAttention-3's hdim256 tile: 64 x 80, dK^T / dV^T and dQ^T (swapped), the two warpgroups
  // splitting the head dim of all three (atom_n_dkv 1, atom_m_dq 1), one dO / P / dS stage.
  // dK^T / dV^T take 80 + 80 registers per thread; the mainloop runs the dV, dQ and dK MMAs in two
  // halves of the head dim (kSliceDQKV) so that only 32 of dQ^T's 64 are live at a time, each
  // half's dQ stored (bulk path) or added by atomics while the other MMAs run. Unsliced this
  // tile spilled 336 bytes (ptxas, CUDA 13.0); sliced, with the kernel re-deriving the block
  // coordinates per role, none in the causal / local variants and 4 bytes in the two without a
  // window (up to R237 with softcap), no serialized WGMMAs. 58 WGMMAs per warpgroup and step
  // (16 + 16 m64n40 S / dP, 8 + 8 m64n80 dV / dK, 10 m64n64 dQ).
  return {64, 80, 2, 1, 1, false, true, true, 1, 1, 1};
}

// Rows of one head's slice of the fp32 workspaces (lse_log2, dpsum, dq_accum): each batch
// starts on a block boundary so that blocks of different sequences never share a chunk.
constexpr long long padded_rows(long long total_rows, int batch, int max_seqlen, int block, bool varlen) {
  return varlen ? (total_rows + static_cast<long long>(batch) * block) / block * block
                : static_cast<long long>(batch) * ((max_seqlen + block - 1) / block * block);
}

// The workspace row block of a batch's row block m_block: the index of its dq_accum chunk and of
// its first-writer tickets in a head's padded rows, where the batch's rows start at offset_padded
// (a multiple of `block`). The preprocess, the main kernel and the postprocess all index by it.
constexpr long long workspace_row_block(int head, int rows_padded, int offset_padded, int block, int m_block) {
  return (static_cast<long long>(head) * rows_padded + offset_padded) / block + m_block;
}

}  // namespace cuflash::sm90::bwd
