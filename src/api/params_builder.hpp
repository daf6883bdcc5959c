// Fills the plain kernel parameter structs (api/params.hpp) from checked arguments: strides,
// sequence lengths, defaults and the normalisation of causal / window options.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "api/params.hpp"
#include "api/validate.hpp"
#include "cuflash/options.hpp"

namespace cuflash::detail {

// Causal / local after the seed's normalisation: `causal` sets window_right = 0, and a window
// with an unbounded left side and window_right == 0 is causal. Negative sides are unbounded.
struct MaskWindow {
  bool is_causal = false;
  bool is_local = false;
  int window_left = -1;
  int window_right = -1;
};
MaskWindow normalize_window(bool causal, int window_left, int window_right);

float default_softmax_scale(std::int64_t head_dim);  // 1 / sqrt(head_dim)

// Everything but num_sm, the split count and its buffers (device facts, set by dispatch).
FwdParams make_fwd_params(const ForwardArgs& args, const AttentionShape& shape);
BwdParams make_bwd_params(const BackwardArgs& args, const AttentionShape& shape);
CombineParams make_combine_params(const CombineArgs& args, const CombineShape& shape);

// pack_gqa=None: pack a GQA group's query heads into the forward's tiles when that fills the
// 128-row tiles at least 10% better than one head per tile (short query lengths). Not for
// callables compiled at run time (their module's form is fixed before the call: packed only when
// asked), nor for block lists that packed tiles cannot read (block_lists_refuse_packing).
bool choose_pack_gqa(const FwdParams& params);

// Rows of the sm90 flex forward tile (sm90/tile_size_sm90.hpp; dispatch asserts it).
inline constexpr int kFlexFwdTileRows = 128;

// Why block lists cannot drive packed GQA tiles, or "" when they can. A packed flex tile holds
// kFlexFwdTileRows / group query rows of every head of its group: the lists must be the same
// for all heads (broadcast, head dim 1) and a list row block must hold whole packed tiles.
std::string block_lists_refuse_packing(const FwdParams& params);

// A built-in causal or sliding-window mask_mod alone (no score_mod, block lists or kernel
// compiled at run time) on dense sequences of one length (seqlen_q == seqlen_k; no cu_seqlens,
// seqused or page table) is a window: its top-left alignment is then the options' bottom-right
// one. Folded here into causal / window (intersected with the call's own), so the call runs on
// the plain kernels, which mask by position instead of evaluating the mask_mod per element.
// Returns whether it folded (params unchanged otherwise).
bool fold_window_mask_mod(FwdParams& params);
bool fold_window_mask_mod(BwdParams& params);

// Document masks (MaskModKind::kDocument) without block lists of the caller's: dispatch builds
// block lists from the ids on the GPU (sm90::build_document_block_lists; 128 x 128 blocks, one
// list for all heads), so that the flex kernels visit only the blocks whose rows and keys can
// share a document and skip the per-element check where all are one document. Not for kernels
// compiled at run time (`expression_kernel`), nor for packed sequences given without
// max_seqlen_q / max_seqlen_k (the longest may be unknown; the lists would then count total_q /
// total_k positions per sequence).
inline constexpr int kDocumentListBlock = 128;
bool document_lists_apply(const AttentionOptions& opts, const SequenceLayout& seq,
                          const AttentionShape& shape, std::uintptr_t expression_kernel);
// The lists' shape in `bs` (enabled, block sizes, counts, broadcast over heads; forward row-block
// lists, which the backward tabulates as it does a caller's); the pointers come with the build.
void plan_document_block_lists(BlockSparseParams& bs, const AttentionShape& shape, bool backward);

// num_splits <= 0 picks the split-KV heuristic of the seed (one split for short keys, else as
// many as fill the SMs, at most 128); the result is in [1, kMaxSplits].
int choose_num_splits(const FwdParams& params, int requested, int num_sm);

// Split-KV buffers, fp32: out_partial (splits, rows, H, Dv) then lse_partial (splits, rows, H).
std::size_t split_kv_workspace_bytes(const FwdParams& params);
void assign_split_kv_buffers(FwdParams& params, void* workspace);

// How the sm90 forward schedules tiles of unequal cost (fwd_tiles_unequal): dynamically, with
// a tile counter in the workspace, or with one CTA per tile.
enum class FwdScheduler { kDynamic, kOnePerTile };
// "dynamic" or "one_per_tile"; null or empty: kDynamic. Throws kInvalidArgument otherwise.
FwdScheduler parse_fwd_scheduler(const char* value);
// The process's choice, from CUFLASH_FWD_SCHEDULER, read once.
FwdScheduler fwd_scheduler();

// Whether the sm90 forward's static schedule may end in a stream-K tail (fwd_stream_k_eligible,
// sm90/stream_k_sm90.hpp): kAuto where the cost model says it pays, kOff never, kAlways wherever
// more CTAs than tail tiles can share it (tests, timing).
enum class FwdStreamK { kAuto, kOff, kAlways };
// "auto", "off" or "always"; null or empty: kAuto. Throws kInvalidArgument otherwise.
FwdStreamK parse_fwd_stream_k(const char* value);
// How many CTAs share the stream-K tail of this call's forward (sm90::stream_k_tail_ctas for the
// tile the plain kernel runs, on params.num_sm SMs); 0: none (not eligible, off, or no gain).
int fwd_stream_k_ctas(const FwdParams& params, FwdStreamK setting);
// The same under CUFLASH_FWD_STREAM_K, read at each call (a test can set it around one call).
int fwd_stream_k_ctas(const FwdParams& params);
// Device bytes of the stream-K tail's counters and flags, and of its partial states, for the
// plain kernel of params' head dims on params.num_sm SMs.
std::size_t stream_k_sync_bytes(const FwdParams& params);
std::size_t stream_k_partial_bytes(const FwdParams& params);

// Whether the sm90 forward zeroes the V rows past the keys of each tile's boundary block
// (FwdParams::zero_v_tail): kAuto where the kernel may read rows past the keys that the caller
// never filled (seqused_k, paged KV, cu_seqlens_k), kOff, kOn.
enum class FwdZeroVTail { kAuto, kOff, kOn };
// "auto" (or null / empty), "0" or "1". Throws kInvalidArgument otherwise.
FwdZeroVTail parse_fwd_zero_v_tail(const char* value);
// FwdParams::zero_v_tail for a call under `setting`: kAuto zeroes with seqused_k, a page table
// or cu_seqlens_k.
bool resolve_fwd_zero_v_tail(FwdZeroVTail setting, const FwdParams& params);
// The choice from CUFLASH_FWD_ZERO_V_TAIL (read at every call) resolved for `params`.
bool fwd_zero_v_tail(const FwdParams& params);

// Whether device calls read their index tensors in device memory (cu_seqlens, seqused, page
// table, block lists) back to the host and check them as host ones
// before any kernel runs: "0" (or null / empty) or "1". A synchronisation per call: for
// debugging. Throws kInvalidArgument otherwise.
bool parse_check_inputs(const char* value);
// The choice from CUFLASH_CHECK_INPUTS, read at every call.
bool check_inputs_on_host();

// Which of a forward kernel and its twin for short work runs (FwdParams::short_kernel): "auto"
// (or null / empty), "long" or "short". Throws kInvalidArgument otherwise.
FwdShortKernel parse_fwd_short_kernel(const char* value);
// The process's choice, from CUFLASH_FWD_SHORT_KERNEL, read once.
FwdShortKernel fwd_short_kernel();

// Whether the varlen forward walks its row-block list (FwdParams::row_block_list_mode): "auto"
// (or null / empty), "off" or "always". Throws kInvalidArgument otherwise.
FwdRowBlockList parse_fwd_row_block_list(const char* value);
// The process's choice, from CUFLASH_FWD_ROW_BLOCK_LIST, read once.
FwdRowBlockList fwd_row_block_list();
// The order of the forward's walk of that list (FwdParams::row_block_list_order): "auto" (or
// null / empty), "entries" or "heads". Throws kInvalidArgument otherwise.
FwdRowBlockListOrder parse_fwd_row_block_list_order(const char* value);
// The process's choice, from CUFLASH_FWD_ROW_BLOCK_LIST_ORDER, read once.
FwdRowBlockListOrder fwd_row_block_list_order();

// Whether the varlen backward walks its block lists (BwdParams::block_list): "auto" (or null /
// empty), "off" or "always". Throws kInvalidArgument otherwise.
BwdBlockList parse_bwd_block_list(const char* value);
// The process's choice, from CUFLASH_BWD_BLOCK_LIST, read once.
BwdBlockList bwd_block_list();

// Launch order of the backward main kernel's CTAs (BwdParams::launch_order, launch_head_group):
// "auto" (or null / empty), "columns", "heads" or "heads:G" (G >= 1 heads at a time). Throws
// kInvalidArgument otherwise.
BwdLaunchChoice parse_bwd_order(const char* value);
// The process's choice, from CUFLASH_BWD_ORDER, read once.
BwdLaunchChoice bwd_launch_order();

// The dQ path of the sliced hdim256 backward (BwdParams::dq_path): "auto" (or null / empty),
// "atomics" or "bulk". Throws kInvalidArgument otherwise.
BwdDqPath parse_bwd_dq_path(const char* value);
// The process's choice, from CUFLASH_BWD_DQ, read once.
BwdDqPath bwd_dq_path();

// When the backward converts dQ (BwdParams::dq_convert): "overlap" (or null / empty) or
// "after". Throws kInvalidArgument otherwise.
BwdDqConvert parse_bwd_dq_convert(const char* value);
// The process's choice, from CUFLASH_BWD_DQ_CONVERT, read once.
BwdDqConvert bwd_dq_convert();

// How the backward's dq_accum starts from zero (BwdParams::dq_clear): "auto" (or null /
// empty), "first" or "memset". Throws kInvalidArgument otherwise.
BwdDqClear parse_bwd_dq_clear(const char* value);
// The process's choice, from CUFLASH_BWD_DQ_CLEAR, read once.
BwdDqClear bwd_dq_clear();

// Where the deterministic backward's walks start (BwdParams::det_walk): "auto" (or null /
// empty), "waves" or "ascending". Throws kInvalidArgument otherwise.
BwdDetWalk parse_bwd_det_walk(const char* value);
// The process's choice, from CUFLASH_BWD_DET_WALK, read once.
BwdDetWalk bwd_det_walk();

// Where the deterministic backward's dQ semaphores lie: "packed" (or null / empty) or "lines".
// Throws kInvalidArgument otherwise.
BwdDqSemaphores parse_bwd_dq_semaphores(const char* value);
// The process's choice, from CUFLASH_BWD_DQ_SEMAPHORES, read once; and the BwdParams stride
// (ints between row blocks' semaphores) it means.
BwdDqSemaphores bwd_dq_semaphores();
int dq_semaphore_stride(BwdDqSemaphores choice);

// The forward's whole workspace: the split-KV buffers, then (tiles of unequal cost, dynamic
// scheduling) the tile counter in a 256-byte slot of its own, then (equal tiles, stream-K not
// off) the stream-K tail's counters and partial states, then (packed queries of more than one
// sequence) the varlen row-block list.
std::size_t forward_workspace_bytes(const FwdParams& params, FwdScheduler scheduler);
void assign_forward_workspace(FwdParams& params, void* workspace, FwdScheduler scheduler);

// Merge of a split forward's partial buffers into its out / lse.
CombineParams make_split_combine_params(const FwdParams& params, const ForwardArgs& args,
                                        const AttentionShape& shape);

}  // namespace cuflash::detail
