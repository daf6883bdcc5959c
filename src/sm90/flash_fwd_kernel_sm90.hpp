// Warp-specialised forward kernel entry for Hopper.
// Warpgroup 0 is the producer (TMA loads; it gives registers back with setmaxnreg), the
// other kNumMmaWarpGroups warpgroups are consumers (WGMMA, softmax, epilogue; they take the
// registers). See mainloop_fwd_sm90.hpp for the pipeline and the pingpong schedule.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>

#include <cmath>
#include <cute/tensor.hpp>
#include <cutlass/pipeline/pipeline.hpp>
#include <type_traits>

#include "api/params.hpp"
#include "cuflash/tensor.hpp"
#include "sm90/epilogue_fwd_sm90.hpp"
#include "sm90/flex_sm90.hpp"
#include "sm90/mainloop_fwd_sm90.hpp"
#include "sm90/mask.hpp"
#include "sm90/pack_gqa_sm90.hpp"
#include "sm90/seqlen_info.hpp"
#include "sm90/softmax.hpp"
#include "sm90/stream_k_sm90.hpp"
#include "sm90/tile_scheduler_sm90.hpp"
#include "sm90/tile_size_sm90.hpp"
#include "sm90/trace_sm90.hpp"
#include "variants/variant.hpp"

namespace cuflash::sm90 {

// Variant_: variants::NoVariant (plain) or variants::FlexVariant (score_mod, mask_mod, block
// sparsity; softcap is then a runtime choice inside it). kIsPaged_: k/v are pages read through
// a page table (mainloop_fwd_sm90.hpp, load_paged).
// kNarrow_: the second tile of the plain hdim64 kernel (fwd_tile_size).
// kStreamKPieces_: the kernel that runs the stream-K tail's pieces (stream_k_sm90.hpp) after the
// plain kernel has run the whole waves.
// kSingleQ_: one Q buffer, without the next tile's first Q K^T under the epilogue, in a kernel
// that would have it (mainloop_fwd_sm90.hpp, kQStages): the hdim128 kernels' tiles of few
// n-blocks (fwd_next_qk_pays).
template <class Element_, int kHeadDim_, int kHeadDimV_, bool kHasSoftcap_, bool kIsSplit_,
          class Variant_ = variants::NoVariant, bool kIsPaged_ = false, bool kPackGqa_ = false,
          bool kNarrow_ = false, bool kStreamKPieces_ = false, bool kSingleQ_ = false>
struct FwdConfig {
  using Element = Element_;
  using Variant = Variant_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr bool kHasSoftcap = kHasSoftcap_;
  static constexpr bool kIsSplit =
      kIsSplit_;  // split-KV: fp32 partial outputs for the combine kernel
  static constexpr bool kIsPaged = kIsPaged_;
  static constexpr bool kPackGqa = kPackGqa_;  // packed GQA tiles (pack_gqa_sm90.hpp)
  static constexpr bool kNarrow = kNarrow_;
  static constexpr bool kStreamKPieces = kStreamKPieces_;
  static constexpr bool kSingleQ = kSingleQ_;
  static constexpr FwdTileSize kTile =
      fwd_tile_size(kHeadDim, kHeadDimV, Variant::kIsFlex, kHasSoftcap, kNarrow_);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kNumMmaWarpGroups = kBlockM / 64;
};

// The kernel of a config's stream-K tail pieces (one Q buffer either way, so kSingleQ is dropped:
// one pieces' kernel serves both).
template <class Config>
using StreamKPiecesConfig =
    FwdConfig<typename Config::Element, Config::kHeadDim, Config::kHeadDimV, Config::kHasSoftcap,
              Config::kIsSplit, typename Config::Variant, Config::kIsPaged, Config::kPackGqa,
              Config::kNarrow, /*kStreamKPieces=*/true>;

// Whether this tile's boundary block needs its V rows past the keys zeroed: with seqused_k or
// pages every sequence's may be unfilled; with cu_seqlens alone the rows past a sequence are the
// next one's keys, and only the last sequence runs past them into rows the caller may not own.
CUTLASS_DEVICE bool zero_v_tail(FwdParams const& p, FwdTile const& tile) {
  return p.zero_v_tail && (p.seqused_k != nullptr || p.page_table != nullptr || tile.batch == p.batch - 1);
}

template <class Config>
struct FlashFwdKernelSm90 {
  using Element = typename Config::Element;
  using Mainloop = MainloopFwdSm90<Config>;
  using Epilogue = EpilogueFwdSm90<Config>;
  using Scheduler = PersistentTileSchedulerSm90;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kNumMmaWarpGroups = Config::kNumMmaWarpGroups;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kNumThreads = kNumMmaThreads + cutlass::NumThreadsPerWarpGroup;
  static constexpr bool kIsSplit = Config::kIsSplit;
  using Variant = typename Config::Variant;
  static constexpr bool kIsFlex = Variant::kIsFlex;
  static constexpr bool kIsPaged = Config::kIsPaged;
  static constexpr bool kPackGqa = Config::kPackGqa;
  static_assert(!(kIsFlex && Config::kHasSoftcap), "the flex variant has softcap built in");
  static_assert(kNumMmaWarpGroups == 2 || kNumMmaWarpGroups == 3,
                "register split and pingpong below: two or three MMA warpgroups");
  // 64K registers per SM and one CTA per SM: the launch gives each thread 65536 / kNumThreads
  // (rounded down to a multiple of 8: 168 at 384 threads, 128 at 512), and setmaxnreg moves
  // them from the producer warpgroup to the MMA warpgroups. Two MMA warpgroups: producer 24,
  // MMA 240. Paged kernels may gather rows with the whole producer warpgroup (page-table reads,
  // 64-bit addresses), which needs more: 40 and 232, except at hdim 256 whose consumers spill
  // at 232. Three: MMA 160 (168 x 384 alone would leave the producer nothing), producer 24, or
  // 32 when gathering (32 x 128 + 160 x 384 is the whole 64K).
  static constexpr uint32_t kLaunchRegisters = 65536 / kNumThreads / 8 * 8;
  static constexpr uint32_t kLoadRegisters = Mainloop::kLoadRegisters;
  static constexpr uint32_t kMmaRegisters =
      kNumMmaWarpGroups == 3 ? 160 : (kLoadRegisters == 24 ? 240 : 232);
  static_assert(kLoadRegisters * cutlass::NumThreadsPerWarpGroup + kMmaRegisters * kNumMmaThreads <=
                    kLaunchRegisters * kNumThreads,
                "the register split fits the launch's allocation");
  // Each thread of a WGMMA accumulator holds two rows of its warpgroup's 64.
  static constexpr int kRowsPerThread = 2;
  // The running max moves only by more than 2^8 (OnlineSoftmax), and a warp whose rows all kept
  // theirs skips the rescale of O: per score that is one FMUL at head dim 128, 1.7 at 192 and 3.2
  // at 256 in the plain tiles (O's registers over S's; 4 in the hdim256 flex tile, 64 keys wide).
  // Measured (bench/NOTES.md): plain hdim128 +0.8 / +1.6% at 4k / 8k non-causal, 2k and causal
  // within noise; plain hdim192 +1.5-2.8%, hdim256 +2.9-4.9%, causal and not; the hdim256 flex
  // kernel (built-in mods) on document lists +2.1-3.0%. The plain kernels' softcap, split, paged
  // and packed variants have it too (tested, not timed; ptxas spills no more there). It lost
  // about 1% at head dim 64 (half an FMUL per score) and 1-1.5% in the hdim128 flex kernels on
  // block lists. Not run with it, so without it: (192, 128), the hdim192 flex kernels, the split,
  // paged and packed hdim256 flex kernels, and the kernels compiled at run time for callables.
  static constexpr bool kLazyRescalePlain =
      !Variant::kIsFlex && Config::kHeadDimV >= 128 && Config::kHeadDim == Config::kHeadDimV;
  static constexpr bool kLazyRescaleFlex =
      std::is_same_v<Variant, variants::FlexVariant> && Config::kHeadDim == 256 &&
      Config::kHeadDimV == 256 && !kIsSplit && !kIsPaged && !kPackGqa;
  static constexpr int kLazyRescaleLog2 = kLazyRescalePlain || kLazyRescaleFlex ? 8 : 0;

  // The varlen list's heads order (CUFLASH_FWD_ROW_BLOCK_LIST_ORDER=heads) up to head dim 128:
  // its decode in every kernel made the plain hdim256 one spill 8 bytes (ptxas), and the
  // working set it shrinks is largest at the small head dims. Larger ones walk the entries order.
  static constexpr bool kListHeadsOrder = Config::kHeadDimV <= 128;

  // O gets its own buffer when it fits, so the next tile's Q can land while this tile's
  // epilogue runs; otherwise it reuses Q's.
  static constexpr int kSmemBytesO =
      cute::cosize_v<typename Epilogue::SmemLayoutO> * int(sizeof(Element));
  static constexpr bool kSeparateO =
      int(sizeof(typename Mainloop::TensorStorage)) + kSmemBytesO + 1024 <= 227 * 1024;
  // Dynamic tile scheduling (tile_scheduler_sm90.hpp) for tiles of unequal cost, where it pays:
  // - not in the paged kernels: their producer warpgroup, which may gather K/V with every
  //   thread, is at its register limit, and the handoff's state spills there;
  // - not where O reuses Q's buffer (hdim 192 / 256): the next tile's Q cannot land under the
  //   epilogue, so a persistent CTA gains nothing to pay for the counter round trip; measured at
  //   hdim256 causal, 541-683 TFLOP/s (0.98-1.03x cuDNN) dynamic against 582-769 (1.05-1.17x)
  //   one CTA per tile (bench/NOTES.md, Version 7).
  // The others run such tiles one CTA per tile (flash_fwd_launch_sm90.hpp).
  static constexpr bool kDynamicScheduling = !kIsPaged && kSeparateO;
  // The stream-K tail (stream_k_sm90.hpp) of the static persistent schedule, in the kernels whose
  // calls can have tiles of equal cost and whose tiles the epilogue writes whole, at the tiles
  // where its merge fits in the registers (fwd_stream_k_tile). The plain kernel then runs the
  // whole waves (tiles below dp_tiles) and a second kernel, this one with kStreamKTail, the tail's
  // pieces: with the pieces' code in the plain kernel its main loop ran 2-4% slower (bench/NOTES.md).
  static constexpr bool kStreamKEligible = !kIsSplit && !kIsPaged && !kPackGqa && !kIsFlex &&
                                           fwd_stream_k_tile(Config::kTile, Config::kHeadDim,
                                                             Config::kHeadDimV);
  static constexpr bool kStreamKTail = Config::kStreamKPieces;
  // The rows' finalize (sums, sink, log-sum-exp) runs under the tile's last P V (mma's
  // under_last_pv) rather than after it: 1-2% at hdim128 2k (bench/NOTES.md). Not in the
  // stream-K pieces' kernel, whose state changes at the meet after the mainloop, nor in packed
  // kernels whose O shares Q's buffer (hdim 192 / 256), where the per-row head lookups it then
  // holds across the GEMM added spills (hdim256 softcap packed: 60 / 88 bytes against 48 / 72).
  static constexpr bool kFinalizeUnderLastPv = !kStreamKTail && (kSeparateO || !kPackGqa);
  // Each warpgroup issues the next tile's first Q K^T under its last P V, before this tile's
  // finalize and epilogue, so that the tensor cores have it while those run (the mainloop's second
  // Q buffer, kQStages: hdim 128 plain and softcap, bench/NOTES.md).
  static constexpr bool kNextQkUnderEpilogue = Mainloop::kQStages > 1;
  static_assert(!kNextQkUnderEpilogue || (kSeparateO && kFinalizeUnderLastPv && !kStreamKTail && !kPackGqa),
                "the next tile's first Q K^T: Q by TMA into its own buffer, O into its own");
  static_assert(!kStreamKTail || (kStreamKEligible && kSeparateO && kNumMmaWarpGroups == 2),
                "the stream-K tail's tiles: two MMA warpgroups, O in its own buffer");
  struct SeparateOStorage {
    cute::array_aligned<Element, cute::cosize_v<typename Epilogue::SmemLayoutO>, 1024> smem_o;
  };
  struct NoOStorage {};
  static_assert(kSeparateO || cute::cosize_v<typename Epilogue::SmemLayoutO> <=
                                  cute::cosize_v<typename Mainloop::SmemLayoutQ>,
                "O reuses Q's shared memory");

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    std::conditional_t<kSeparateO, SeparateOStorage, NoOStorage> epilogue;
    alignas(16) typename Mainloop::QBarriers barrier_q;
    alignas(16) typename Mainloop::PipelineK::SharedStorage pipeline_k;
    alignas(16) typename Mainloop::PipelineV::SharedStorage pipeline_v;
    alignas(16) TileHandoff tile_handoff;  // dynamic scheduling (tile_scheduler_sm90.hpp)
    int stream_k_arrival;                  // stream_k_meet's broadcast
  };
  static constexpr int kSharedStorageBytes = int(sizeof(SharedStorage));

  struct Params {
    typename Mainloop::Params mainloop;
    FwdParams fwd;
    float scale_log2;     // multiplies the (soft-capped) score inside exp2
    float softcap_scale;  // softmax_scale / softcap
    PackGqa packing;  // pack_gqa_sm90.hpp; group 1 when not packed
    Scheduler scheduler;
    // Disabled unless the launch plans a tail: the plain kernel then stops at stream_k.dp_tiles,
    // and the kStreamKTail kernel runs the pieces.
    StreamKTail stream_k;
    typename Variant::Params variant;
    typename Epilogue::Params epilogue;
  };

  // Causal-like masks (the window options; the causal, sliding-window and prefix-LM mask_mods)
  // give the last m-blocks the most keys.
  static bool last_m_blocks_longest(FwdParams const& p) {
    return p.window_right >= 0 || p.window_left >= 0 ||
           (kIsFlex && p.mask_mod.kind >= int(MaskModKind::kCausal) &&
            p.mask_mod.kind <= int(MaskModKind::kPrefixLM));
  }

  // Whether the tiles walk the varlen row-block list (the launch builds it first).
  static bool row_block_list_runs(FwdParams const& p) {
    static_assert(kBlockM >= kFwdRowBlockListMinBlockM, "the list's workspace is sized for taller tiles");
    return fwd_row_block_list_pays(p, kBlockM);
  }

  static Params to_params(FwdParams const& p) {
    bool const has_softcap = p.softcap > 0.f;
    // With softcap or a score_mod the flex variant's accumulators hold final scores
    // (FlexTileMods::score), so only the change to base 2 is left for the exponent; without
    // either they hold <q, k> and the exponent takes the softmax scale as the plain kernel's,
    // which saves a multiply per score (+2-4% on block lists, bench/NOTES.md). Not for a negative
    // scale: the running max is taken before the exponent's scale, so that must be >= 0.
    bool const flex_scale_in_exp = kIsFlex && !has_softcap && p.score_mod.kind == int(ScoreModKind::kNone) &&
                                   p.softmax_scale >= 0.f;
    float const exp_scale = kIsFlex ? (flex_scale_in_exp ? exponent_scale(p.softmax_scale) : 1.f)
                                    : has_softcap ? p.softcap : exponent_scale(p.softmax_scale);
    bool const longest_first = last_m_blocks_longest(p);
    int const pack_group = kPackGqa ? p.num_heads / p.num_heads_kv : 1;
    int const tile_heads = pack_group > 1 ? p.num_heads_kv : p.num_heads;
    // The varlen row-block list (varlen_block_list_sm90.hpp, built by the launch): its entries
    // take the place of the batch, one m-block each, and hold the longest-first order themselves.
    bool const row_block_list = row_block_list_runs(p);
    int const num_m_blocks = row_block_list ? 1 : cute::ceil_div(p.seqlen_q * pack_group, kBlockM);
    int const batch_entries = row_block_list ? int(fwd_row_block_list_entries(p, kBlockM)) : p.batch;
    Scheduler scheduler = Scheduler::make(
        num_m_blocks, tile_heads, batch_entries, kIsSplit ? p.num_splits : 1, longest_first && !row_block_list,
        Scheduler::choose_section_size(
            (long long)p.seqlen_k * (p.head_dim + p.head_dim_v) * (long long)sizeof(Element),
            tile_heads / p.num_heads_kv, tile_heads * batch_entries * (kIsSplit ? p.num_splits : 1)));
    if (row_block_list) {
      scheduler.row_blocks = reinterpret_cast<int2 const*>(p.row_block_list);
      scheduler.listed_entries = fwd_row_block_list_listed(p);
      if (kListHeadsOrder && fwd_list_heads_order(p)) {
        scheduler.list_section_pairs = tile_heads / p.num_heads_kv;
      }
    }
    typename Variant::Params variant = Variant::to_params(p);
    if constexpr (kIsFlex) {
      if (flex_scale_in_exp) variant.score_scale = 1.f;  // the multiply FlexTileMods::score skips
    }
    return {Mainloop::to_params(p),
            p,
            float(M_LOG2E) * exp_scale,
            has_softcap ? p.softmax_scale / p.softcap : 0.f,
            PackGqa{pack_group, cutlass::FastDivmod(pack_group)},
            scheduler,  // tile_counter: set by the launch when it schedules dynamically
            StreamKTail{},
            variant,
            Epilogue::to_params(p)};
  }

  static dim3 grid_shape(Params const& params, int num_sm) {
    return Scheduler::grid_shape(params.scheduler.num_tiles(), num_sm);
  }

  // The sink joins one denominator: with split-KV, that of split 0 (the combine's log-sum-exp
  // then counts it once).
  CUTLASS_DEVICE static float load_sink_log2(FwdParams const& p, FwdTile const& tile, int head) {
    if (p.learnable_sink == nullptr || (kIsSplit && tile.split != 0)) return -INFINITY;
    float sink;
    switch (DType(p.sink_dtype)) {
      case DType::kFloat32:
        sink = static_cast<float const*>(p.learnable_sink)[head];
        break;
      case DType::kBFloat16:
        sink = float(static_cast<cutlass::bfloat16_t const*>(p.learnable_sink)[head]);
        break;
      default:
        sink = float(static_cast<cutlass::half_t const*>(p.learnable_sink)[head]);
        break;
    }
    return sink * float(M_LOG2E);
  }

  using Walk = std::conditional_t<kIsFlex, FlexBlockWalk<kBlockM, kBlockN>, NBlockRange>;
  using TileMods =
      std::conditional_t<kIsFlex, FlexTileMods<Variant, kBlockM, kBlockN, kPackGqa>, NoTileMods>;

  // What one tile needs from the sequence: its lengths and the n-blocks to visit. has_rows is
  // false past the sequence's end (nothing to write); both roles skip such tiles alike.
  struct TileWork {
    SeqlenInfo seqlen;
    FwdMask<kBlockM, kBlockN> mask;
    Walk walk;
    bool has_rows;
    CUTLASS_DEVICE bool has_keys() const { return walk.has_blocks(); }
  };

  CUTLASS_DEVICE static TileMods tile_mods(Params const& params, FwdTile const& tile,
                                           SeqlenInfo const& seqlen) {
    if constexpr (kIsFlex) {
      return {params.variant, tile.batch, tile.head, seqlen.seqlen_q, seqlen.seqlen_k,
              params.packing};
    } else {
      return {};
    }
  }

  CUTLASS_DEVICE static TileWork tile_work(Params const& params, FwdTile const& tile) {
    FwdParams const& p = params.fwd;
    SeqlenInfo seqlen(tile.batch, p.seqlen_q, p.seqlen_k, p.cu_seqlens_q, p.cu_seqlens_k,
                      p.seqused_q, p.seqused_k);
    FwdMask<kBlockM, kBlockN> const mask{seqlen.seqlen_q, seqlen.seqlen_k, p.window_left,
                                         p.window_right, kPackGqa ? params.packing.group : 1};
    // From here on rows are tile rows: packed, pack_group per query row.
    if constexpr (kPackGqa) {
      seqlen.seqlen_q *= params.packing.group;
      seqlen.seqlen_q_range *= params.packing.group;
    }
    bool const has_rows = tile.m_block * kBlockM < seqlen.seqlen_q_range;
    int n_block_min = 0, n_block_max = 0;
    if (has_rows) mask.n_block_range(tile.m_block, n_block_min, n_block_max);
    if constexpr (kIsFlex) {
      // Block lists say which blocks apply mask_mod, so the mask_mod's own block range holds
      // only without them.
      if (!params.variant.block_sparse.enabled && n_block_min < n_block_max)
        tile_mods(params, tile, seqlen).narrow(tile.m_block, n_block_min, n_block_max);
    }
    if constexpr (kIsSplit) {  // an equal share of this row block's n-blocks
      int const per_split = cute::ceil_div(n_block_max - n_block_min, p.num_splits);
      n_block_min += tile.split * per_split;
      n_block_max = min(n_block_max, n_block_min + per_split);
      n_block_min = min(n_block_min, n_block_max);
    }
    if constexpr (kIsFlex) {
      // With block lists, the walk takes the listed blocks inside this split's share. A packed
      // tile's query rows start at its first row over the group (dispatch has the group divide
      // kBlockM, and the lists broadcast over heads).
      int const first_row = tile.m_block * (kPackGqa ? kBlockM / params.packing.group : kBlockM);
      return {seqlen, mask,
              Walk::make(params.variant.block_sparse, tile.batch, tile.head, first_row,
                         n_block_min, n_block_max),
              has_rows};
    } else {
      return {seqlen, mask, Walk{n_block_min, n_block_max}, has_rows};
    }
  }

  // Where a role's walk over the tiles starts and goes on: the scheduler's walk, or (the pieces'
  // kernel) this CTA's pieces. Every role of a CTA makes the same calls.
  CUTLASS_DEVICE static int first_tile(Params const& params, StreamKCursor<kStreamKTail>& cursor,
                                       int num_tiles) {
    if constexpr (kStreamKTail) {
      return cursor.start(params.stream_k, num_tiles);
    } else {
      return int(blockIdx.x);
    }
  }
  CUTLASS_DEVICE static int next_tile(Params const& params, StreamKCursor<kStreamKTail>& cursor,
                                      TileHandoff& ring, int handoff, int index, int num_tiles,
                                      int claimed, bool writer) {
    if constexpr (kStreamKTail) {
      return cursor.next(params.stream_k, num_tiles);
    } else {
      return params.scheduler.template next_tile<kDynamicScheduling>(ring, handoff, index, claimed,
                                                                     writer);
    }
  }

  // A stream-K piece visits its own n-blocks of the tile.
  CUTLASS_DEVICE static TileWork tile_work(Params const& params, FwdTile const& tile,
                                           StreamKCursor<kStreamKTail> const& cursor) {
    TileWork work = tile_work(params, tile);
    if constexpr (kStreamKTail) {
      StreamKPiece const piece = cursor.piece(params.stream_k);
      work.walk = Walk{piece.n_lo, piece.n_hi};
    }
    return work;
  }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem_buf) {
    using namespace cute;
    // The split-KV combine, launched as this kernel's programmatic dependent (run_combine with
    // after_forward), may be scheduled once every CTA has started: its CTAs wait in
    // griddepcontrol.wait for this grid's end and its writes, so only its launch overlaps.
    if constexpr (kIsSplit) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    using PipelineK = typename Mainloop::PipelineK;
    using PipelineV = typename Mainloop::PipelineV;
    using PipelineState = typename Mainloop::PipelineState;
    SharedStorage& storage = *reinterpret_cast<SharedStorage*>(smem_buf);
    FwdParams const& p = params.fwd;
    Scheduler const& scheduler = params.scheduler;
    // With a stream-K tail the plain kernel runs only the whole waves.
    int const num_tiles = kStreamKEligible && !kStreamKTail && params.stream_k.enabled()
                              ? params.stream_k.dp_tiles
                              : scheduler.num_walked_tiles();

    int const warp_group_idx = cutlass::canonical_warp_group_idx();
    int const warp_idx = cutlass::canonical_warp_idx_sync();
    bool const lane_predicate = cute::elect_one_sync();
    // Gathered paged loads: no TMA transaction; each producer thread arrives once its cp.async
    // copies of the stage have landed.
    bool gathers = false;
    if constexpr (kIsPaged) gathers = !params.mainloop.paged.use_tma;
    if (warp_idx == 0 && lane_predicate) {
      Mainloop::prefetch_descriptors(params.mainloop);
      Epilogue::prefetch_descriptors(params.epilogue);
      storage.barrier_q.init();
      // Readers of the tile handoff: every thread that walks the tiles but the writer (the
      // producer's leader).
      storage.tile_handoff.init(kNumMmaThreads + (gathers ? Mainloop::kNumGatherThreads - 1 : 0));
    }
    typename PipelineK::Params pipeline_params_k;
    pipeline_params_k.transaction_bytes = Mainloop::kTmaBytesK;
    pipeline_params_k.role = warp_group_idx == 0 ? PipelineK::ThreadCategory::Producer
                                                 : PipelineK::ThreadCategory::Consumer;
    pipeline_params_k.is_leader = threadIdx.x % cutlass::NumThreadsPerWarpGroup == 0;
    pipeline_params_k.num_consumers = kNumMmaThreads;
    if (gathers) {
      pipeline_params_k.is_leader = false;
      pipeline_params_k.num_producers = Mainloop::kNumGatherThreads;
    }
    typename PipelineV::Params pipeline_params_v = pipeline_params_k;
    pipeline_params_v.transaction_bytes = Mainloop::kTmaBytesV;
    PipelineK pipeline_k(storage.pipeline_k, pipeline_params_k, Shape<_1, _1, _1>{});
    PipelineV pipeline_v(storage.pipeline_v, pipeline_params_v, Shape<_1, _1, _1>{});
    __syncthreads();  // barrier initialisation is visible to every thread

    if (warp_group_idx == 0) {
      cutlass::arch::warpgroup_reg_dealloc<kLoadRegisters>();
      bool const leader = warp_idx == 0 && lane_predicate;
      if (leader || gathers) {
        PipelineState smem_pipe_write = cutlass::make_producer_start_state<PipelineK>();
        int q_loads = 0;
        int claimed = 0;  // dynamic scheduling: the leader's claim of the next tile
        StreamKCursor<kStreamKTail> cursor;
        for (int tile_index = first_tile(params, cursor, num_tiles), handoff = 0;
             tile_index < num_tiles;
             tile_index = next_tile(params, cursor, storage.tile_handoff, handoff++, tile_index,
                                    num_tiles, claimed, leader)) {
          if constexpr (kDynamicScheduling) {
            if (leader) claimed = scheduler.claim();
          }
          FwdTile const tile = scheduler.template tile<kListHeadsOrder>(tile_index);
          TileWork const work = tile_work(params, tile, cursor);
          if (!work.has_rows || !work.has_keys()) continue;
          // Packed tiles are per kv head, and their Q is loaded by the MMA warpgroups.
          constexpr bool packed = kPackGqa;
          int const head_kv = packed ? tile.head : tile.head / (p.num_heads / p.num_heads_kv);
          if constexpr (kIsPaged) {
            Mainloop::load_paged(params.mainloop, storage.tensors, storage.barrier_q, q_loads,
                                 !packed, pipeline_k, pipeline_v, smem_pipe_write, work.seqlen,
                                 tile.m_block, tile.head, head_kv, tile.batch, work.walk,
                                 int(threadIdx.x), leader);
          } else {
            Mainloop::load(params.mainloop, storage.tensors, storage.barrier_q, q_loads, !packed,
                           pipeline_k, pipeline_v, smem_pipe_write, work.seqlen, tile.m_block,
                           tile.head, head_kv, tile.batch, work.walk);
          }
          ++q_loads;
        }
        if constexpr (kIsPaged) cute::cp_async_wait<0>();  // no copy outlives its thread
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<kMmaRegisters>();
      int const thread_idx = int(threadIdx.x) - cutlass::NumThreadsPerWarpGroup;
      trace::mark(thread_idx, trace::kStart);
      Element* smem_o;
      if constexpr (kSeparateO) {
        smem_o = storage.epilogue.smem_o.data();
      } else {
        smem_o = storage.tensors.smem_q.data();
      }
      typename Mainloop::TiledMmaPV tiled_mma_pv;
      PipelineState smem_pipe_read;
      int q_loads = 0;
      Mainloop::mma_init(thread_idx / cutlass::NumThreadsPerWarpGroup);
      StreamKCursor<kStreamKTail> cursor;
      int handoff = 0;
      auto advance = [&](int index) {
        return next_tile(params, cursor, storage.tile_handoff, handoff++, index, num_tiles,
                         /*claimed=*/0, /*writer=*/false);
      };
      // kNextQkUnderEpilogue: the S accumulator carried from one tile to the next, whose first
      // Q K^T (s_issued) this tile's under_last_pv issued; `advanced`: it also moved tile_index
      // on to that tile (the next with rows).
      auto tSrS_carried = Mainloop::make_fragment_s();
      bool s_issued = false;
      int tile_index = first_tile(params, cursor, num_tiles);
      while (tile_index < num_tiles) {
        FwdTile const tile = scheduler.template tile<kListHeadsOrder>(tile_index);
        TileWork const work = tile_work(params, tile, cursor);
        if (!work.has_rows) {
          tile_index = advance(tile_index);
          continue;
        }
        bool advanced = false;
        bool next_s_issued = false;
        trace::mark(thread_idx, trace::kTile);
        Tensor tOrO =
            partition_fragment_C(tiled_mma_pv, select<0, 1>(typename Mainloop::TileShapePV{}));
        OnlineSoftmax<kRowsPerThread, kLazyRescaleLog2> softmax(params.scale_log2);
        float out_scale[kRowsPerThread], lse[kRowsPerThread];
        constexpr bool packed = kPackGqa;
        auto thr_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
        Tensor tOcO = thr_mma_pv.partition_C(
            make_identity_tensor(select<0, 1>(typename Mainloop::TileShapePV{})));
        Tensor coords = make_tensor(tOcO.data(), acc_rowcol_layout(tOcO.layout()));
        // The rows' scale and log-sum-exp from the softmax state (and the sink).
        auto finalize = [&] {
          float sink_log2[kRowsPerThread];
          CUTLASS_PRAGMA_UNROLL
          for (int m = 0; m < kRowsPerThread; ++m) {
            if constexpr (packed) {  // each row its own head
              int query_row, head;
              params.packing.split(tile.m_block * kBlockM + get<0>(coords(m, 0)), tile.head,
                                   query_row, head);
              sink_log2[m] = load_sink_log2(p, tile, head);
            } else {
              sink_log2[m] = m == 0 ? load_sink_log2(p, tile, tile.head) : sink_log2[0];
            }
          }
          softmax.finalize(sink_log2, out_scale, lse);
        };
        if (work.has_keys()) {
          if constexpr (packed) {
            // O in Q's buffer: every consumer has read the previous tile's O back first.
            if constexpr (!kSeparateO) {
              cutlass::arch::NamedBarrier::sync(kNumMmaThreads, int(FwdNamedBarrier::kEpilogue));
            }
            Mainloop::load_q_packed(p, storage.tensors, work.seqlen, tile.m_block, tile.head,
                                    tile.batch, params.packing, thread_idx);
          }
          // Under the last P V: the next tile with rows and, if it has keys, its first Q K^T
          // (its Q is the CTA's next, q_loads + 1), then this tile's finalize and the wait for
          // the P V. Without a next tile with keys the Q K^T is issued all the same, on whatever
          // the stages hold, and never read: ptxas keeps the GEMMs asynchronous only if the
          // accumulator is written here on every path (else it serialised every WGMMA of the
          // kernel, C7515).
          auto under_last_pv = [&](auto& tSrS) {
            if constexpr (kNextQkUnderEpilogue) {
              int next = advance(tile_index);
              bool next_has_keys = false;
              for (; next < num_tiles; next = advance(next)) {
                TileWork const ahead =
                    tile_work(params, scheduler.template tile<kListHeadsOrder>(next), cursor);
                if (ahead.has_rows) {
                  next_has_keys = ahead.has_keys();
                  break;
                }
              }
              tile_index = next;
              advanced = true;
              next_s_issued = next_has_keys;
              Mainloop::issue_first_qk(storage.tensors, storage.barrier_q, q_loads + 1,
                                       /*q_by_tma=*/true, pipeline_k, smem_pipe_read, tSrS,
                                       thread_idx, /*operands_ready=*/next_has_keys);
              finalize();
              warpgroup_wait<1>();  // the P V; the Q K^T runs on under the epilogue
              return true;
            } else {
              if constexpr (kFinalizeUnderLastPv) finalize();
              return false;
            }
          };
          // The mainloop in a lambda, forced inline in the flex kernels: their mainloop makes it
          // large enough for the inliner to leave it a call, and a call serialises every WGMMA
          // (ptxas C7510). The other kernels keep it as the inliner treats it (forcing it there
          // reschedules their SASS, which is what was measured).
#define CUFLASH_FWD_RUN_MMA(tSrS)                                                                  \
  Mainloop::mma(storage.tensors, storage.barrier_q, q_loads, /*q_by_tma=*/!packed,                 \
                /*release_q=*/kSeparateO && !packed, pipeline_k, pipeline_v, smem_pipe_read, tOrO, \
                tSrS, s_issued, softmax, work.mask, params.softcap_scale, thread_idx, tile.m_block, \
                work.walk, tile_mods(params, tile, work.seqlen), zero_v_tail(p, tile),             \
                [&] { return under_last_pv(tSrS); })
          auto run_mma = [&](auto& tSrS) { CUFLASH_FWD_RUN_MMA(tSrS); };
          auto run_mma_inlined = [&](auto& tSrS) CUTLASS_LAMBDA_FUNC_INLINE { CUFLASH_FWD_RUN_MMA(tSrS); };
#undef CUFLASH_FWD_RUN_MMA
          if constexpr (kNextQkUnderEpilogue) {
            run_mma(tSrS_carried);
          } else {
            // A fresh accumulator per tile: nothing in it lives past the tile.
            auto tSrS = Mainloop::make_fragment_s();
            if constexpr (Variant::kIsFlex) {
              run_mma_inlined(tSrS);
            } else {
              run_mma(tSrS);
            }
          }
          trace::mark(thread_idx, trace::kMmaEnd);
          if constexpr (kStreamKTail) {
            // A piece of a tile shared with other CTAs: the last to finish merges the others and
            // writes the tile; the others leave their state to it and skip the epilogue.
            bool last = true;
            StreamKPiece const piece = cursor.piece(params.stream_k);
            if (piece.num_pieces > 1) {
              Tensor acc = make_tensor(tOrO.data(), acc_rowcol_layout(tOrO.layout()));
              last = stream_k_meet<kNumMmaThreads, kRowsPerThread>(
                  params.stream_k, piece, int(blockIdx.x), thread_idx, &storage.stream_k_arrival,
                  int(FwdNamedBarrier::kStreamK), acc, softmax.row_max, softmax.row_sum,
                  params.scale_log2);
              trace::mark(thread_idx, trace::kMeetDone);
            }
            if (!last) {
              if constexpr (!kSeparateO) storage.barrier_q.release(q_loads);  // Q's buffer is free
              ++q_loads;
              tile_index = advance(tile_index);
              continue;
            }
          }
        } else {
          clear(tOrO);
          CUTLASS_PRAGMA_UNROLL
          for (int m = 0; m < kRowsPerThread; ++m) {
            softmax.row_max[m] = -INFINITY;
            softmax.row_sum[m] = 0.f;
          }
        }
        // Tiles without keys finalize here, and so do kernels that do not finalize under the last
        // P V (kFinalizeUnderLastPv).
        if (!kFinalizeUnderLastPv || !work.has_keys()) finalize();
        // Normalise; rows past seqused_q (and any row without a visible key) give 0 and lse -inf.
        // Rows past seqused_q may hold NaN (their queries are whatever memory holds), so they are
        // selected out, not scaled by 0; a tile with no such row (all but a sequence's last) only
        // scales, without the per-element select.
        Tensor out = make_tensor(tOrO.data(), acc_rowcol_layout(tOrO.layout()));
        if ((tile.m_block + 1) * kBlockM <= work.seqlen.seqlen_q) {
          CUTLASS_PRAGMA_UNROLL
          for (int m = 0; m < kRowsPerThread; ++m) {
            CUTLASS_PRAGMA_UNROLL
            for (int n = 0; n < size<1>(out); ++n) out(m, n) *= out_scale[m];
          }
        } else {
          CUTLASS_PRAGMA_UNROLL
          for (int m = 0; m < kRowsPerThread; ++m) {
            bool const row_valid =
                tile.m_block * kBlockM + get<0>(coords(m, 0)) < work.seqlen.seqlen_q;
            if (!row_valid) lse[m] = -INFINITY;
            CUTLASS_PRAGMA_UNROLL
            for (int n = 0; n < size<1>(out); ++n)
              out(m, n) = row_valid ? out(m, n) * out_scale[m] : 0.f;
          }
        }
        cutlass::arch::ClusterBarrier* smem_release =
            !kSeparateO && work.has_keys() && !packed ? &storage.barrier_q.empty(q_loads) : nullptr;
        if constexpr (kIsSplit) {
          Epilogue::store_partial(p, tOrO, lse, tiled_mma_pv, thread_idx, work.seqlen, tile.m_block,
                                  params.packing, tile.head, tile.batch, tile.split);
          if (smem_release != nullptr) smem_release->arrive();
        } else {
          Epilogue::template store<kSeparateO>(params.epilogue, p, smem_o, tOrO, lse, tiled_mma_pv,
                                               thread_idx, work.seqlen, tile.m_block,
                                               params.packing, tile.head, tile.batch,
                                               smem_release);
        }
        trace::mark(thread_idx, trace::kEpilogue);
        if (work.has_keys()) ++q_loads;
        if (!advanced) tile_index = advance(tile_index);
        // The next tile's first S has landed by now (the epilogue took longer); waiting here keeps
        // every GEMM within one iteration, as ptxas needs to keep them asynchronous.
        if constexpr (kNextQkUnderEpilogue) warpgroup_wait<0>();
        s_issued = next_s_issued;
      }
      trace::mark(thread_idx, trace::kEnd);
      Epilogue::store_tail(thread_idx);
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads, 1)
    flash_fwd_kernel_sm90(CUTE_GRID_CONSTANT typename Kernel::Params const params) {
  extern __shared__ __align__(1024) char smem_buf[];
  Kernel{}(params, smem_buf);
}

}  // namespace cuflash::sm90
