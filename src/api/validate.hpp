// Argument checks shared by validate(), dispatch and the parameter builders. Each check
// throws cuflash::Error naming the argument with the expected and the actual value.
#pragma once

#include <cstdint>

#include "cuflash/options.hpp"

namespace cuflash::detail {

// The problem size that an attention call's tensors describe, once they are checked.
struct AttentionShape {
  Device device;
  DType dtype = DType::kFloat32;
  bool varlen_q = false;  // q is packed (total_q, H, D) with cu_seqlens_q
  bool varlen_k = false;  // k/v are packed (total_k, H_kv, D) with cu_seqlens_k
  bool paged = false;     // k/v are pages (num_pages, page_size, H_kv, D) with page_table
  std::int64_t batch = 0;
  // Dense: the padded length. Packed: max_seqlen_* when given, else the exact maximum for CPU
  // tensors and total_* (an upper bound) for device tensors. Paged: max_pages * page_size.
  std::int64_t seqlen_q = 0;
  std::int64_t seqlen_k = 0;
  // seqlen_q / seqlen_k is the bound total_q / total_k rather than the longest sequence: packed
  // lengths in device memory without a max_seqlen hint.
  bool seqlen_q_is_bound = false;
  bool seqlen_k_is_bound = false;
  std::int64_t total_q = 0;  // rows of q (batch * seqlen_q when dense)
  std::int64_t total_k =
      0;  // rows of k (batch * seqlen_k when dense; pages * page_size when paged)
  std::int64_t num_heads = 0;
  std::int64_t num_heads_kv = 0;
  std::int64_t head_dim = 0;
  std::int64_t head_dim_v = 0;
  std::int64_t num_pages = 0;
  std::int64_t page_size = 0;
  std::int64_t max_pages = 0;  // page_table columns
};

struct CombineShape {
  Device device;
  bool varlen = false;  // (splits, total, H, D) layout
  std::int64_t num_splits = 0;
  std::int64_t batch = 0;   // cu_seqlens length - 1, or 1 when packed without cu_seqlens
  std::int64_t seqlen = 0;  // dense S, packed: total rows
  std::int64_t num_heads = 0;
  std::int64_t head_dim = 0;
};

AttentionShape check_forward(const ForwardArgs& args);
AttentionShape check_backward(const BackwardArgs& args);
CombineShape check_combine(const CombineArgs& args);

// The largest split count (num_splits, out_partial dimension 0) that combine handles.
constexpr int kMaxSplits = 256;

}  // namespace cuflash::detail
