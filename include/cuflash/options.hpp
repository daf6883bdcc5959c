// Options of an attention call: every option of the seed interface (DESIGN.md section 2).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "cuflash/expression.hpp"
#include "cuflash/tensor.hpp"

namespace cuflash {

// Built-in score modifications (FlexAttention score_mod semantics: they see the
// scaled, soft-capped score s and return a new score).
enum class ScoreModKind : int {
  kNone = 0,
  // s + slopes[h] * (kv_idx - q_idx). aux[0]: slopes, fp32, shape (H,).
  kAlibi = 1,
  // s + table[h, clamp(kv_idx - q_idx, -R, R) + R]. aux[0]: table, fp32, shape (H, 2R+1).
  kRelativeBias = 2,
  // A program (cuflash/expression.hpp): `program` with its derivative register, float
  // constants in `scalars`, the tensors it reads in `aux`.
  kExpression = 100,
};

// Built-in mask modifications (FlexAttention mask_mod semantics: true keeps (q_idx, kv_idx)).
// A mask_mod intersects with causal / window / sequence-length masking.
enum class MaskModKind : int {
  kNone = 0,
  // kv_idx <= q_idx, top-left aligned as in FlexAttention (the `causal` option is bottom-right).
  kCausal = 1,
  // |q_idx - kv_idx| within scalars[0] (left) and scalars[1] (right), top-left aligned.
  kSlidingWindow = 2,
  // kv_idx <= q_idx or kv_idx < scalars[0] (the prefix length).
  kPrefixLM = 3,
  // doc[b, q_idx] == doc[b, kv_idx]. aux[0]: int32 document ids, shape (B, L) with
  // L >= max(seqlen_q, seqlen_k).
  kDocument = 4,
  // A program returning a bool (cuflash/expression.hpp): `program`, float constants in
  // `scalars`, the tensors it reads in `aux`. No block-level narrowing: every block is visited.
  kExpression = 100,
};

struct ScoreMod {
  ScoreModKind kind = ScoreModKind::kNone;
  std::vector<double> scalars;
  std::vector<TensorView> aux;
  ExprProgram program;  // kExpression only
};

struct MaskMod {
  MaskModKind kind = MaskModKind::kNone;
  std::vector<double> scalars;
  std::vector<TensorView> aux;
  ExprProgram program;  // kExpression only
};

// FlexAttention BlockMask tensors (int32). H_b is 1 (broadcast over heads) or H.
// Forward (row blocks):  *_cnt (B, H_b, ceil(Sq/block_m)),  *_idx (B, H_b, ceil(Sq/block_m), ceil(Sk/block_n)).
// Backward (column blocks, the transposed lists), `q_` prefix:
//                        q_*_cnt (B, H_b, ceil(Sk/block_n)), q_*_idx (B, H_b, ceil(Sk/block_n), ceil(Sq/block_m)).
// A block in a `full` list is computed without mask_mod, a block in a `mask` list with it,
// any other block is skipped. Causal / window / sequence-length masking always applies.
// Blocks are per sequence (positions from its start): with cu_seqlens, Sq / Sk are the longest
// sequence's (max_seqlen_q / max_seqlen_k, needed when cu_seqlens are in device memory); with a
// page table, Sk is max_pages * page_size.
struct BlockSparseTensors {
  std::optional<TensorView> mask_block_cnt, mask_block_idx;
  std::optional<TensorView> full_block_cnt, full_block_idx;
  std::optional<TensorView> q_mask_block_cnt, q_mask_block_idx;
  std::optional<TensorView> q_full_block_cnt, q_full_block_idx;
  int block_m = 128;
  int block_n = 128;
};

struct AttentionOptions {
  std::optional<float> softmax_scale;  // default 1/sqrt(head_dim)
  bool causal = false;                 // bottom-right aligned
  // Sliding window, bottom-right aligned; negative means unbounded on that side.
  int window_left = -1;
  int window_right = -1;
  float softcap = 0.0f;                // 0 disables
  ScoreMod score_mod;
  MaskMod mask_mod;
  std::optional<BlockSparseTensors> block_sparse;
  // Kernels compiled at run time for expression score_mod / mask_mod programs (Python callables,
  // python/cuflash/_jit.py): the addresses of `void(FwdParams*, cudaStream_t)` and
  // `void(BwdParams*, cudaStream_t)` launchers built from this version's kernel templates.
  // 0: none (expression programs then run on the CPU reference only).
  std::uintptr_t expression_forward_kernel = 0;
  std::uintptr_t expression_backward_kernel = 0;
};

// Sequence layout: dense (B, S, H, D) when cu_seqlens_* are absent, packed
// (total, H, D) with cu_seqlens_* (B+1, int32) otherwise. page_table switches k/v to
// (num_pages, page_size, H_kv, D) with page_table (B, max_pages) int32.
struct SequenceLayout {
  std::optional<TensorView> cu_seqlens_q, cu_seqlens_k;
  // (B,) int32: rows in use of each sequence, at most its length (its cu_seqlens segment,
  // the dense S, or max_pages * page_size).
  std::optional<TensorView> seqused_q, seqused_k;
  // With cu_seqlens_*: at least the longest segment of cu_seqlens_* (whatever seqused_* leaves
  // of it). The GPU kernels size their grids by them; read from host memory they are checked,
  // in device memory trusted (CUFLASH_CHECK_INPUTS=1 checks them). Absent: the longest segment
  // from host memory, else total rows (an upper bound): the forward and the backward then walk
  // lists of the blocks that hold rows, built on the GPU, and the forward's tile twins, the
  // default pack_gqa choice and the backward's dQ accumulator start read the mean length
  // (total / batch, rounded up).
  std::optional<std::int64_t> max_seqlen_q, max_seqlen_k;
  std::optional<TensorView> page_table;
};

// Outputs (out, lse, dq, dk, dv and combine's out, lse) may be padded or permuted, but no two
// of their elements may share memory: a zero stride on a dimension of size > 1, or strides
// under which dimensions overlap, are refused. Two outputs of one call must not share memory
// either (they are written at once); that is the caller's to keep, not checked (interleaved
// views of one buffer, such as the gradients of a packed qkv tensor, are fine).
struct ForwardArgs {
  TensorView q, k, v;
  TensorView out;                          // preallocated, q's dtype, (..., H, Dv)
  std::optional<TensorView> lse;           // fp32 (B, H, Sq) or (H, total_q); written when given
  std::optional<TensorView> learnable_sink;  // (H,), fp32 / bf16 / fp16
  SequenceLayout seq;
  AttentionOptions opts;
  int num_splits = 1;                      // <= 0: heuristic
  std::optional<bool> pack_gqa;            // default: when it fills the tiles better (short seqlen_q)
};

struct BackwardArgs {
  TensorView q, k, v, out, dout;
  TensorView lse;                          // fp32, from forward
  // fp32, lse's shape: the gradient that reaches lse when the caller uses it (return_lse). Since
  // d lse_i / d s_ij = P_ij, it adds dlse_i * P_ij to dS (and to d_sink through P_sink). None: 0.
  std::optional<TensorView> dlse;
  TensorView dq, dk, dv;                   // preallocated, shapes of q, k, v
  std::optional<TensorView> learnable_sink;
  std::optional<TensorView> d_sink;        // (H,) fp32; required when learnable_sink is given
  SequenceLayout seq;
  AttentionOptions opts;
  bool deterministic = false;
};

// Merges split-KV partial results by their log-sum-exp.
// out_partial: fp32 (splits, B, S, H, D) or (splits, total, H, D)
// lse_partial: fp32 (splits, B, S, H)    or (splits, total, H)
// out: (B, S, H, D) or (total, H, D), fp16 / bf16 / fp32;  lse: (B, S, H) or (total, H), fp32.
struct CombineArgs {
  TensorView out_partial, lse_partial;
  TensorView out;
  std::optional<TensorView> lse;
  std::optional<TensorView> cu_seqlens;  // (B+1,) int32, with the packed layout
  std::optional<TensorView> seqused;     // (B,) int32, each at most its sequence's rows
};

}  // namespace cuflash
