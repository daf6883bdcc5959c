// Plain parameter structs handed from dispatch (src/api) to the device kernels.
// No framework types; pointers are device pointers, strides are in elements.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cuflash {

// A score_mod or mask_mod (ScoreModKind / MaskModKind value) with its scalars and aux arrays.
// Aux arrays are contiguous; aux_rows x aux_cols is their shape (aux_rows 1 for 1-D), aux_shape
// their sizes (1 past aux_ndim). An expression (kind 100) has its program compiled into the
// kernel (sm90/expression_mods.hpp); its float constants are `scalars`, its tensors `aux`.
struct ModParams {
  // A scalar that counts rows or keys (window sides, prefix length: whole numbers >= 0, validated)
  // as an int; any value past 2^30 acts as unbounded.
  static int whole(float x) { return x < float(1 << 30) ? int(x) : (1 << 30); }

  static constexpr int kMaxScalars = 16;
  static constexpr int kMaxAux = 4;
  int kind = 0;  // 0: none
  int num_scalars = 0;
  float scalars[kMaxScalars] = {};
  int num_aux = 0;
  const void* aux[kMaxAux] = {};
  int aux_dtype[kMaxAux] = {};  // cuflash::DType value
  std::int64_t aux_rows[kMaxAux] = {};
  std::int64_t aux_cols[kMaxAux] = {};
  int aux_ndim[kMaxAux] = {};
  int aux_shape[kMaxAux][4] = {};
};

// FlexAttention BlockMask lists (int32, contiguous), see BlockSparseTensors in options.hpp.
// Forward: per (b, h_b, row block) counts and column-block indices; backward: the transposed
// per (b, h_b, column block) lists. h_b = h when num_heads_b == num_heads, else 0.
struct BlockSparseParams {
  bool enabled = false;
  const int* mask_block_cnt = nullptr;
  const int* mask_block_idx = nullptr;
  const int* full_block_cnt = nullptr;
  const int* full_block_idx = nullptr;
  int num_heads_b = 0;     // 1 or num_heads
  int num_row_blocks = 0;  // ceil(seqlen_q / block_m): forward lists' third dim
  int num_col_blocks = 0;  // ceil(seqlen_k / block_n)
  int block_m = 128;
  int block_n = 128;
  // Backward: the lists above are the forward's (per row block, as the caller gave them when it
  // gave no column-block lists) rather than the transposed ones.
  bool row_lists = false;
  // Backward (set by dispatch, in the workspace, from whichever lists the call has): per
  // (batch, list head, column block), the class of each row block, 0 not listed, 1 mask list,
  // 2 full list; the kernels' walks go upwards through it (sm90/flex_bwd_sm90.hpp).
  const unsigned char* row_class = nullptr;
  // Backward (set by dispatch beside row_class): per (batch, list head, column block), two ints
  // {num_row_blocks - first listed row block, last listed row block + 1}, both 0 when the column
  // block lists none, so that a walk reads the classes between its first and last listed row
  // blocks only instead of every row block of the sequence.
  const int* row_bounds = nullptr;
  // Backward, deterministic runs (set by dispatch beside row_class): the same classes per (batch,
  // list head, row block, column block), so that the ranks of the dQ order (a warp reading one
  // row block's classes over 32 column blocks) read one line instead of 32.
  const unsigned char* row_class_by_row = nullptr;
  // Backward (set by dispatch beside row_class): the most list column blocks (block_n keys each)
  // the lists give one list row block, full and mask lists together (one int), so that the
  // kernels decide on the device whether dq_accum starts from first stores (dq_list_max_writers
  // in sm90/dq_accum_start_sm90.hpp).
  const int* max_row_writers = nullptr;
};

// A forward kernel's twin for short work (FwdParams::short_kernel).
enum class FwdShortKernel { kAuto, kLong, kShort };
// Whether the varlen forward walks its row-block list (FwdParams::row_block_list_mode): where it
// pays (kAuto), never, or for every call with packed queries of more than one sequence.
enum class FwdRowBlockList { kAuto, kOff, kAlways };
// The order in which the forward's persistent tiles walk the row-block list
// (FwdParams::row_block_list_order): kEntries, an entry's heads (and splits) one after another
// before the next entry, so that at any time the CTAs read every head's K / V of the same few
// sequences; kHeads, the heads of one kv head (one head, for MHA or packed GQA) over every
// entry before the next, so that they read one kv head's K / V over as many sequences, as the
// rectangle's L2 sections do (a smaller working set where a sequence's K / V of all heads
// outgrows L2). kHeads applies up to head dim 128 (FlashFwdKernelSm90::kListHeadsOrder). kAuto:
// the one fwd_list_heads_order picks.
enum class FwdRowBlockListOrder { kAuto, kEntries, kHeads };

struct FwdParams {
  // q: (B, Sq, H, D) or packed (total_q, H, D) with cu_seqlens_q (batch stride unused).
  const void* q = nullptr;
  const void* k = nullptr;  // (B, Sk, H_kv, D), packed, or paged (pages, page_size, H_kv, D)
  const void* v = nullptr;  // same as k with Dv
  void* out = nullptr;      // (B, Sq, H, Dv) or (total_q, H, Dv)
  float* lse = nullptr;     // (B, H, Sq) or (H, total_q); null: not written
  std::int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  std::int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  std::int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  std::int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  std::int64_t lse_batch_stride = 0, lse_head_stride = 0;  // row stride is 1

  int batch = 0;
  int seqlen_q = 0;  // dense: Sq; packed: max_seqlen_q
  int seqlen_k = 0;  // dense: Sk; packed: max_seqlen_k; paged: max_pages * page_size
  int num_heads = 0, num_heads_kv = 0;
  int head_dim = 0, head_dim_v = 0;
  int total_q = 0;  // rows of q when packed
  int total_k = 0;  // rows of k/v when packed (cu_seqlens_k), pages * page_size when paged
  // The lengths the kernel-choice rules read (typical_seqlen_q / typical_seqlen_k below).
  int typical_seqlen_q = 0, typical_seqlen_k = 0;

  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  const int* seqused_q = nullptr;
  const int* seqused_k = nullptr;

  const int* page_table = nullptr;  // (B, max_pages)
  std::int64_t page_table_batch_stride = 0;
  int page_size = 0;

  float softmax_scale = 1.f;
  float softmax_scale_log2 = 1.f;  // softmax_scale * log2(e)
  float softcap = 0.f;             // 0: off
  bool is_causal = false;
  bool is_local = false;
  int window_left = -1;  // < 0: unbounded
  int window_right = -1;

  const void* learnable_sink = nullptr;  // (H,)
  int sink_dtype = 0;                    // cuflash::DType value

  // Split-KV (num_splits > 1): the kernel writes fp32 partial outputs (splits, B, Sq, H, Dv) or
  // (splits, total_q, H, Dv) and lse (splits, B, Sq, H) or (splits, total_q, H), contiguous,
  // instead of out / lse; dispatch then merges them with run_combine.
  int num_splits = 1;
  float* out_partial = nullptr;
  float* lse_partial = nullptr;

  // Packed GQA (sm90/pack_gqa_sm90.hpp): a GQA group's query heads share the forward's tiles.
  // pack_gqa_requested: the caller asked (pack_gqa=True/False) rather than leaving it to
  // choose_pack_gqa.
  bool pack_gqa = false;
  bool pack_gqa_requested = false;
  int num_sm = 0;
  int dtype = 0;  // cuflash::DType value of q/k/v/out

  ModParams score_mod;
  ModParams mask_mod;
  BlockSparseParams block_sparse;  // forward (row-block) lists
  int device_index = 0;

  // Dynamic tile scheduling: one int of device workspace that the launch zeroes on the stream
  // before the kernel; null: no dynamic scheduling (see fwd_tiles_unequal).
  int* tile_counter = nullptr;
  // The varlen row-block list (sm90/varlen_block_list_sm90.hpp): device workspace for
  // row_block_list_capacity {sequence, row block} pairs of ints and, after them, the count of
  // entries the builder listed (fwd_row_block_list_listed), given by dispatch to packed queries
  // of more than one sequence; the launch builds and walks it where fwd_row_block_list_pays.
  // Null: the batch x row-block rectangle.
  int* row_block_list = nullptr;
  int row_block_list_capacity = 0;
  FwdRowBlockList row_block_list_mode = FwdRowBlockList::kAuto;  // from CUFLASH_FWD_ROW_BLOCK_LIST
  // from CUFLASH_FWD_ROW_BLOCK_LIST_ORDER
  FwdRowBlockListOrder row_block_list_order = FwdRowBlockListOrder::kAuto;
  // Stream-K tail of the static schedule (sm90/stream_k_sm90.hpp): how many CTAs share the last
  // wave's tiles (0: none; set by dispatch, detail::fwd_stream_k_ctas), and device workspace for
  // the pieces' arrival counters and ready flags (zeroed by the launch) and their partial states.
  int stream_k_ctas = 0;
  int* stream_k_sync = nullptr;
  float* stream_k_partial = nullptr;

  // A launcher compiled at run time for expression mods (AttentionOptions), run instead of the
  // built-in flex kernels; 0: none.
  std::uintptr_t expression_kernel = 0;

  // Which of a forward kernel and its twin for short work runs, where one has a twin: the plain
  // hdim64 kernel's 128-row tile on two MMA warpgroups (its long kernel: 192 rows on three), the
  // hdim128 kernels' one-Q kernel (their long kernels issue the next tile's first Q K^T under
  // the epilogue). kAuto: the launch picks by sm90::fwd_narrow_tile_pays / fwd_next_qk_pays.
  // From CUFLASH_FWD_SHORT_KERNEL.
  FwdShortKernel short_kernel = FwdShortKernel::kAuto;
  // The sm90 forward zeroes the V rows past the sequence's keys in each tile's boundary block
  // before the P V GEMM: their P is 0, but memory past seqused_k (a cache's unused tail) may hold
  // NaN or Inf, and 0 * NaN is NaN. From CUFLASH_FWD_ZERO_V_TAIL (resolve_fwd_zero_v_tail: by
  // default with seqused_k, paged KV or cu_seqlens_k; the kernel's zero_v_tail narrows the last
  // to the last sequence's tiles).
  bool zero_v_tail = false;
};

// Whether the forward's tiles differ in cost: causal/local windows, packed or seqused sequences
// (of different lengths), a mask_mod or block lists. Such calls are scheduled dynamically (or one
// CTA per tile), the others statically (sm90/flash_fwd_launch_sm90.hpp).
inline bool fwd_tiles_unequal(const FwdParams& p) {
  return p.window_left >= 0 || p.window_right >= 0 || p.cu_seqlens_q != nullptr ||
         p.cu_seqlens_k != nullptr || p.seqused_q != nullptr || p.seqused_k != nullptr ||
         p.mask_mod.kind != 0 || p.block_sparse.enabled;
}

// Query rows per tile row: the GQA group with packed GQA (its query heads share a tile), else 1.
inline int fwd_pack_group(const FwdParams& p) {
  return p.pack_gqa && p.num_heads_kv > 0 ? p.num_heads / p.num_heads_kv : 1;
}

// The varlen forward's row-block list (sm90/varlen_block_list_sm90.hpp) for a kernel tile of
// block_m rows (packed GQA: block_m tile rows over the group's query heads). Its entries: a bound
// on the row blocks that hold rows, known without the lengths (each sequence adds at most one
// partial block). Dispatch sizes the workspace for the lowest tile height of the forward kernels.
constexpr int kFwdRowBlockListMinBlockM = 128;
inline long long varlen_block_list_entries(long long total_rows, int batch, int block) {
  return (total_rows + block - 1) / block + batch;
}
// The forward's and the backward's rule for a list of `entries` against the rectangle of
// `rectangle` blocks: where the rectangle has more than twice as many, or (`any_more`) more at
// all; and the entries fit an int (always: whenever the call may have one).
inline bool varlen_block_list_pays(bool always, long long rectangle, long long entries,
                                   bool any_more = false) {
  return entries <= (long long)0x7fffffff &&
         (always || rectangle > 2 * entries || (any_more && rectangle > entries));
}
inline long long fwd_row_block_list_entries(const FwdParams& p, int block_m) {
  return varlen_block_list_entries((long long)p.total_q * fwd_pack_group(p), p.batch, block_m);
}
// Whether dispatch gives the call a list: packed queries of more than one sequence.
inline bool fwd_row_block_list_wanted(const FwdParams& p) {
  return p.row_block_list_mode != FwdRowBlockList::kOff && p.cu_seqlens_q != nullptr && p.batch > 1 &&
         fwd_row_block_list_entries(p, kFwdRowBlockListMinBlockM) <= (long long)0x7fffffff;
}
// Whether the launch walks the list rather than the rectangle of batch x ceil(seqlen_q /
// block_m) row blocks: where the rectangle has more than twice the list's entries, as it has
// with lengths far apart under a max_seqlen_q hint, and without the hint (lengths on the
// device, seqlen_q is then total_q) where it has more at all. The list costs a one-CTA kernel
// before the forward and a load per tile; the rectangle a decode, length reads and a skip per
// empty tile.
inline bool fwd_row_block_list_pays(const FwdParams& p, int block_m) {
  if (p.row_block_list == nullptr || !fwd_row_block_list_wanted(p)) return false;
  long long const rectangle =
      (long long)p.batch * (((long long)p.seqlen_q * fwd_pack_group(p) + block_m - 1) / block_m);
  long long const entries = fwd_row_block_list_entries(p, block_m);
  // Without a max_seqlen_q hint (seqlen_q is total_q) the forward takes the list wherever the
  // rectangle has more blocks: the rectangle of two or of a few short sequences is not twice the
  // list (batch 2: 2R blocks against R + 2; a packed decode of 4 x 16 queries at group 8: 4 x 4
  // against 4 + 4) and still mostly empty, and the dynamic scheduler's CTAs, claiming a tile
  // ahead, run two blocks with rows back to back while other SMs idle. Measured on the H100
  // (bench/NOTES.md, the no-hint lists): 2 x 1024 non-causal +17.5%, 2 x 8192 causal +6.4%, the
  // packed decode at seqlen_q 16 +8% (32:4) and +16% (64:8). Where the rows of all sequences
  // together fit one block (total_q x group <= block_m) the rectangle (batch blocks, all with
  // rows) is not more than the list (batch + 1) and stays.
  // The backward keeps the twice rule: its list lost 7.5-9% at 2 x 1024.
  return varlen_block_list_pays(p.row_block_list_mode == FwdRowBlockList::kAlways, rectangle,
                                entries, /*any_more=*/p.seqlen_q >= p.total_q) &&
         entries <= p.row_block_list_capacity;
}

// Where the builder writes how many of the list's entries hold a row block (one int after the
// capacity's pairs): the kernel walks those and none of the empty ones after them.
inline int* fwd_row_block_list_listed(const FwdParams& p) {
  return p.row_block_list + 2 * static_cast<long long>(p.row_block_list_capacity);
}

// Whether the forward's static schedule may end in a stream-K tail (sm90/stream_k_sm90.hpp):
// tiles of equal cost, written whole by the plain kernel (no split-KV, pages, packed GQA,
// score_mod or expression kernel).
inline bool fwd_stream_k_eligible(const FwdParams& p) {
  return !fwd_tiles_unequal(p) && p.num_splits <= 1 && p.page_table == nullptr && !p.pack_gqa &&
         p.score_mod.kind == 0 && p.expression_kernel == 0;
}

struct BwdParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* out = nullptr;
  const void* dout = nullptr;
  const float* lse = nullptr;
  const float* dlse = nullptr;  // lse's layout; null: no gradient reaches lse
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* d_sink = nullptr;
  std::int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  std::int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  std::int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  std::int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  std::int64_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;
  std::int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  std::int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  std::int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;
  std::int64_t lse_batch_stride = 0, lse_head_stride = 0;
  std::int64_t dlse_batch_stride = 0, dlse_head_stride = 0;

  int batch = 0, seqlen_q = 0, seqlen_k = 0, num_heads = 0, num_heads_kv = 0;
  int head_dim = 0, head_dim_v = 0, total_q = 0, total_k = 0;
  // The lengths the kernel-choice rules read (typical_seqlen_q / typical_seqlen_k below).
  int typical_seqlen_q = 0, typical_seqlen_k = 0;
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  const int* seqused_q = nullptr;
  const int* seqused_k = nullptr;
  // Paged k/v (pages, page_size, H_kv, D), as in FwdParams; dk/dv have the shapes of k/v, and a
  // page that several sequences share receives the sum of their gradients.
  const int* page_table = nullptr;  // (B, max_pages)
  std::int64_t page_table_batch_stride = 0;
  int page_size = 0;

  float softmax_scale = 1.f, softmax_scale_log2 = 1.f, softcap = 0.f;
  bool is_causal = false, is_local = false;
  int window_left = -1, window_right = -1;
  const void* learnable_sink = nullptr;
  int sink_dtype = 0;
  bool deterministic = false;
  // A launcher compiled at run time for expression mods (AttentionOptions), run instead of the
  // built-in flex kernel once the workspace is carved; 0: none.
  std::uintptr_t expression_kernel = 0;

  // Workspace (fp32): dPsum and lse_log2 (B, H, Sq_rounded), dq_accum (B, H, Sq_rounded, D),
  // dk_accum / dv_accum for GQA (B, H_kv, Sk_rounded, D / Dv), semaphores for determinism.
  float* dpsum = nullptr;
  float* lse_log2 = nullptr;
  float* dq_accum = nullptr;
  float* dk_accum = nullptr;
  float* dv_accum = nullptr;
  int* dq_semaphore = nullptr;
  // Per (batch, head): the main kernel's CTAs whose dQ sums have landed, so that the dQ
  // conversion can start on a head while the main kernel still runs others (null: it waits for
  // the whole main kernel). Zeroed by the preprocess.
  int* dq_done = nullptr;
  // Per (row block of the workspace rows, MMA warpgroup): which column block writes the block's
  // dQ sums first (BwdDqClear::kFirstStore), so that dq_accum needs no clear. Zeroed by the
  // preprocess.
  int* dq_tickets = nullptr;
  // The varlen block lists (sm90/varlen_block_list_sm90.hpp): {sequence, block} pairs of ints
  // of the packed query rows' row blocks (the preprocess and the dQ conversion) and of the packed
  // keys' column blocks (the main kernel and the dK / dV conversion), built by the launch where
  // bwd_block_list_pays; null: the batch x blocks rectangle. block_list is a BwdBlockList value,
  // from CUFLASH_BWD_BLOCK_LIST.
  int* row_block_list = nullptr;
  int* col_block_list = nullptr;
  int block_list = 0;
  // Device workspace of backward_workspace_bytes(params) bytes, handed in by dispatch;
  // run_backward carves the buffers above from it.
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  int num_sm = 0;
  int dtype = 0;

  ModParams score_mod;
  ModParams mask_mod;
  BlockSparseParams block_sparse;  // backward (transposed, q_*) lists
  bool pack_gqa = false;
  int device_index = 0;
  // Launch order of the main kernel's CTAs when column blocks differ in work (causal / local,
  // not deterministic), a BwdLaunchOrder value, and with kHeads the heads launched together
  // (0: all of a batch's). From CUFLASH_BWD_ORDER.
  int launch_order = 0;
  int launch_head_group = 0;
  // How the sliced hdim256 kernels add dQ to global memory, a BwdDqPath value. From
  // CUFLASH_BWD_DQ.
  int dq_path = 0;
  // Deterministic runs without a window: where the column blocks' walks start, a BwdDetWalk
  // value. From CUFLASH_BWD_DET_WALK.
  int det_walk = 0;
  // Deterministic runs: ints from one row block's dQ semaphore to the next (32: a 128-byte line
  // each, the default; 1: adjacent). From CUFLASH_BWD_DQ_SEMAPHORES.
  int dq_semaphore_stride = 32;
  // When dQ is converted from its fp32 sums, a BwdDqConvert value. From CUFLASH_BWD_DQ_CONVERT.
  int dq_convert = 0;
  // How dq_accum starts from zero, a BwdDqClear value. From CUFLASH_BWD_DQ_CLEAR.
  int dq_clear = 0;
  // Rows per step and keys per column block of the backward tile that dispatch laid the
  // workspace out for (the tile depends on whether the kernel has a per-element score
  // derivative, and for the flex kernels on block lists); the launcher refuses to run a kernel
  // whose tile differs.
  int block_m = 0;
  int block_n = 0;
};

// Whether the varlen backward walks its block lists (BwdParams::block_list): kAuto where
// bwd_block_list_pays; kOff and kAlways, for timing one against the other.
enum class BwdBlockList : int { kAuto = 0, kOff = 1, kAlways = 2 };
// Whether the backward walks a block list of the packed queries (queries: row blocks of block
// rows) or keys (column blocks) rather than the rectangle of batch x ceil(longest / block)
// blocks per head: packed rows of more than one sequence where the rectangle has more than twice
// the list's entries, as it has with the lengths on the device and no max_seqlen hint (the
// longest is then the total) or with lengths far apart. The list costs a one-CTA kernel and a
// load per CTA; the rectangle a started and stopped CTA per empty block (the main kernel's hold
// 200 KB of shared memory, one per SM at a time).
inline bool bwd_block_list_pays(const BwdParams& p, bool queries, int block) {
  bool const packed = queries ? p.cu_seqlens_q != nullptr : p.cu_seqlens_k != nullptr;
  BwdBlockList const mode = BwdBlockList(p.block_list);
  if (mode == BwdBlockList::kOff || !packed || p.batch <= 1 || block <= 0) return false;
  long long const entries = varlen_block_list_entries(queries ? p.total_q : p.total_k, p.batch, block);
  long long const longest = queries ? p.seqlen_q : p.seqlen_k;
  long long const rectangle = (long long)p.batch * ((longest + block - 1) / block);
  return varlen_block_list_pays(mode == BwdBlockList::kAlways, rectangle, entries);
}

// Split-KV combine: out_partial (splits, rows, H, D) and lse_partial (splits, rows, H) in fp32,
// rows = B * S (dense) or total (packed); out (rows, H, D), lse (rows, H).
// Dense: row r of sequence b is at b * *_batch_stride + r * *_row_stride, r < seqlen (or
// seqused[b]). Packed: batch strides are 0, seqlen is the total row count, and sequence b
// starts at row cu_seqlens[b] (0 when cu_seqlens is null, then batch is 1) and has
// cu_seqlens[b + 1] - cu_seqlens[b] rows (seqused[b] when given).
struct CombineParams {
  const float* out_partial = nullptr;
  const float* lse_partial = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // null: not written
  std::int64_t op_split_stride = 0, op_batch_stride = 0, op_row_stride = 0, op_head_stride = 0;
  std::int64_t lp_split_stride = 0, lp_batch_stride = 0, lp_row_stride = 0, lp_head_stride = 0;
  std::int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  std::int64_t lse_batch_stride = 0, lse_row_stride = 0, lse_head_stride = 0;
  int num_splits = 0, batch = 0, seqlen = 0, num_heads = 0, head_dim = 0;
  const int* cu_seqlens = nullptr;
  const int* seqused = nullptr;
  int out_dtype = 0;  // cuflash::DType value
  // Rows without a batch dimension ((total, H, D) outputs), addressed by row alone. Not read
  // from a batch stride of 0: a dense input broadcast over the batch has one too.
  bool packed = false;
};

// The order in which the sm90 backward launches its CTAs (BwdParams::launch_order) when column
// blocks differ in work. kColumns: a head's column blocks one after another (grid x); kHeads:
// column block n of every head of a batch before column block n + 1, so the longest causal
// columns start first and the short ones fill the tail; with a head group of g, the heads go in
// groups of g (column block n of the group's heads before n + 1, one group after another), which
// bounds the Q / dO the running CTAs stream from L2; kAuto: by head dim (the launcher).
enum class BwdLaunchOrder : int { kAuto = 0, kColumns = 1, kHeads = 2 };
// How the sm90 backward's sliced hdim256 kernels add dQ to global memory (BwdParams::dq_path):
// kAtomics: fp32 atomics from registers; kBulk: through shared memory, 4 KB per bulk reduce-add;
// kAuto: the launcher's kDqPathByDefault.
enum class BwdDqPath : int { kAuto = 0, kAtomics = 1, kBulk = 2 };
// Where the deterministic backward's column blocks start their walks over the row blocks
// (BwdParams::det_walk; plain kernels without a window): kWaves: rotated, a head's column blocks
// launched in one wave of num_sm CTAs spread over the row blocks, so that they rarely reach a
// row block together; kAscending: every one at the first row block; kAuto: waves where a head's
// column blocks fit on the GPU at once, else ascending.
enum class BwdDetWalk : int { kAuto = 0, kWaves = 1, kAscending = 2 };
// Where the deterministic backward's dQ semaphores lie (BwdParams::dq_semaphore_stride):
// kLines (the default): each in a 128-byte line of its own, so that CTAs polling or releasing
// different row blocks of a head do not share a line (4-5% faster at hdim128 causal than kPacked,
// bench/NOTES.md); kPacked: one int per row block, adjacent.
enum class BwdDqSemaphores : int { kLines = 0, kPacked = 1 };
// When the sm90 backward converts dQ from its fp32 sums to the output dtype
// (BwdParams::dq_convert). kOverlap (the default): the conversion kernel is launched as the main
// kernel's programmatic dependent and converts a head once every main-kernel CTA of that head has
// added its dQ (BwdParams::dq_done), on the SMs the main kernel's last wave leaves idle; kAfter:
// once the whole main kernel has finished.
enum class BwdDqConvert : int { kOverlap = 0, kAfter = 1 };
// How the sm90 backward's dq_accum starts from zero (BwdParams::dq_clear). kFirstStore: the
// kernels whose dQ leaves through shared memory by bulk copies store the first column block's
// sums of each row block and add the others after them (dq_ticket_take in mainloop_bwd_sm90.hpp),
// so nothing clears dq_accum; the kernels with dQ by atomics still clear it. kMemset: a memset
// clears it before the preprocess, and every column block adds. Without a window, first stores
// also rotate the column blocks' walks (not deterministic; the deterministic rotation is
// CUFLASH_BWD_DET_WALK's). kAuto (the default): first stores where the launcher measured them
// faster (the sliced hdim256 kernels' bulk dQ with causal or local, deterministic or not, and,
// not deterministic, without a window where the walks rotate over whole heads; the sliced
// kernels only up to 32 row blocks; deterministic hdim128; short causal calls, short
// deterministic calls without a window, and narrow local windows at any length: dq_first_stores
// in sm90/dq_accum_start_sm90.hpp), the memset elsewhere; the flex kernels with block lists, not
// deterministic, decide on the GPU from the lists (dq_list_max_writers there): first stores, or a
// clear kernel in the memset's place.
enum class BwdDqClear : int { kAuto = 0, kFirstStore = 1, kMemset = 2 };
struct BwdLaunchChoice {
  BwdLaunchOrder order = BwdLaunchOrder::kAuto;
  int head_group = 0;  // kHeads: heads launched together; 0: all of a batch's
};

// The layout version: bumped with every change to the members of FwdParams, BwdParams or
// ModParams, since a member added into tail padding leaves the sizes below as they were.
constexpr std::uint64_t kParamsLayoutVersion = 30;

// A sequence's length as the measured kernel-choice rules read it (the forward's tile twins and
// default pack_gqa, where the backward's dq_accum starts and how its walks turn): seqlen_q /
// seqlen_k where that is the longest sequence (dense, a max_seqlen hint, lengths in host memory)
// or a paged cache's capacity, and where a packed side's is only the bound total_q / total_k
// (lengths in device memory without a hint) the means of the packed sides, ceil(total /
// batch), that make_fwd_params / make_bwd_params put in typical_seqlen_*. Lengths far apart
// make the mean understate the longest (one 16k sequence among 63 of 16 tokens reads as 270):
// the hints are the remedy. The kernels walk each sequence's own blocks (the varlen block
// lists), so a rule timed on sequences of one length fits such a call by its typical sequence,
// not by the sum of all: with the total, 256 sequences of 256 tokens took the long-tile
// kernels and cleared dq_accum (0.82 of the hinted backward on the H100, bench/NOTES.md).
// Grids, workspace and every bound still come from seqlen_q / seqlen_k.
template <class Params>
inline int typical_seqlen_q(const Params& p) {
  return p.typical_seqlen_q > 0 ? p.typical_seqlen_q : p.seqlen_q;
}
template <class Params>
inline int typical_seqlen_k(const Params& p) {
  return p.typical_seqlen_k > 0 ? p.typical_seqlen_k : p.seqlen_k;
}

// The K / V bytes the forward's CTAs should keep within L2 at a time: the rectangle walks its
// (batch, head) pairs in sections of this much K / V (PersistentTileSchedulerSm90::
// choose_section_size), leaving the rest of the H200's 50 MB (the H100's) for the Q / O streams.
constexpr long long kFwdKvL2BudgetBytes = 16ll << 20;

// Whether the forward walks its row-block list in the heads order (FwdRowBlockListOrder): as
// set, or (kAuto) where a typical sequence's K / V over every kv head is at least
// kFwdKvL2BudgetBytes and every row block sees all of its sequence's keys (no causal mask,
// window, mask_mod or block lists). The entries order then has the CTAs read every head's K / V
// of the same few sequences at once, more than L2 holds, where the heads order reads one kv
// head's over the sequences as the rectangle's sections do. Measured on the H100 (bf16, 16
// heads, no hints, one pass, bench/NOTES.md): 16 x 4k (32 MB per sequence at hdim128, 16 MB at
// hdim64) +4.1% at hdim128 and +2.9% at hdim64 with the heads order; 64 x 1k and 256 x 256 (8
// and 2 MB) -2.9 to +0.9%, and causal 16 x 4k -2 to -3% (its longest-first walk of each
// sequence): the entries order there.
inline bool fwd_list_heads_order(const FwdParams& p) {
  if (p.row_block_list_order != FwdRowBlockListOrder::kAuto) {
    return p.row_block_list_order == FwdRowBlockListOrder::kHeads;
  }
  if (p.is_causal || p.is_local || p.mask_mod.kind != 0 || p.block_sparse.enabled) return false;
  long long const kv_bytes_per_sequence =
      (long long)typical_seqlen_k(p) * p.num_heads_kv * (p.head_dim + p.head_dim_v) * 2;
  return kv_bytes_per_sequence >= kFwdKvL2BudgetBytes;
}

// Whether a call needs the flex kernels (variants::FlexVariant): a score_mod, a mask_mod or block
// lists. FwdParams and BwdParams alike.
template <class Params>
inline bool needs_flex(const Params& p) {
  return p.score_mod.kind != 0 || p.mask_mod.kind != 0 || p.block_sparse.enabled;
}

// Bumped with every change: the layout version and the sizes of the structures a
// launcher compiled at run time reads (the library and such a module must agree on them).
constexpr std::uint64_t params_abi_tag() {
  return (kParamsLayoutVersion << 56) ^ (std::uint64_t(sizeof(FwdParams)) << 40) ^
         (std::uint64_t(sizeof(BwdParams)) << 20) ^ std::uint64_t(sizeof(ModParams));
}

}  // namespace cuflash
