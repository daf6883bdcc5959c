#include "api/params_builder.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>

#include "api/workspace_layout.hpp"
#include "sm90/tile_size_sm90.hpp"
#include "cuflash/cuflash.hpp"
#include "cuflash/error.hpp"

namespace cuflash::detail {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
template <typename T>
const T* data_of(const std::optional<TensorView>& t) {
  return t ? static_cast<const T*>(t->data) : nullptr;
}

// Batch, row and head strides of a (B, S, H, D) or packed (total, H, D) tensor; paged k/v
// (pages, page_size, H, D) report the page stride as the batch stride.
struct RowStrides {
  std::int64_t batch = 0, row = 0, head = 0;
};

// A dimension of size 0 or 1 is never stepped over, so its stride is free (DLPack exporters
// may give it any value, 1 for instance); it becomes 8 elements (16 bytes of 16-bit data), which
// TMA descriptors and the kernels' alignment checks accept, as for any stepped stride.
constexpr std::int64_t kUnsteppedStride = 8;

std::int64_t stepped_stride(const TensorView& t, int dim) {
  return t.shape[dim] > 1 ? t.stride[dim] : kUnsteppedStride;
}

RowStrides row_strides(const TensorView& t) {
  if (t.numel() == 0) {
    // No element is read: the strides of a contiguous tensor with every empty dimension taken as
    // one (what an empty tensor reports may be anything, 0 from NumPy), which the TMA descriptors
    // and the kernels' checks accept.
    auto extent = [&](int dim) { return std::max<std::int64_t>(t.shape[dim], 1); };
    const int d = t.ndim - 1;
    const std::int64_t head = t.shape[d], row = extent(d - 1) * head;
    return t.ndim == 4 ? RowStrides{extent(1) * row, row, head} : RowStrides{0, row, head};
  }
  if (t.ndim == 4) return {stepped_stride(t, 0), stepped_stride(t, 1), stepped_stride(t, 2)};
  return {0, stepped_stride(t, 0), stepped_stride(t, 1)};
}

// lse: (B, H, Sq) or packed (H, total_q); the row stride is 1.
RowStrides lse_strides(const TensorView& lse) {
  if (lse.ndim == 3) return {lse.stride[0], 1, lse.stride[1]};
  return {0, 1, lse.stride[0]};
}

// The kernels hold mod scalars as float32, exact for whole numbers up to 2^24. A sliding_window
// side or prefix_lm length at or past every row and key (`reach`) keeps or hides the same keys as
// 2^30 (unbounded in ModParams::whole), which it becomes; one below the reach and above 2^24
// (sequences longer than 16M tokens) would be rounded, and is refused (as is any above 2^24
// where the sequences reach past 2^30, which would no longer mean unbounded).
std::vector<double> exact_mask_scalars(const MaskMod& mod, std::int64_t reach) {
  std::vector<double> scalars = mod.scalars;
  if (mod.kind != MaskModKind::kSlidingWindow && mod.kind != MaskModKind::kPrefixLM) return scalars;
  for (std::size_t i = 0; i < scalars.size(); ++i) {
    if (scalars[i] >= static_cast<double>(reach) && reach <= (std::int64_t{1} << 30)) {
      scalars[i] = static_cast<double>(1 << 30);
    } else if (scalars[i] > static_cast<double>(1 << 24)) {
      const std::string argument = "mask_mod.scalars[" + std::to_string(i) + "]";
      throw Error(Error::Kind::kNotSupported, argument,
                  argument + ": " + std::to_string(std::int64_t(scalars[i])) +
                      " is past 2^24, where the GPU kernels' float32 scalars are no longer exact, for "
                      "sequences of up to " + std::to_string(reach) +
                      " tokens (a side at or past them is unbounded only up to 2^30 tokens)");
    }
  }
  return scalars;
}

ModParams make_mod_params(int kind, const std::vector<double>& scalars,
                          const std::vector<TensorView>& aux) {
  ModParams mod;
  mod.kind = kind;
  mod.num_scalars = static_cast<int>(
      std::min<std::size_t>(scalars.size(), ModParams::kMaxScalars));
  for (int i = 0; i < mod.num_scalars; ++i) mod.scalars[i] = static_cast<float>(scalars[i]);
  mod.num_aux = static_cast<int>(std::min<std::size_t>(aux.size(), ModParams::kMaxAux));
  for (int i = 0; i < mod.num_aux; ++i) {
    mod.aux[i] = aux[i].data;
    mod.aux_dtype[i] = static_cast<int>(aux[i].dtype);
    // Rows: the product of the leading dims (a division by the last one fails when it is 0).
    std::int64_t rows = 1;
    for (int d = 0; d + 1 < aux[i].ndim; ++d) rows *= aux[i].shape[d];
    mod.aux_rows[i] = rows;
    mod.aux_cols[i] = aux[i].size(-1);
    mod.aux_ndim[i] = aux[i].ndim;
    for (int d = 0; d < 4; ++d) {
      mod.aux_shape[i][d] = d < aux[i].ndim ? static_cast<int>(aux[i].shape[d]) : 1;
    }
  }
  return mod;
}

BlockSparseParams make_block_sparse_params(const AttentionOptions& opts,
                                           const AttentionShape& shape, bool backward) {
  BlockSparseParams params;
  if (!opts.block_sparse) return params;
  const BlockSparseTensors& b = *opts.block_sparse;
  // The backward takes the column-block lists where the caller gave them, else the forward's
  // (dispatch tabulates either on the GPU).
  const bool transposed = backward && (b.q_mask_block_cnt || b.q_full_block_cnt);
  const auto& mask_cnt = transposed ? b.q_mask_block_cnt : b.mask_block_cnt;
  const auto& mask_idx = transposed ? b.q_mask_block_idx : b.mask_block_idx;
  const auto& full_cnt = transposed ? b.q_full_block_cnt : b.full_block_cnt;
  const auto& full_idx = transposed ? b.q_full_block_idx : b.full_block_idx;
  params.enabled = true;
  params.row_lists = backward && !transposed;
  params.mask_block_cnt = data_of<int>(mask_cnt);
  params.mask_block_idx = data_of<int>(mask_idx);
  params.full_block_cnt = data_of<int>(full_cnt);
  params.full_block_idx = data_of<int>(full_idx);
  const auto& any_cnt = mask_cnt ? mask_cnt : full_cnt;
  params.num_heads_b = any_cnt ? static_cast<int>(any_cnt->shape[1]) : 1;
  params.block_m = b.block_m;
  params.block_n = b.block_n;
  params.num_row_blocks = static_cast<int>((shape.seqlen_q + b.block_m - 1) / b.block_m);
  params.num_col_blocks = static_cast<int>((shape.seqlen_k + b.block_n - 1) / b.block_n);
  return params;
}

}  // namespace

MaskWindow normalize_window(bool causal, int window_left, int window_right) {
  MaskWindow w;
  const int left = window_left < 0 ? -1 : window_left;
  const int right = causal ? 0 : (window_right < 0 ? -1 : window_right);
  if (left < 0 && right == 0) {
    w.is_causal = true;
    w.window_right = 0;
  } else if (left >= 0 || right >= 0) {
    w.is_local = true;
    w.window_left = left;
    w.window_right = right;
  }
  return w;
}

float default_softmax_scale(std::int64_t head_dim) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

namespace {

// What FwdParams and BwdParams share: inputs, sizes, sequence layout and options. `out` gives
// the output strides (the forward's result, the backward's input).
template <class Params>
void fill_attention_params(Params& p, const TensorView& q, const TensorView& k, const TensorView& v,
                           const TensorView& out, const SequenceLayout& seq,
                           const AttentionOptions& opts,
                           const std::optional<TensorView>& learnable_sink,
                           const AttentionShape& shape, bool backward) {
  p.q = q.data;
  p.k = k.data;
  p.v = v.data;
  const RowStrides qs = row_strides(q), ks = row_strides(k), vs = row_strides(v),
                   os = row_strides(out);
  p.q_batch_stride = qs.batch, p.q_row_stride = qs.row, p.q_head_stride = qs.head;
  p.k_batch_stride = ks.batch, p.k_row_stride = ks.row, p.k_head_stride = ks.head;
  p.v_batch_stride = vs.batch, p.v_row_stride = vs.row, p.v_head_stride = vs.head;
  p.o_batch_stride = os.batch, p.o_row_stride = os.row, p.o_head_stride = os.head;

  p.batch = static_cast<int>(shape.batch);
  p.seqlen_q = static_cast<int>(shape.seqlen_q);
  p.seqlen_k = static_cast<int>(shape.seqlen_k);
  p.num_heads = static_cast<int>(shape.num_heads);
  p.num_heads_kv = static_cast<int>(shape.num_heads_kv);
  p.head_dim = static_cast<int>(shape.head_dim);
  p.head_dim_v = static_cast<int>(shape.head_dim_v);
  p.total_q = static_cast<int>(shape.total_q);
  p.total_k = static_cast<int>(shape.total_k);
  // Where a packed side's length is only bounded by its total, the rules read the means
  // (typical_seqlen_q): of both packed sides, so that a causal call's bottom-right offset
  // (keys minus rows) compares like with like where only one side has a hint.
  bool const mean = shape.seqlen_q_is_bound || shape.seqlen_k_is_bound;
  auto typical = [&](std::int64_t seqlen, std::int64_t total, bool packed) {
    return static_cast<int>(mean && packed && shape.batch > 0 ? (total + shape.batch - 1) / shape.batch : seqlen);
  };
  p.typical_seqlen_q = typical(shape.seqlen_q, shape.total_q, shape.varlen_q);
  p.typical_seqlen_k = typical(shape.seqlen_k, shape.total_k, shape.varlen_k);

  p.cu_seqlens_q = data_of<int>(seq.cu_seqlens_q);
  p.cu_seqlens_k = data_of<int>(seq.cu_seqlens_k);
  p.seqused_q = data_of<int>(seq.seqused_q);
  p.seqused_k = data_of<int>(seq.seqused_k);
  if (seq.page_table) {
    p.page_table = data_of<int>(seq.page_table);
    p.page_table_batch_stride = seq.page_table->stride[0];
    p.page_size = static_cast<int>(shape.page_size);
  }

  p.softmax_scale = opts.softmax_scale.value_or(default_softmax_scale(shape.head_dim));
  p.softmax_scale_log2 = p.softmax_scale * kLog2e;
  p.softcap = opts.softcap;
  // A window side that reaches past every key (left) or every row (right) bounds nothing: it
  // becomes unbounded here, so that the kernels' int arithmetic on it (row + offset - left,
  // times the packed GQA group) cannot overflow on a caller's INT_MAX.
  // Bounds of every sequence: the dense or paged length, the packed rows in all.
  const std::int64_t rows = shape.varlen_q ? std::max(shape.seqlen_q, shape.total_q) : shape.seqlen_q;
  const std::int64_t keys = shape.varlen_k ? std::max(shape.seqlen_k, shape.total_k) : shape.seqlen_k;
  const MaskWindow w = normalize_window(opts.causal, opts.window_left >= keys ? -1 : opts.window_left,
                                        opts.window_right >= rows ? -1 : opts.window_right);
  p.is_causal = w.is_causal;
  p.is_local = w.is_local;
  p.window_left = w.window_left;
  p.window_right = w.window_right;
  if (learnable_sink) {
    p.learnable_sink = learnable_sink->data;
    p.sink_dtype = static_cast<int>(learnable_sink->dtype);
  }

  p.dtype = static_cast<int>(shape.dtype);
  p.score_mod = make_mod_params(static_cast<int>(opts.score_mod.kind), opts.score_mod.scalars,
                                opts.score_mod.aux);
  p.mask_mod = make_mod_params(static_cast<int>(opts.mask_mod.kind),
                               exact_mask_scalars(opts.mask_mod, std::max(rows, keys)), opts.mask_mod.aux);
  p.block_sparse = make_block_sparse_params(opts, shape, backward);
  p.device_index = shape.device.index;
}

}  // namespace

FwdParams make_fwd_params(const ForwardArgs& args, const AttentionShape& shape) {
  FwdParams p;
  fill_attention_params(p, args.q, args.k, args.v, args.out, args.seq, args.opts,
                        args.learnable_sink, shape, /*backward=*/false);
  p.out = args.out.data;
  p.expression_kernel = args.opts.expression_forward_kernel;
  if (args.lse) {
    p.lse = static_cast<float*>(args.lse->data);
    const RowStrides lse = lse_strides(*args.lse);
    p.lse_batch_stride = lse.batch;
    p.lse_head_stride = lse.head;
  }
  p.num_splits = 1;
  p.pack_gqa_requested = args.pack_gqa.has_value();
  p.pack_gqa = shape.num_heads != shape.num_heads_kv &&
               (p.pack_gqa_requested ? *args.pack_gqa : choose_pack_gqa(p));
  return p;
}

BwdParams make_bwd_params(const BackwardArgs& args, const AttentionShape& shape) {
  BwdParams p;
  fill_attention_params(p, args.q, args.k, args.v, args.out, args.seq, args.opts,
                        args.learnable_sink, shape, /*backward=*/true);
  p.out = args.out.data;
  p.expression_kernel = args.opts.expression_backward_kernel;
  p.dout = args.dout.data;
  p.lse = static_cast<const float*>(args.lse.data);
  p.dq = args.dq.data;
  p.dk = args.dk.data;
  p.dv = args.dv.data;
  p.d_sink = args.d_sink ? static_cast<float*>(args.d_sink->data) : nullptr;

  const RowStrides dout = row_strides(args.dout), dq = row_strides(args.dq),
                   dk = row_strides(args.dk), dv = row_strides(args.dv),
                   lse = lse_strides(args.lse);
  p.do_batch_stride = dout.batch, p.do_row_stride = dout.row, p.do_head_stride = dout.head;
  p.dq_batch_stride = dq.batch, p.dq_row_stride = dq.row, p.dq_head_stride = dq.head;
  p.dk_batch_stride = dk.batch, p.dk_row_stride = dk.row, p.dk_head_stride = dk.head;
  p.dv_batch_stride = dv.batch, p.dv_row_stride = dv.row, p.dv_head_stride = dv.head;
  p.lse_batch_stride = lse.batch, p.lse_head_stride = lse.head;
  if (args.dlse) {
    p.dlse = static_cast<const float*>(args.dlse->data);
    const RowStrides dlse = lse_strides(*args.dlse);
    p.dlse_batch_stride = dlse.batch, p.dlse_head_stride = dlse.head;
  }
  p.deterministic = args.deterministic;
  p.pack_gqa = false;  // backward processes one query head per tile
  return p;
}

CombineParams make_combine_params(const CombineArgs& args, const CombineShape& shape) {
  CombineParams p;
  const TensorView& op = args.out_partial;
  const TensorView& lp = args.lse_partial;
  p.out_partial = static_cast<const float*>(op.data);
  p.lse_partial = static_cast<const float*>(lp.data);
  p.out = args.out.data;
  p.lse = args.lse ? static_cast<float*>(args.lse->data) : nullptr;
  // Dense tensors carry one more (batch) dimension than packed ones.
  const int b = shape.varlen ? 0 : 1;
  p.op_split_stride = op.stride[0];
  p.op_batch_stride = shape.varlen ? 0 : op.stride[1];
  p.op_row_stride = op.stride[1 + b];
  p.op_head_stride = op.stride[2 + b];
  p.lp_split_stride = lp.stride[0];
  p.lp_batch_stride = shape.varlen ? 0 : lp.stride[1];
  p.lp_row_stride = lp.stride[1 + b];
  p.lp_head_stride = lp.stride[2 + b];
  p.o_batch_stride = shape.varlen ? 0 : args.out.stride[0];
  p.o_row_stride = args.out.stride[b];
  p.o_head_stride = args.out.stride[1 + b];
  if (args.lse) {
    p.lse_batch_stride = shape.varlen ? 0 : args.lse->stride[0];
    p.lse_row_stride = args.lse->stride[b];
    p.lse_head_stride = args.lse->stride[1 + b];
  }
  p.packed = shape.varlen;
  p.num_splits = static_cast<int>(shape.num_splits);
  p.batch = static_cast<int>(shape.batch);
  p.seqlen = static_cast<int>(shape.seqlen);
  p.num_heads = static_cast<int>(shape.num_heads);
  p.head_dim = static_cast<int>(shape.head_dim);
  p.cu_seqlens = data_of<int>(args.cu_seqlens);
  p.seqused = data_of<int>(args.seqused);
  p.out_dtype = static_cast<int>(args.out.dtype);
  return p;
}

namespace {

template <class Params>
bool fold_window_mask_mod_into(Params& p) {
  // A mask_mod side at or past 2^30 (ModParams::whole) is unbounded.
  auto side = [](float x) { return ModParams::whole(x) >= (1 << 30) ? -1 : ModParams::whole(x); };
  int left = -1, right = -1;
  if (p.mask_mod.kind == int(MaskModKind::kCausal)) {
    right = 0;
  } else if (p.mask_mod.kind == int(MaskModKind::kSlidingWindow)) {
    left = side(p.mask_mod.scalars[0]);
    right = side(p.mask_mod.scalars[1]);
  } else {
    return false;
  }
  if (p.score_mod.kind != 0 || p.block_sparse.enabled || p.expression_kernel != 0 || p.seqlen_q != p.seqlen_k ||
      p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr || p.seqused_q != nullptr || p.seqused_k != nullptr ||
      p.page_table != nullptr)
    return false;
  // The tighter of two sides, -1 being unbounded.
  auto tighter = [](int a, int b) { return a < 0 ? b : b < 0 ? a : std::min(a, b); };
  const MaskWindow w = normalize_window(false, tighter(p.window_left, left), tighter(p.window_right, right));
  p.is_causal = w.is_causal;
  p.is_local = w.is_local;
  p.window_left = w.window_left;
  p.window_right = w.window_right;
  p.mask_mod = ModParams{};
  return true;
}

}  // namespace

bool fold_window_mask_mod(FwdParams& params) { return fold_window_mask_mod_into(params); }
bool fold_window_mask_mod(BwdParams& params) { return fold_window_mask_mod_into(params); }

bool document_lists_apply(const AttentionOptions& opts, const SequenceLayout& seq,
                          const AttentionShape& shape, std::uintptr_t expression_kernel) {
  return opts.mask_mod.kind == MaskModKind::kDocument && !opts.block_sparse && expression_kernel == 0 &&
         (!shape.varlen_q || seq.max_seqlen_q) && (!shape.varlen_k || seq.max_seqlen_k);
}

void plan_document_block_lists(BlockSparseParams& bs, const AttentionShape& shape, bool backward) {
  bs = BlockSparseParams{};
  bs.enabled = true;
  bs.row_lists = backward;
  bs.num_heads_b = 1;
  bs.block_m = bs.block_n = kDocumentListBlock;
  bs.num_row_blocks = static_cast<int>((shape.seqlen_q + kDocumentListBlock - 1) / kDocumentListBlock);
  bs.num_col_blocks = static_cast<int>((shape.seqlen_k + kDocumentListBlock - 1) / kDocumentListBlock);
}

std::string block_lists_refuse_packing(const FwdParams& params) {
  const BlockSparseParams& bs = params.block_sparse;
  if (!bs.enabled) return "";
  const int group = params.num_heads / params.num_heads_kv;
  if (bs.num_heads_b != 1) {
    return "a packed tile holds the rows of " + std::to_string(group) +
           " query heads, so the block lists must be broadcast over heads (head dim 1), got " +
           std::to_string(bs.num_heads_b) + " heads";
  }
  if (kFlexFwdTileRows % group != 0 || bs.block_m % (kFlexFwdTileRows / group) != 0) {
    return "a packed tile holds " + std::to_string(kFlexFwdTileRows) + " / " +
           std::to_string(group) + " query rows, so the query heads per kv head (" +
           std::to_string(group) + ") must divide " + std::to_string(kFlexFwdTileRows) +
           " and block_m (" + std::to_string(bs.block_m) + ") be a multiple of the rows";
  }
  return "";
}

bool choose_pack_gqa(const FwdParams& params) {
  // Callables compiled at run time have one form (packed only when asked); block lists must
  // be readable by packed tiles.
  if (params.expression_kernel != 0 || params.score_mod.kind == int(ScoreModKind::kExpression) ||
      params.mask_mod.kind == int(MaskModKind::kExpression))
    return false;
  if (params.block_sparse.enabled && !block_lists_refuse_packing(params).empty()) return false;
  // Pack when it fills the row tiles markedly better (decode, short prompts): the rows a
  // tile holds over the rows it computes, unpacked against packed (the longest sequence's, or
  // the mean where the lengths are only bounded by the total: typical_seqlen_q).
  constexpr std::int64_t kBlockM = 128;
  const std::int64_t group = params.num_heads / params.num_heads_kv;
  auto fill = [&](std::int64_t rows) {
    return rows <= 0 ? 1.0 : double(rows) / double((rows + kBlockM - 1) / kBlockM * kBlockM);
  };
  const std::int64_t rows = typical_seqlen_q(params);
  return fill(rows) < 0.9 * fill(rows * group);
}

int choose_num_splits(const FwdParams& params, int requested, int num_sm) {
  if (requested > 0) return std::min(requested, kMaxSplits);
  // Callables compiled at run time split only when asked: their module is compiled for the form
  // the caller names (cuflash._jit, split / paged), before this runs. Block lists too:
  // the keys a row block visits are in device arrays, so the host cannot count them, and a
  // count of all seqlen_k would split sparse rows into mostly empty shares.
  if (params.expression_kernel != 0 || params.score_mod.kind == int(ScoreModKind::kExpression) ||
      params.mask_mod.kind == int(MaskModKind::kExpression) || params.block_sparse.enabled)
    return 1;
  constexpr int kBlockM = 128, kBlockN = 128, kMaxHeuristicSplits = 128;
  // The typical sequence (typical_seqlen_q / typical_seqlen_k): without hints the totals
  // would count 64 decode rows as one 64-row sequence and 64 sequences of 256 keys as one of
  // 16k, and split short keys into one-block shares. The row-block list that such a call walks
  // has a tile per sequence's row block, as the typical sequence counts them.
  const std::int64_t seqlen_q = typical_seqlen_q(params);
  std::int64_t seqlen_k_loaded = typical_seqlen_k(params);
  if (params.is_local && params.window_left >= 0 && params.window_right >= 0) {
    seqlen_k_loaded = std::min<std::int64_t>(
        seqlen_k_loaded, std::int64_t{params.window_left} + params.window_right + 1 + kBlockM);
  }
  // A built-in mask_mod bounds the keys a row block visits as a window does (the flex_split
  // kernels narrow each share by it), top-left aligned: causal to the rows, a sliding window to
  // its width and to the rows plus its right side, a prefix LM to the longer of prefix and rows;
  // a row block adds kBlockM.
  const auto scalar = [&](int i) { return std::int64_t{ModParams::whole(params.mask_mod.scalars[i])}; };
  std::int64_t mask_keys = -1;
  switch (params.mask_mod.kind) {
    case int(MaskModKind::kCausal):
      mask_keys = seqlen_q;
      break;
    case int(MaskModKind::kSlidingWindow):  // keys [0, seqlen_q - 1 + right], width left + right + 1
      mask_keys = std::min<std::int64_t>(scalar(0) + scalar(1) + 1, seqlen_q + scalar(1));
      break;
    case int(MaskModKind::kPrefixLM):
      mask_keys = std::max<std::int64_t>(scalar(0), seqlen_q);
      break;
    default:
      break;
  }
  if (mask_keys >= 0) seqlen_k_loaded = std::min(seqlen_k_loaded, mask_keys + kBlockM);
  const std::int64_t num_n_blocks = (seqlen_k_loaded + kBlockN - 1) / kBlockN;
  if (num_n_blocks <= 4) return 1;  // short keys: splitting costs more than it gains
  // One tile per (batch, query head, m-block), or per (batch, kv head, m-block of the group's
  // rows) with packed GQA.
  const std::int64_t group = fwd_pack_group(params);
  const std::int64_t tile_heads = params.num_heads / group;
  const std::int64_t num_m_blocks =
      (seqlen_q * group + kBlockM - 1) / kBlockM;
  const std::int64_t total_m_blocks =
      std::max<std::int64_t>(1, std::int64_t{params.batch} * tile_heads * num_m_blocks);
  const std::int64_t splits = std::min(
      {std::int64_t{num_sm} / total_m_blocks, std::int64_t{kMaxHeuristicSplits}, num_n_blocks});
  return static_cast<int>(std::max<std::int64_t>(1, splits));
}

namespace {
std::int64_t split_rows(const FwdParams& params) {
  return params.cu_seqlens_q ? params.total_q : std::int64_t{params.batch} * params.seqlen_q;
}
std::size_t out_partial_bytes(const FwdParams& params) {
  return static_cast<std::size_t>(params.num_splits) * split_rows(params) * params.num_heads *
         params.head_dim_v * sizeof(float);
}
}  // namespace

std::size_t split_kv_workspace_bytes(const FwdParams& params) {
  if (params.num_splits <= 1) return 0;
  const std::size_t lse_bytes = static_cast<std::size_t>(params.num_splits) * split_rows(params) *
                                params.num_heads * sizeof(float);
  return workspace_aligned(out_partial_bytes(params)) + workspace_aligned(lse_bytes);
}

void assign_split_kv_buffers(FwdParams& params, void* workspace) {
  if (params.num_splits <= 1) return;
  char* base = static_cast<char*>(workspace);
  params.out_partial = reinterpret_cast<float*>(base);
  params.lse_partial = reinterpret_cast<float*>(base + workspace_aligned(out_partial_bytes(params)));
}

namespace {
// A run-time setting read from the environment: one of `choices` by name, the first when unset or
// empty; anything else is refused naming the variable.
template <class T>
T parse_setting(const char* variable, const char* value,
                std::initializer_list<std::pair<const char*, T>> choices) {
  if (value == nullptr || *value == '\0') return choices.begin()->second;
  std::string expected;
  std::size_t index = 0;
  for (const auto& [name, result] : choices) {
    if (std::strcmp(value, name) == 0) return result;
    expected += std::string(index == 0 ? "" : index + 1 == choices.size() ? " or " : ", ") + "'" + name + "'";
    ++index;
  }
  throw Error(Error::Kind::kInvalidArgument, variable,
              std::string(variable) + ": expected " + expected + ", got '" + value + "'");
}
}  // namespace

FwdScheduler parse_fwd_scheduler(const char* value) {
  return parse_setting<FwdScheduler>("CUFLASH_FWD_SCHEDULER", value,
                                     {{"dynamic", FwdScheduler::kDynamic}, {"one_per_tile", FwdScheduler::kOnePerTile}});
}

FwdStreamK parse_fwd_stream_k(const char* value) {
  return parse_setting<FwdStreamK>(
      "CUFLASH_FWD_STREAM_K", value,
      {{"auto", FwdStreamK::kAuto}, {"off", FwdStreamK::kOff}, {"always", FwdStreamK::kAlways}});
}

namespace {
// The stream-K tail's tiles: 128 rows (sm90::fwd_stream_k_tile), the kernel's V head dim.
struct StreamKShape {
  std::size_t block_m, head_dim_v;
};
StreamKShape stream_k_shape(const FwdParams& params) {
  return {128, std::size_t(kernel_head_dims(params.head_dim, params.head_dim_v).head_dim_v)};
}
}  // namespace

int fwd_stream_k_ctas(const FwdParams& params, FwdStreamK setting) {
  if (setting == FwdStreamK::kOff || !fwd_stream_k_eligible(params)) return 0;
  const KernelHeadDims dims = kernel_head_dims(params.head_dim, params.head_dim_v);
  const bool softcap = params.softcap > 0.f;
  // The plain hdim64 kernel's second tile, as its launch picks it (run_flash_fwd_sm90).
  const bool narrow = !softcap && sm90::fwd_plain_narrow_tile(params.short_kernel, typical_seqlen_q(params),
                                                              typical_seqlen_k(params), params.window_left,
                                                              params.window_right);
  const sm90::FwdTileSize tile = sm90::fwd_tile_size(dims.head_dim, dims.head_dim_v, /*flex=*/false, softcap, narrow);
  if (!sm90::fwd_stream_k_tile(tile, dims.head_dim, dims.head_dim_v)) return 0;
  const long long num_tiles = (long long)((params.seqlen_q + tile.block_m - 1) / tile.block_m) *
                              params.num_heads * params.batch;
  const int n_blocks = (params.seqlen_k + tile.block_n - 1) / tile.block_n;
  return sm90::stream_k_tail_ctas(num_tiles, n_blocks, params.num_sm,
                                  sm90::fwd_tile_fixed_cost(dims.head_dim), setting == FwdStreamK::kAlways);
}

int fwd_stream_k_ctas(const FwdParams& params) {
  return fwd_stream_k_ctas(params, parse_fwd_stream_k(std::getenv("CUFLASH_FWD_STREAM_K")));
}

std::size_t stream_k_sync_bytes(const FwdParams& params) {
  // Arrivals: one per tail tile (fewer than the grid); ready flags: two slots per CTA, one flag
  // per MMA warp (16 rows each).
  const std::size_t warps = stream_k_shape(params).block_m / 16;
  return std::size_t(std::max(params.num_sm, 1)) * (1 + 2 * warps) * sizeof(int);
}

std::size_t stream_k_partial_bytes(const FwdParams& params) {
  // Two slots per CTA; a slot holds every MMA thread's output rows (head_dim_v / 2 floats) and
  // its two rows' max and sum: block_m * (head_dim_v + 8) floats.
  const StreamKShape shape = stream_k_shape(params);
  return 2 * std::size_t(std::max(params.num_sm, 1)) * shape.block_m * (shape.head_dim_v + 8) *
         sizeof(float);
}

FwdScheduler fwd_scheduler() {
  // CUFLASH_FWD_SCHEDULER picks how the sm90 forward runs tiles of unequal cost (causal/local,
  // varlen, seqused, mask_mod, block lists), so that both can be timed in one binary:
  //   dynamic (default): a CTA per SM, each next tile claimed from a global counter;
  //   one_per_tile: a CTA per tile, balanced by the hardware.
  // Read once per process; equal tiles always run static persistent.
  static const FwdScheduler scheduler = parse_fwd_scheduler(std::getenv("CUFLASH_FWD_SCHEDULER"));
  return scheduler;
}

FwdZeroVTail parse_fwd_zero_v_tail(const char* value) {
  return parse_setting<FwdZeroVTail>(
      "CUFLASH_FWD_ZERO_V_TAIL", value,
      {{"auto", FwdZeroVTail::kAuto}, {"0", FwdZeroVTail::kOff}, {"1", FwdZeroVTail::kOn}});
}

bool resolve_fwd_zero_v_tail(FwdZeroVTail setting, const FwdParams& params) {
  if (setting != FwdZeroVTail::kAuto) return setting == FwdZeroVTail::kOn;
  // Dense keys end where the K/V tensor's rows do (TMA fills past them with zeros); there
  // zeroing would only cost (1.6-1.8% non-causal at hdim128). seqused_k leaves a tail the caller
  // may never have written, a page table a last page's rest, and cu_seqlens_k rows past the last
  // sequence (the kernel zeroes only that sequence's tiles then: the others run into the next
  // sequence's keys).
  return params.seqused_k != nullptr || params.page_table != nullptr || params.cu_seqlens_k != nullptr;
}

bool fwd_zero_v_tail(const FwdParams& params) {
  // Not cached, so that a test can set it around one call.
  return resolve_fwd_zero_v_tail(parse_fwd_zero_v_tail(std::getenv("CUFLASH_FWD_ZERO_V_TAIL")), params);
}

bool parse_check_inputs(const char* value) {
  return parse_setting<bool>("CUFLASH_CHECK_INPUTS", value, {{"0", false}, {"1", true}});
}

bool check_inputs_on_host() { return parse_check_inputs(std::getenv("CUFLASH_CHECK_INPUTS")); }

FwdShortKernel parse_fwd_short_kernel(const char* value) {
  return parse_setting<FwdShortKernel>(
      "CUFLASH_FWD_SHORT_KERNEL", value,
      {{"auto", FwdShortKernel::kAuto}, {"long", FwdShortKernel::kLong}, {"short", FwdShortKernel::kShort}});
}

FwdRowBlockList parse_fwd_row_block_list(const char* value) {
  return parse_setting<FwdRowBlockList>(
      "CUFLASH_FWD_ROW_BLOCK_LIST", value,
      {{"auto", FwdRowBlockList::kAuto}, {"off", FwdRowBlockList::kOff}, {"always", FwdRowBlockList::kAlways}});
}

FwdRowBlockList fwd_row_block_list() {
  // "auto" (the default): the list where the rectangle would hold more than twice its entries
  // (fwd_row_block_list_pays); "off" and "always", for timing one against the other.
  static const FwdRowBlockList choice = parse_fwd_row_block_list(std::getenv("CUFLASH_FWD_ROW_BLOCK_LIST"));
  return choice;
}

FwdRowBlockListOrder parse_fwd_row_block_list_order(const char* value) {
  return parse_setting<FwdRowBlockListOrder>(
      "CUFLASH_FWD_ROW_BLOCK_LIST_ORDER", value,
      {{"auto", FwdRowBlockListOrder::kAuto},
       {"entries", FwdRowBlockListOrder::kEntries},
       {"heads", FwdRowBlockListOrder::kHeads}});
}

FwdRowBlockListOrder fwd_row_block_list_order() {
  // "auto" (the default): fwd_list_heads_order's rule; "entries": an entry's heads one after
  // another; "heads": a kv head's over every entry first (FwdRowBlockListOrder), for timing one
  // against the other.
  static const FwdRowBlockListOrder choice =
      parse_fwd_row_block_list_order(std::getenv("CUFLASH_FWD_ROW_BLOCK_LIST_ORDER"));
  return choice;
}

BwdBlockList parse_bwd_block_list(const char* value) {
  return parse_setting<BwdBlockList>(
      "CUFLASH_BWD_BLOCK_LIST", value,
      {{"auto", BwdBlockList::kAuto}, {"off", BwdBlockList::kOff}, {"always", BwdBlockList::kAlways}});
}

BwdBlockList bwd_block_list() {
  // "auto" (the default): the lists where the rectangle would hold more than twice their entries
  // (bwd_block_list_pays); "off" and "always", for timing one against the other.
  static const BwdBlockList choice = parse_bwd_block_list(std::getenv("CUFLASH_BWD_BLOCK_LIST"));
  return choice;
}

FwdShortKernel fwd_short_kernel() {
  // "auto" (the default) picks per call by the measured rules (fwd_narrow_tile_pays,
  // fwd_next_qk_pays); "long" and "short" force one kernel, for timing and for testing the twin
  // on every shape.
  static const FwdShortKernel choice = parse_fwd_short_kernel(std::getenv("CUFLASH_FWD_SHORT_KERNEL"));
  return choice;
}

BwdLaunchChoice parse_bwd_order(const char* value) {
  // "heads:G" carries a number; the plain names go through the common parser.
  if (value != nullptr && std::strncmp(value, "heads:", 6) == 0) {
    char* end = nullptr;
    long const group = std::strtol(value + 6, &end, 10);
    if (end != value + 6 && *end == '\0' && group >= 1 && group <= 65535) {
      BwdLaunchChoice choice;
      choice.order = BwdLaunchOrder::kHeads;
      choice.head_group = int(group);
      return choice;
    }
    throw Error(Error::Kind::kInvalidArgument, "CUFLASH_BWD_ORDER",
                std::string("CUFLASH_BWD_ORDER: expected 'heads:G' with 1 <= G <= 65535, got '") + value + "'");
  }
  BwdLaunchChoice choice;
  choice.order = parse_setting<BwdLaunchOrder>(
      "CUFLASH_BWD_ORDER", value,
      {{"auto", BwdLaunchOrder::kAuto}, {"columns", BwdLaunchOrder::kColumns}, {"heads", BwdLaunchOrder::kHeads}});
  return choice;
}

BwdDqPath parse_bwd_dq_path(const char* value) {
  return parse_setting<BwdDqPath>("CUFLASH_BWD_DQ", value,
                                  {{"auto", BwdDqPath::kAuto}, {"atomics", BwdDqPath::kAtomics}, {"bulk", BwdDqPath::kBulk}});
}

BwdDetWalk parse_bwd_det_walk(const char* value) {
  return parse_setting<BwdDetWalk>(
      "CUFLASH_BWD_DET_WALK", value,
      {{"auto", BwdDetWalk::kAuto}, {"waves", BwdDetWalk::kWaves}, {"ascending", BwdDetWalk::kAscending}});
}

BwdDetWalk bwd_det_walk() {
  // CUFLASH_BWD_DET_WALK: where the deterministic backward's walks start, so that the orders can
  // be timed in one binary. Read once per process.
  static const BwdDetWalk walk = parse_bwd_det_walk(std::getenv("CUFLASH_BWD_DET_WALK"));
  return walk;
}

BwdDqSemaphores parse_bwd_dq_semaphores(const char* value) {
  return parse_setting<BwdDqSemaphores>("CUFLASH_BWD_DQ_SEMAPHORES", value,
                                        {{"lines", BwdDqSemaphores::kLines}, {"packed", BwdDqSemaphores::kPacked}});
}

BwdDqSemaphores bwd_dq_semaphores() {
  // CUFLASH_BWD_DQ_SEMAPHORES: the semaphores' layout, so that both can be timed in one binary.
  // Read once per process.
  static const BwdDqSemaphores choice = parse_bwd_dq_semaphores(std::getenv("CUFLASH_BWD_DQ_SEMAPHORES"));
  return choice;
}

int dq_semaphore_stride(BwdDqSemaphores choice) {
  return choice == BwdDqSemaphores::kLines ? 128 / int(sizeof(int)) : 1;
}

BwdDqConvert parse_bwd_dq_convert(const char* value) {
  return parse_setting<BwdDqConvert>("CUFLASH_BWD_DQ_CONVERT", value,
                                     {{"overlap", BwdDqConvert::kOverlap}, {"after", BwdDqConvert::kAfter}});
}

BwdDqConvert bwd_dq_convert() {
  // CUFLASH_BWD_DQ_CONVERT: when the backward converts dQ, so that both can be timed in one
  // binary. Read once per process.
  static const BwdDqConvert choice = parse_bwd_dq_convert(std::getenv("CUFLASH_BWD_DQ_CONVERT"));
  return choice;
}

BwdDqClear parse_bwd_dq_clear(const char* value) {
  return parse_setting<BwdDqClear>("CUFLASH_BWD_DQ_CLEAR", value,
                                   {{"auto", BwdDqClear::kAuto},
                                    {"first", BwdDqClear::kFirstStore},
                                    {"memset", BwdDqClear::kMemset}});
}

BwdDqClear bwd_dq_clear() {
  // CUFLASH_BWD_DQ_CLEAR: how dq_accum starts from zero, so that both can be timed in one binary.
  // Read once per process.
  static const BwdDqClear choice = parse_bwd_dq_clear(std::getenv("CUFLASH_BWD_DQ_CLEAR"));
  return choice;
}

BwdDqPath bwd_dq_path() {
  // CUFLASH_BWD_DQ: how the sliced hdim256 backward adds dQ to global memory, so that the paths
  // can be timed in one binary. Read once per process.
  static const BwdDqPath path = parse_bwd_dq_path(std::getenv("CUFLASH_BWD_DQ"));
  return path;
}

BwdLaunchChoice bwd_launch_order() {
  // CUFLASH_BWD_ORDER picks the order in which the sm90 backward launches the CTAs of causal /
  // local calls, so that they can be timed in one binary: columns: grid (column blocks, heads,
  // batch); heads: grid (heads, column blocks, batch), longest columns first; heads:G: the same
  // within groups of G heads; auto (default): by head dim, as measured (flash_bwd_launch_sm90.hpp).
  static const BwdLaunchChoice choice = parse_bwd_order(std::getenv("CUFLASH_BWD_ORDER"));
  return choice;
}

namespace {
bool uses_tile_counter(const FwdParams& params, FwdScheduler scheduler) {
  return scheduler == FwdScheduler::kDynamic && fwd_tiles_unequal(params);
}
bool uses_stream_k(const FwdParams& params) { return params.stream_k_ctas > 0; }
std::size_t row_block_list_bytes(const FwdParams& params) {
  if (!fwd_row_block_list_wanted(params)) return 0;
  // The entries' pairs, then the listed count (in a pair's slot).
  return std::size_t(fwd_row_block_list_entries(params, kFwdRowBlockListMinBlockM) + 1) * 2 * sizeof(int);
}
}  // namespace

std::size_t forward_workspace_bytes(const FwdParams& params, FwdScheduler scheduler) {
  std::size_t bytes = workspace_aligned(split_kv_workspace_bytes(params)) +
                      (uses_tile_counter(params, scheduler) ? kWorkspaceAlignment : 0);
  if (uses_stream_k(params))
    bytes += workspace_aligned(stream_k_sync_bytes(params)) + workspace_aligned(stream_k_partial_bytes(params));
  return bytes + workspace_aligned(row_block_list_bytes(params));
}

void assign_forward_workspace(FwdParams& params, void* workspace, FwdScheduler scheduler) {
  assign_split_kv_buffers(params, workspace);
  char* next = static_cast<char*>(workspace) + workspace_aligned(split_kv_workspace_bytes(params));
  params.tile_counter = nullptr;
  if (uses_tile_counter(params, scheduler)) {
    params.tile_counter = reinterpret_cast<int*>(next);
    next += kWorkspaceAlignment;
  }
  params.stream_k_sync = nullptr;
  params.stream_k_partial = nullptr;
  if (uses_stream_k(params)) {
    params.stream_k_sync = reinterpret_cast<int*>(next);
    next += workspace_aligned(stream_k_sync_bytes(params));
    params.stream_k_partial = reinterpret_cast<float*>(next);
    next += workspace_aligned(stream_k_partial_bytes(params));
  }
  std::size_t const list_bytes = row_block_list_bytes(params);
  params.row_block_list = list_bytes > 0 ? reinterpret_cast<int*>(next) : nullptr;
  params.row_block_list_capacity = list_bytes > 0 ? int(list_bytes / (2 * sizeof(int)) - 1) : 0;
}

CombineParams make_split_combine_params(const FwdParams& params, const ForwardArgs& args,
                                        const AttentionShape& shape) {
  CombineParams c;
  const bool packed = shape.varlen_q;
  const std::int64_t rows = split_rows(params);
  const std::int64_t heads = params.num_heads, dim = params.head_dim_v;
  c.out_partial = params.out_partial;
  c.lse_partial = params.lse_partial;
  c.out = args.out.data;
  c.lse = params.lse;
  c.op_split_stride = rows * heads * dim;
  c.op_batch_stride = packed ? 0 : std::int64_t{params.seqlen_q} * heads * dim;
  c.op_row_stride = heads * dim;
  c.op_head_stride = dim;
  c.lp_split_stride = rows * heads;
  c.lp_batch_stride = packed ? 0 : std::int64_t{params.seqlen_q} * heads;
  c.lp_row_stride = heads;
  c.lp_head_stride = 1;
  c.o_batch_stride = params.o_batch_stride;
  c.o_row_stride = params.o_row_stride;
  c.o_head_stride = params.o_head_stride;
  c.lse_batch_stride = params.lse_batch_stride;
  c.lse_row_stride = 1;
  c.lse_head_stride = params.lse_head_stride;
  c.packed = packed;
  c.num_splits = params.num_splits;
  c.batch = params.batch;
  c.seqlen = packed ? params.total_q : params.seqlen_q;
  c.num_heads = params.num_heads;
  c.head_dim = params.head_dim_v;
  c.cu_seqlens = params.cu_seqlens_q;
  c.seqused = params.seqused_q;
  c.out_dtype = params.dtype;
  return c;
}

}  // namespace cuflash::detail
