// Visibility of (query i, key j) in the reference: sequence lengths, causal / window
// (bottom-right aligned), the built-in mask_mods (top-left aligned) and block sparsity.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "cuflash/options.hpp"
#include "reference/expression.hpp"
#include "reference/sequence.hpp"

namespace cuflash::reference {

enum class BlockState : std::uint8_t { kSkip = 0, kMasked = 1, kFull = 2 };

class Mask;

// The visibility predicate of one (batch, head); i and j are positions within the sequence.
class HeadMask {
 public:
  bool visible(std::int64_t i, std::int64_t j) const;
  int batch() const { return batch_; }

  std::int64_t seqlen_q = 0;  // used lengths of this batch entry
  std::int64_t seqlen_k = 0;

 private:
  friend class Mask;
  const Mask* mask_ = nullptr;
  int batch_ = 0;
  int head_ = 0;
  // Block sparsity: state of (row block, column block), row-major; empty when off.
  std::vector<BlockState> blocks_;
  std::int64_t row_blocks_ = 0, col_blocks_ = 0;
};

class Mask {
 public:
  // In the backward pass block sparsity comes from the column-block (q_*) lists when they are
  // given, as on the GPU; otherwise from the forward lists.
  Mask(const AttentionOptions& opts, const Sequences& seqs, bool backward);

  HeadMask head(int b, int h) const;

 private:
  friend class HeadMask;
  bool mask_mod_keeps(int b, int h, std::int64_t i, std::int64_t j) const;

  const Sequences& seqs_;
  std::optional<std::int64_t> window_left_, window_right_;
  MaskModKind mask_mod_;
  std::vector<double> scalars_;
  TensorView documents_;
  ExpressionEvaluator expression_;  // kExpression
  // Block lists in use; `transposed`: lists are per column block (the backward q_* lists).
  bool block_sparse_ = false;
  bool transposed_ = false;
  std::optional<TensorView> mask_cnt_, mask_idx_, full_cnt_, full_idx_;
  std::int64_t block_m_ = 128, block_n_ = 128;
};

}  // namespace cuflash::reference
