// How the sm90 backward's fp32 dq_accum starts, and where the column blocks' dQ walks start: the
// rules the launch applies (flash_bwd_launch_sm90.hpp), measured A/B against each other
// (bench/NOTES.md). Host code without CUDA, so that the CPU tests pin every rule.
#pragma once

#include <cstdint>

#include "api/params.hpp"

namespace cuflash::sm90::bwd {

// What the rules read of a call and of the kernel that runs it.
struct DqAccumCall {
  bool dq_via_smem = false;      // the kernel's whole dQ tile leaves through shared memory (kDqViaSmem)
  bool dq_bulk = false;          // the sliced hdim256 kernels' bulk dQ, in use for this call
  bool kernel_window = false;    // the kernel is compiled with a window (causal / local / flex mods)
  bool flex = false;             // a score_mod / mask_mod / block-list kernel
  bool block_lists = false;      // the call has block lists (BlockSparseParams::enabled)
  bool causal_or_local = false;  // the call's mask
  bool causal = false;           // causal (a local window without causal is not)
  // A local window bounded on both sides (not causal): the keys a row sees besides its own,
  // window_left + window_right; -1 otherwise (no window, causal, or a side unbounded).
  std::int64_t window_keys = -1;
  bool deterministic = false;
  int head_dim = 0;  // the kernel's (compile-time) head dim
  int num_sm = 0;  // 0: unknown (the walks then ascend, which never waits on a later launch)
  int batch = 0;
  int num_heads = 0;
  // A sequence's row / column blocks: by the longest sequence, or by the mean where the lengths
  // are only bounded by the totals (typical_seqlen_q / typical_seqlen_k, api/params.hpp).
  int num_m_blocks = 0;
  int block_m = 0;  // rows of a row block (the kernel's tile)
  int num_n_blocks = 0;
  // The main kernel's CTAs (a column-block list's entries x num_heads, or the rectangle's; the
  // grid without heads inner, which only windows take, and rotation has none); 0: num_n_blocks x
  // num_heads x batch, for calls whose lengths are the real ones.
  std::int64_t main_ctas = 0;
  BwdDqClear clear = BwdDqClear::kAuto;
  BwdDetWalk det_walk = BwdDetWalk::kAuto;
};

// Rotated walks are possible: no window (a window's column blocks reach their row blocks one
// after another anyway), and CTA indices that fit the 31-bit rotation arithmetic (a window's end,
// up to num_sm past the last CTA, included).
inline bool dq_rotation_fits(DqAccumCall const& c) {
  std::int64_t const ctas = c.main_ctas > 0 ? c.main_ctas : std::int64_t(c.num_n_blocks) * c.num_heads * c.batch;
  return !c.kernel_window && !c.flex && c.num_sm > 0 && ctas + c.num_sm < (std::int64_t(1) << 31);
}

// The sliced kernels past this many row blocks keep the memset but in narrow windows (below).
constexpr int kDqBulkFirstStoreMaxRowBlocks = 32;
// Short calls (rows of the padded row blocks) store first, causal or deterministic (below);
// hdim64's causal runs outside deterministic mode up to kDqHdim64CausalFirstStoreMaxRows.
constexpr std::int64_t kDqShortFirstStoreMaxRows = 1024;
constexpr std::int64_t kDqHdim64CausalFirstStoreMaxRows = 8192;
// Local windows (both sides bounded) store first up to this many keys a row sees besides its
// own (window_left + window_right), whatever the length; hdim96 up to 256, deterministic runs at
// hdims 192 / 256 up to 1024, hdim64 outside deterministic mode up to 2048 (below).
constexpr std::int64_t kDqNarrowWindowFirstStoreMaxKeys = 512;
constexpr std::int64_t kDqHdim96NarrowWindowFirstStoreMaxKeys = 256;
constexpr std::int64_t kDqWideHeadDetWindowFirstStoreMaxKeys = 1024;
constexpr std::int64_t kDqHdim64WindowFirstStoreMaxKeys = 2048;

// A first writer's ticket once its store has landed (mainloop_bwd_sm90.hpp, dq_ticket_land); a
// ticket set to it before the main kernel (flash_bwd_dq_clear_sm90.hpp) says the row block was
// cleared, so that every writer adds.
constexpr int kDqTicketLanded = 1 << 30;

// DqAccumCall::window_keys of a call's mask (BwdParams' is_local, window_left, window_right):
// both sides bounded, or -1. Causal calls carry none (a causal call with a left window arrives
// as local (L, 0), api/params_builder.cpp normalize_window).
inline std::int64_t dq_window_keys(bool is_local, int window_left, int window_right) {
  if (!is_local || window_left < 0 || window_right < 0) { return -1; }
  return std::int64_t(window_left) + window_right;
}

// The most keys a row may see besides its own for first stores to pay (the limits above), by
// head dim and mode.
inline std::int64_t dq_narrow_window_max_keys(DqAccumCall const& c) {
  return c.head_dim <= 64 && !c.deterministic   ? kDqHdim64WindowFirstStoreMaxKeys
         : c.head_dim == 96                     ? kDqHdim96NarrowWindowFirstStoreMaxKeys
         : c.head_dim >= 192 && c.deterministic ? kDqWideHeadDetWindowFirstStoreMaxKeys
                                                : kDqNarrowWindowFirstStoreMaxKeys;
}

// A local window bounded on both sides whose rows see few keys.
inline bool dq_narrow_window(DqAccumCall const& c) {
  return c.window_keys >= 0 && c.window_keys <= dq_narrow_window_max_keys(c);
}

// The flex kernels with block lists, outside deterministic mode: whether dq_accum starts from
// first stores is decided on the device, from the lists, as dq_narrow_window decides it for a
// window. A list row block whose lists name `writers` column blocks of list_block_n keys sees
// writers * list_block_n keys; first stores where that is within the head dim's narrow-window
// limit (dq_narrow_window_max_keys, keys besides a row's own) plus one 128-key block of its own,
// for every row block of the call. Returns that largest number of writers, or 0 where the rule
// does not apply or no writer count could pass (list blocks past the limit): the host rules
// below then decide, and they clear for the flex kernels. The backward's block-row class kernel
// (dispatch_bwd_sm90.cu) counts each row block's writers and their maximum, and
// flash_bwd_dq_clear_sm90 clears dq_accum past the limit. With 128-key list blocks: 5 writers
// at hdims 128 / 192, 3 at hdim96, 17 at hdim64 (the plain kernels' narrow windows: (256, 256)
// is 5 blocks). Measured on the H100 (bf16, 16k tokens, bench/results/
// flex_bwd_v30_list_dq_clear_h100.txt), against the memset at 2k / 8k: sliding window 256 on
// lists +11.9 / +10.4% at hdim128, +5.8 / +5.9% at hdim64, +7.0 / +6.1% at hdim96, +3.2 / +3.4%
// at hdim192; causal and document lists (cleared by the kernel, or at hdim64 2k causal first
// stores with 16 writers) within -0.9% to +0.8% of the memset.
constexpr std::int64_t kDqListOwnBlockKeys = 128;
inline int dq_list_max_writers(DqAccumCall const& c, int list_block_n) {
  if (!c.flex || !c.block_lists || !c.dq_via_smem || c.deterministic || c.clear != BwdDqClear::kAuto ||
      list_block_n <= 0) {
    return 0;
  }
  return int((dq_narrow_window_max_keys(c) + kDqListOwnBlockKeys) / list_block_n);
}

// dq_accum from the first writers' stores (true) or cleared by a memset (false), where the device
// does not decide (dq_list_max_writers 0). Only where dQ leaves by bulk copies, through shared
// memory. The first stores save the memset (a fixed cost per
// token) and cost tickets and waits (which grow with a head's work); later writers wait for a
// first store wherever a head's column blocks reach a row block together. Auto, from A/B runs
// against the memset (bench/NOTES.md, runs of 2026-12-05 twenty-second / twenty-third and
// 2026-12-06 twenty-fourth / twenty-fifth):
// - the sliced kernels' bulk dQ (hdim256) with a window, causal included: first stores, +3% at
//   2k on the H100 (+5.9% before later changes) where the column blocks reach a row block one
//   after another, deterministic too (+2.4-3%);
// - without a window and not deterministic: first stores where the walks rotate over whole heads
//   (a head's column blocks fit on the GPU at once and are no more than its row blocks), so that
//   the writers after the first find its store landed; +0.4-2.2% at 2k / 4k for hdims 64-256 on
//   the H200. Unrotated, non-causal lost 3.5-9%;
// - deterministic runs at head dim 128 (one dQ warp per CTA, store_dq_loop): first stores, with
//   a window or without, +2.2% non-causal and +6.5% causal at 2k, 0 / +3.1% at 8k (H100, passes
//   alternating, after the acquired turn peek of 2026-12-06; before it they lost 1-3.6%). Rank 0
//   stores what it would have added to zeros, so the sums and their order are the memset's (only
//   a row block with one contributor can keep a -0 or a subnormal that the bulk add would flush;
//   the bits repeat run to run either way). Timed dense, bf16; not the flex kernels (their ranks
//   come from the block lists; not measured);
// - causal runs at head dims 64 / 96 / 128 (one dQ warp per CTA) up to 1k rows, and at hdim64
//   outside deterministic mode up to 8k rows: there the memset is a large part of a short call.
//   H100, bf16, 16k tokens, two passes each way alternating, first against the memset: not
//   deterministic, hdim64 +13 / +8.4 / +5.6 / +3.2 / +2.4% at 512 / 1k / 2k / 4k / 8k, hdim96
//   +8.5 / +2.9 / +0.8 / -0.5 / -1.7%, hdim128 +14.8 / +6.4 / -3.6 / -7.6 / -8.1%; deterministic,
//   hdim64 +7 / +2.8 / -2.7 / -6.9 / -4.2%, hdim96 +13 / +9.1 / 0 / -1.2 / -2.6%. Past those
//   lengths the later writers' waits for the first store cost more than the memset. hdim192
//   (its plain kernels' dQ goes through shared memory too) up to 1k rows: +13 / +4.5% at 512 /
//   1k, deterministic +14 / +7.7%, -1.8 / -4.6 / -5.2% at 2k / 4k / 8k (one pass each way);
// - local windows bounded on both sides (dq_narrow_window) up to 512 keys a row sees besides its
//   own, deterministic or not, at any length and every head dim (hdim96 up to 256): a row block
//   has few writers, and the memset is a fixed cost per row while a row's work is the window's.
//   H100, bf16, 16k tokens, two passes each way alternating (bench/results/
//   bwd_v29_window_dq_clear_h100.txt), window (256, 0) / (256, 256), first stores against the
//   memset at 512 / 2k / 8k: hdim64 +14.5 / +13.6 / +10.9% and +7.5 / +8.2 / +8.4%, hdim128
//   +16.4 / +10.5 / +12% and +4.6 / +4.2 / +7.2%, hdim192 +14.6 / +11.7 / +11.3% and +2.0 /
//   +2.5 / +3.6%; deterministic hdim64 +9.3 / +7.1 / +5.8% and +2.8 / +1.2 / +1.2%, hdim192
//   +19 / +12.3 / +9.9% and +0.6 / +4.5 / +4.8%; hdim96 +10.1 / +9.9 / +9.0% but -1.2 / +2.1 /
//   -0.7% (deterministic -3.3 / +2.8 / +5.7%), so hdim96 to 256 keys; the sliced hdim256 kernels
//   at 4k / 8k / 16k (past their 32 row blocks) +12.8 / +13.0 / +12.2% and +5.1 / +6.1 / +4.6%,
//   deterministic +8.8-13.2%. Wider windows, one pass each way: (1024, 0) / (1024, 1024) at 2k
//   / 8k, hdim64 +6.6 / +5.2% and +3.8 / +3.4% (so hdim64 outside deterministic mode up to 2048
//   keys), deterministic -0.5 / -2.5% and -5.9 / -6.1%; hdim128 +0.3 / -2.4% and -0.1 / +1.3%;
//   hdim192 +1.4 / -1.6% and -7.8 / -5.0%, deterministic +4.1 / +4.1% and -1.5 / +0.6%; hdim256
//   at 4k / 16k, (512, 0) +7.1 / +5.6%, (512, 512) +0.8 / -2.6%, (1024, 0) +2.2 / -0.5%,
//   (1024, 1024) -2.1 / +1.0%, deterministic +9.3 / +9.6%, +3.8 / +4.5%, +4.8 / +4.6%, +1.0 /
//   +0.5%. Deterministic (1024, 0) again at 4k / 16k, two passes each way: hdim192 +4.0 / +3.2%,
//   hdim256 +4.7 / +4.5% (so deterministic hdims 192 / 256 up to 1024 keys; outside
//   deterministic mode the same calls -0.5 / +1.4% and +3.3 / -0.6%): the memset past the limits;
// - deterministic runs without a window up to 1k rows at head dims 64 / 96 / 128 / 192 / 256:
//   hdim64 +5.8 / +1.0 / -2.9% at 512 / 1k / 2k, hdim96 +7.6 / +2.8 / -0.7%, hdim256 +8.2 /
//   +4.2 / +0.6% (H100, bf16, 16k tokens, two passes each way alternating); hdim192 +6.7 / +5.3
//   / +2.3% and -0.3 / +0.2% at 4k / 8k (one pass each way);
// - deterministic runs at the other head dims keep the memset otherwise (hdim64: first
//   stores -3% / -6% non-causal, -2.7% / -5.6% causal at 2k / 8k; hdim96 deterministic
//   non-causal: +1.5% at 2k, -2.7% at 8k; the sliced hdim256 kernels as below);
// - the sliced kernels past 32 row blocks (2k rows at hdim256) keep the memset but in narrow
//   windows (above): there first stores measured 0.5-5% slower in every case (4k / 8k / 16k,
//   causal or not, deterministic or not; H100, passes alternating).
inline bool dq_first_stores(DqAccumCall const& c) {
  if (!c.dq_via_smem && !c.dq_bulk) { return false; }
  if (c.clear != BwdDqClear::kAuto) { return c.clear == BwdDqClear::kFirstStore; }
  // The flex kernels clear here: with block lists outside deterministic mode the device decides
  // (dq_list_max_writers); deterministic runs on lists measured mixed (twenty-eighth run); and
  // none of them has the sliced bulk dQ (their hdim256 tile adds dQ by atomics), so no clause
  // below would apply to them.
  if (c.flex) { return false; }
  if (dq_narrow_window(c)) { return true; }
  if (c.dq_bulk && c.num_m_blocks > kDqBulkFirstStoreMaxRowBlocks) { return false; }
  if (c.dq_bulk && c.causal_or_local) { return true; }
  if (c.deterministic && c.dq_via_smem && c.head_dim == 128) { return true; }
  if (c.block_m > 0) {
    std::int64_t const rows = std::int64_t(c.num_m_blocks) * c.block_m;
    bool const short_call = rows <= kDqShortFirstStoreMaxRows;
    // The kernels timed: dQ through shared memory at hdims 64 / 96 / 128 / 192, and the sliced
    // hdim256 kernels' bulk dQ (their causal runs are above).
    bool const timed_smem = c.dq_via_smem && c.head_dim <= 192;
    bool const hdim64_causal = c.head_dim <= 64 && !c.deterministic && rows <= kDqHdim64CausalFirstStoreMaxRows;
    if (timed_smem && c.causal && (short_call || hdim64_causal)) { return true; }
    if ((timed_smem || c.dq_bulk) && c.deterministic && !c.kernel_window && short_call) { return true; }
  }
  return !c.deterministic && dq_rotation_fits(c) && c.num_n_blocks <= c.num_sm &&
         c.num_n_blocks <= c.num_m_blocks;
}

// The rotation window of the walks (MainloopBwdSm90::Params::dq_rotate_window; 0: ascending).
// Deterministic or first stores, no window: a head's column blocks launched in one window of
// num_sm consecutive CTAs start their walks spread over the row blocks and add after the blocks
// of the windows before (rotation_group), so a wave of CTAs never waits on the next. Auto rotates
// where a head's column blocks fit on the GPU at once and walks ascending otherwise, where rotated
// starts spread a wave's Q / dO reads over more rows than L2 holds. Measured on the H200,
// non-causal, deterministic / non-deterministic (bench/NOTES.md, "Run of 2026-12-02 (fifth)"):
// hdim256 2k-8k 0.87-0.88 rotated against 0.76-0.87 with one rotation per head or ascending, 16k
// 0.90 ascending against 0.82 rotated; hdim128 within 1% at 2k-8k, +2% at 16k.
// CUFLASH_BWD_DET_WALK=waves / ascending overrides auto. Not deterministic, the walks rotate
// wherever dq_accum starts from first stores, in the same windows; nothing waits on a later
// launch there (a writer waits only for a first writer's store, see kDqTicketLanded), so any
// window is safe.
inline int dq_rotate_window(DqAccumCall const& c, bool first_stores) {
  bool const applies = (c.deterministic || first_stores) && dq_rotation_fits(c);
  bool const wanted = !c.deterministic || c.det_walk == BwdDetWalk::kWaves ||
                      (c.det_walk == BwdDetWalk::kAuto && c.num_n_blocks <= c.num_sm);
  return applies && wanted ? c.num_sm : 0;
}

}  // namespace cuflash::sm90::bwd
