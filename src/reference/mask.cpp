#include "reference/mask.hpp"

#include <algorithm>
#include <string>

#include "cuflash/error.hpp"
#include "reference/numeric.hpp"

namespace cuflash::reference {
namespace {

void require(bool condition, const char* argument, const std::string& message) {
  if (!condition) throw Error(Error::Kind::kInvalidArgument, argument, message);
}

// Marks the blocks named by one (count, indices) list; `outer` is the block whose list it is.
void mark_blocks(const TensorView& cnt, const TensorView& idx, int b, std::int64_t head,
                 std::int64_t outer, BlockState state, bool transposed, std::int64_t row_blocks,
                 std::int64_t col_blocks, std::vector<BlockState>& blocks) {
  if (outer >= cnt.shape[2]) return;
  const std::int64_t count =
      std::clamp<std::int64_t>(load_int(cnt, offset_of(cnt, {b, head, outer})), 0, idx.shape[3]);
  const std::int64_t inner_blocks = transposed ? row_blocks : col_blocks;
  for (std::int64_t e = 0; e < count; ++e) {
    const std::int64_t inner = load_int(idx, offset_of(idx, {b, head, outer, e}));
    if (inner < 0 || inner >= inner_blocks) continue;
    const std::int64_t row = transposed ? inner : outer;
    const std::int64_t col = transposed ? outer : inner;
    BlockState& slot = blocks[row * col_blocks + col];
    // A block in both lists counts as full: the lists are meant to be disjoint.
    if (slot != BlockState::kFull) slot = state;
  }
}

}  // namespace

Mask::Mask(const AttentionOptions& opts, const Sequences& seqs, bool backward)
    : seqs_(seqs), mask_mod_(opts.mask_mod.kind), scalars_(opts.mask_mod.scalars) {
  if (opts.window_left >= 0) window_left_ = opts.window_left;
  if (opts.causal) {
    window_right_ = 0;
  } else if (opts.window_right >= 0) {
    window_right_ = opts.window_right;
  }

  switch (mask_mod_) {
    case MaskModKind::kNone:
    case MaskModKind::kCausal:
      break;
    case MaskModKind::kSlidingWindow:
      require(scalars_.size() >= 2, "mask_mod.scalars", "sliding_window needs (left, right)");
      break;
    case MaskModKind::kPrefixLM:
      require(!scalars_.empty(), "mask_mod.scalars", "prefix_lm needs the prefix length");
      break;
    case MaskModKind::kDocument: {
      require(!opts.mask_mod.aux.empty(), "mask_mod.aux", "document needs aux[0] (B, L) ids");
      documents_ = opts.mask_mod.aux[0];
      const std::int64_t needed = std::max(seqs.q.max_length(), seqs.k.max_length());
      require(documents_.ndim == 2 && documents_.shape[0] >= seqs.batch &&
                  documents_.shape[1] >= needed,
              "mask_mod.aux[0]",
              "document ids must be (B, L) with L >= max(seqlen_q, seqlen_k) = " +
                  std::to_string(needed) + ", got " + documents_.shape_string());
      break;
    }
    case MaskModKind::kExpression:
      expression_ = ExpressionEvaluator(opts.mask_mod.program, opts.mask_mod.scalars,
                                        opts.mask_mod.aux, "mask_mod");
      break;
  }

  if (!opts.block_sparse) return;
  const BlockSparseTensors& bs = opts.block_sparse.value();
  block_m_ = bs.block_m;
  block_n_ = bs.block_n;
  const bool has_bwd_lists = bs.q_mask_block_cnt || bs.q_full_block_cnt;
  const bool has_fwd_lists = bs.mask_block_cnt || bs.full_block_cnt;
  if (backward && has_bwd_lists) {
    transposed_ = true;
    mask_cnt_ = bs.q_mask_block_cnt;
    mask_idx_ = bs.q_mask_block_idx;
    full_cnt_ = bs.q_full_block_cnt;
    full_idx_ = bs.q_full_block_idx;
  } else if (has_fwd_lists) {
    mask_cnt_ = bs.mask_block_cnt;
    mask_idx_ = bs.mask_block_idx;
    full_cnt_ = bs.full_block_cnt;
    full_idx_ = bs.full_block_idx;
  } else {
    return;
  }
  block_sparse_ = true;
  require(block_m_ > 0 && block_n_ > 0, "block_sparse", "block sizes must be positive");
  require(mask_cnt_.has_value() == mask_idx_.has_value(), "block_sparse.mask_block_idx",
          "mask block counts and indices come together");
  require(full_cnt_.has_value() == full_idx_.has_value(), "block_sparse.full_block_idx",
          "full block counts and indices come together");
}

HeadMask Mask::head(int b, int h) const {
  HeadMask result;
  result.mask_ = this;
  result.batch_ = b;
  result.head_ = h;
  result.seqlen_q = seqs_.q.length[b];
  result.seqlen_k = seqs_.k.length[b];
  if (!block_sparse_) return result;

  const TensorView& any_idx = mask_idx_ ? *mask_idx_ : *full_idx_;
  // Forward lists are per row block, listing column blocks; backward lists the transpose.
  const std::int64_t outer_blocks = any_idx.shape[2];
  const std::int64_t inner_blocks = any_idx.shape[3];
  result.row_blocks_ = transposed_ ? inner_blocks : outer_blocks;
  result.col_blocks_ = transposed_ ? outer_blocks : inner_blocks;
  result.blocks_.assign(result.row_blocks_ * result.col_blocks_, BlockState::kSkip);
  const std::int64_t head = any_idx.shape[1] == 1 ? 0 : h;
  for (std::int64_t outer = 0; outer < outer_blocks; ++outer) {
    if (full_cnt_) {
      mark_blocks(*full_cnt_, *full_idx_, b, head, outer, BlockState::kFull, transposed_,
                  result.row_blocks_, result.col_blocks_, result.blocks_);
    }
    if (mask_cnt_) {
      mark_blocks(*mask_cnt_, *mask_idx_, b, head, outer, BlockState::kMasked, transposed_,
                  result.row_blocks_, result.col_blocks_, result.blocks_);
    }
  }
  return result;
}

bool Mask::mask_mod_keeps(int b, int h, std::int64_t i, std::int64_t j) const {
  switch (mask_mod_) {
    case MaskModKind::kNone:
      return true;
    case MaskModKind::kCausal:
      return j <= i;
    case MaskModKind::kSlidingWindow: {
      // A negative bound leaves that side open, as for the window option.
      const double left = scalars_[0], right = scalars_[1];
      return (left < 0 || static_cast<double>(i - j) <= left) &&
             (right < 0 || static_cast<double>(j - i) <= right);
    }
    case MaskModKind::kPrefixLM:
      return j <= i || static_cast<double>(j) < scalars_[0];
    case MaskModKind::kDocument:
      return load_int(documents_, offset_of(documents_, {b, i})) ==
             load_int(documents_, offset_of(documents_, {b, j}));
    case MaskModKind::kExpression:
      return expression_(0.0, b, h, i, j) != 0.0;
  }
  return true;
}

bool HeadMask::visible(std::int64_t i, std::int64_t j) const {
  if (i < 0 || i >= seqlen_q || j < 0 || j >= seqlen_k) return false;
  // Bottom-right alignment: the last query sees the last key.
  const std::int64_t diagonal = i + seqlen_k - seqlen_q;
  if (mask_->window_left_ && j < diagonal - *mask_->window_left_) return false;
  if (mask_->window_right_ && j > diagonal + *mask_->window_right_) return false;
  bool apply_mask_mod = true;
  if (mask_->block_sparse_) {
    const std::int64_t row = i / mask_->block_m_, col = j / mask_->block_n_;
    if (row >= row_blocks_ || col >= col_blocks_) return false;
    const BlockState state = blocks_[row * col_blocks_ + col];
    if (state == BlockState::kSkip) return false;
    apply_mask_mod = state == BlockState::kMasked;
  }
  return !apply_mask_mod || mask_->mask_mod_keeps(batch_, head_, i, j);
}

}  // namespace cuflash::reference
