// GPU forward kernel against the CPU reference (DESIGN.md section 5): random shapes over every
// forward option the sm90 kernel supports, outputs poisoned before each run, every element
// checked for NaN and compared with the accuracy rule in gpu_test_util.hpp.
#include <gtest/gtest.h>

#if CUFLASH_HAS_CUDA  // a build without the CUDA toolkit has no device kernels to test

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "api/params_builder.hpp"
#include "cuflash/cuflash.hpp"
#include "gpu_test_problem.hpp"
#include "gpu_test_util.hpp"

namespace cuflash {
namespace {

using gpu_testing::DeviceBuffer;
using gpu_testing::expect_output_close;
using gpu_testing::kCpu, gpu_testing::kCuda, gpu_testing::kNegInf;

struct FwdCase {
  std::string label;
  DType dtype = DType::kBFloat16;
  int batch = 1, seqlen_q = 1, seqlen_k = 1, heads = 1, heads_kv = 1, head_dim = 128,
      head_dim_v = 128;
  bool causal = false;
  int window_left = -1, window_right = -1;
  float softcap = 0.f;
  std::optional<DType> sink;
  bool varlen = false;   // packed rows with cu_seqlens; per-sequence lengths drawn up to seqlen_q/k
  // varlen: no max_seqlen_q / max_seqlen_k with the device cu_seqlens, so the longest sequence is
  // total_q for the host and the forward walks its row-block list (varlen_block_list_sm90.hpp).
  bool no_hints = false;
  bool seqused = false;  // seqused_q/k cap each sequence below its length
  bool keyless = false;  // varlen: sequence 2 has queries and no keys (every row fully masked)
  int seqused_past = 0;  // device seqused past the rows on even sequences (capped by the kernel)
  // K / V rows past each sequence's seqused_k hold NaN (memory a cache has not filled), which
  // the kernel must not let into the output (under the default CUFLASH_FWD_ZERO_V_TAIL=auto);
  // so do Q rows past seqused_q, whose output must still be 0 and lse -inf.
  bool nan_tail = false;
  // CUFLASH_FWD_ZERO_V_TAIL around the call where set (nan_tail cases take "auto").
  const char* zero_v_tail = nullptr;
  bool strided = false;  // q/k/v live in wider rows (padded head dim): non-contiguous views
  bool with_lse = true;
  std::optional<bool> pack_gqa;
  int num_splits = 1;  // split-KV; <= 0 lets cuflash choose
  // CUFLASH_FWD_STREAM_K around the call where set ("always": the last wave's tiles are cut into
  // stream-K pieces whenever the SM count allows, which these shapes' tile counts leave room for
  // on any GPU with more SMs than a handful). Such cases also run twice and must agree bit for bit.
  const char* stream_k = nullptr;
  // Key row j of each sequence scaled by 1 + j / 32 (+1) or by 1 + (len - 1 - j) / 32 (-1): the
  // scores grow along the keys (or shrink), so that in one of the two, whichever way the kernel
  // walks the blocks, a row's running max jumps by far more than 2^8 between blocks and the
  // rescale of the output runs (the hdim128 kernels skip it while the max stays within 2^8:
  // kLazyRescaleLog2); in the other the max barely moves.
  int key_ramp = 0;
  // softmax_scale 0: every visible key weighs the same (the kernels' exponent takes the smallest
  // normal float instead, sm90::exponent_scale, since -inf * 0 is NaN).
  bool zero_scale = false;
  unsigned seed = 1;
};

std::string case_name(const FwdCase& c) {
  return gpu_testing::case_name(c.label, c.dtype, c.head_dim, c.head_dim_v);
}

// Host copy of one attention problem in the rows of gpu_testing::RowLayout.
struct Problem : gpu_testing::RowLayout {
  FwdCase c;
  std::vector<float> q, k, v;  // values already rounded to the input dtype
  std::vector<float> sink;
  float scale = 1.f;

  explicit Problem(const FwdCase& fc) : RowLayout(fc, fc.seqused, fc.keyless), c(fc) {
    seqused_past = c.seqused_past;
    max_seqlen_hints = !c.no_hints;
    std::mt19937 rng(c.seed);
    draw_lengths(rng);
    std::normal_distribution<float> normal(0.f, 1.f);
    gpu_testing::fill_normal(q, std::size_t(rows_q) * c.heads * c.head_dim, c.dtype, normal, rng);
    gpu_testing::fill_normal(k, std::size_t(rows_k) * c.heads_kv * c.head_dim, c.dtype, normal,
                             rng);
    gpu_testing::fill_normal(v, std::size_t(rows_k) * c.heads_kv * c.head_dim_v, c.dtype, normal,
                             rng);
    if (c.sink) {
      sink.resize(c.heads);
      // An fp32 sink keeps its fp32 value (a kernel that rounded it to 16 bits would fail).
      for (float& x : sink)
        x = *c.sink == DType::kFloat32 ? normal(rng) : gpu_testing::round_to(normal(rng), *c.sink);
    }
    scale = c.zero_scale ? 0.f : 1.f / std::sqrt(float(c.head_dim));
    if (c.key_ramp != 0) {
      for (int b = 0; b < c.batch; ++b) {
        for (int j = 0; j < len_k[b]; ++j) {
          const int step = c.key_ramp > 0 ? j : len_k[b] - 1 - j;
          float* row = &k[std::size_t(start_k[b] + j) * c.heads_kv * c.head_dim];
          for (int i = 0; i < c.heads_kv * c.head_dim; ++i)
            row[i] = gpu_testing::round_to(row[i] * (1.f + float(step) / 32.f), c.dtype);
        }
      }
    }
    if (c.nan_tail) {
      fill_unused_rows_with_nan(q, /*query=*/true, c.heads, c.head_dim);
      fill_unused_rows_with_nan(k, /*query=*/false, c.heads_kv, c.head_dim);
      fill_unused_rows_with_nan(v, /*query=*/false, c.heads_kv, c.head_dim_v);
    }
  }
};

struct Result {
  std::vector<double> out;  // (rows_q, H, Dv)
  std::vector<double> lse;  // dense (B, H, Sq) or packed (H, total_q)
};

// The same attention computed naively in the input dtype, as a plain framework would: scaled q,
// scores, soft-capped scores, probabilities and output each rounded to the dtype.
Result naive_low_precision(const Problem& pb) {
  const FwdCase& c = pb.c;
  Result result;
  result.out.assign(std::size_t(pb.rows_q) * c.heads * c.head_dim_v, 0.0);
  result.lse.assign(pb.lse_size(), kNegInf);
  const int group = c.heads / c.heads_kv;
  const int right = c.causal ? 0 : c.window_right;
  std::vector<float> qs(c.head_dim), scores, probs;
  for (int b = 0; b < c.batch; ++b) {
    const int sq = pb.used_q[b], sk = pb.used_k[b];
    for (int h = 0; h < c.heads; ++h) {
      const int hk = h / group;
      for (int i = 0; i < sq; ++i) {
        const float* qrow = &pb.q[(std::size_t(pb.start_q[b] + i) * c.heads + h) * c.head_dim];
        for (int d = 0; d < c.head_dim; ++d)
          qs[d] = gpu_testing::round_to(qrow[d] * pb.scale, c.dtype);
        scores.assign(sk, kNegInf);
        float row_max = c.sink ? pb.sink[h] : kNegInf;
        for (int j = 0; j < sk; ++j) {
          const int diag = i + sk - sq;
          if ((right >= 0 && j > diag + right) || (c.window_left >= 0 && j < diag - c.window_left))
            continue;
          const float* krow =
              &pb.k[(std::size_t(pb.start_k[b] + j) * c.heads_kv + hk) * c.head_dim];
          float dot = 0.f;
          for (int d = 0; d < c.head_dim; ++d) dot += qs[d] * krow[d];
          float s = gpu_testing::round_to(dot, c.dtype);
          if (c.softcap > 0.f)
            s = gpu_testing::round_to(c.softcap * std::tanh(s / c.softcap), c.dtype);
          scores[j] = s;
          row_max = std::max(row_max, s);
        }
        if (row_max == kNegInf) continue;  // nothing visible: out 0, lse -inf
        float denom = c.sink ? std::exp(pb.sink[h] - row_max) : 0.f;
        for (int j = 0; j < sk; ++j) denom += std::exp(scores[j] - row_max);
        result.lse[pb.lse_index(b, h, i)] = row_max + std::log(denom);
        double* orow = &result.out[(std::size_t(pb.start_q[b] + i) * c.heads + h) * c.head_dim_v];
        std::vector<float> acc(c.head_dim_v, 0.f);
        for (int j = 0; j < sk; ++j) {
          if (scores[j] == kNegInf) continue;
          const float p = gpu_testing::round_to(std::exp(scores[j] - row_max) / denom, c.dtype);
          const float* vrow =
              &pb.v[(std::size_t(pb.start_k[b] + j) * c.heads_kv + hk) * c.head_dim_v];
          for (int d = 0; d < c.head_dim_v; ++d) acc[d] += p * vrow[d];
        }
        for (int d = 0; d < c.head_dim_v; ++d) orow[d] = gpu_testing::round_to(acc[d], c.dtype);
      }
    }
  }
  return result;
}

// The options of ForwardArgs that do not depend on where the tensors live.
void set_options(ForwardArgs& args, const FwdCase& c) {
  gpu_testing::set_window_options(args.opts, c);
  if (c.zero_scale) args.opts.softmax_scale = 0.f;
  args.pack_gqa = c.pack_gqa;
}

Result run_reference(const Problem& pb) {
  const FwdCase& c = pb.c;
  std::vector<float> q = pb.q, k = pb.k, v = pb.v;
  std::vector<float> out(std::size_t(pb.rows_q) * c.heads * c.head_dim_v, std::nanf(""));
  std::vector<float> lse(pb.lse_size(), std::nanf(""));
  gpu_testing::HostSequences sequences(pb);
  std::vector<float> sink = pb.sink;
  ForwardArgs args;
  args.q = pb.query_view(q.data(), DType::kFloat32, c.head_dim, kCpu);
  args.k = pb.key_view(k.data(), DType::kFloat32, c.head_dim, kCpu);
  args.v = pb.key_view(v.data(), DType::kFloat32, c.head_dim_v, kCpu);
  args.out = pb.query_view(out.data(), DType::kFloat32, c.head_dim_v, kCpu);
  args.lse = pb.lse_view(lse.data(), kCpu);
  if (c.sink) args.learnable_sink = TensorView(sink.data(), DType::kFloat32, {c.heads}, kCpu);
  pb.set_sequences(args.seq, kCpu, sequences.pointers());
  set_options(args, c);
  forward(args);
  return {std::vector<double>(out.begin(), out.end()), std::vector<double>(lse.begin(), lse.end())};
}

Result run_gpu(const Problem& pb) {
  const FwdCase& c = pb.c;
  const int pad = c.strided ? 8 : 0;  // keeps 16-byte aligned rows, as TMA needs
  using gpu_testing::to_device_16bit_padded;
  DeviceBuffer q = to_device_16bit_padded(pb.q, std::size_t(pb.rows_q) * c.heads, c.head_dim,
                                          pad, c.dtype);
  DeviceBuffer k = to_device_16bit_padded(pb.k, std::size_t(pb.rows_k) * c.heads_kv, c.head_dim,
                                          pad, c.dtype);
  DeviceBuffer v = to_device_16bit_padded(pb.v, std::size_t(pb.rows_k) * c.heads_kv,
                                          c.head_dim_v, pad, c.dtype);
  DeviceBuffer out =
      gpu_testing::poisoned_16bit(std::size_t(pb.rows_q) * c.heads * (c.head_dim_v + pad));
  DeviceBuffer lse = gpu_testing::poisoned_fp32(pb.lse_size());
  const gpu_testing::DeviceSequences sequences(pb);
  DeviceBuffer sink;
  if (c.sink) sink = gpu_testing::to_device_as(pb.sink, *c.sink);

  ForwardArgs args;
  args.q = pb.query_view(q.data(), c.dtype, c.head_dim, kCuda, pad);
  args.k = pb.key_view(k.data(), c.dtype, c.head_dim, kCuda, pad);
  args.v = pb.key_view(v.data(), c.dtype, c.head_dim_v, kCuda, pad);
  args.out = pb.query_view(out.data(), c.dtype, c.head_dim_v, kCuda, pad);
  if (c.with_lse) args.lse = pb.lse_view(lse.data(), kCuda);
  if (c.sink) args.learnable_sink = TensorView(sink.data(), *c.sink, {c.heads}, kCuda);
  pb.set_sequences(args.seq, kCuda, sequences.pointers());
  set_options(args, c);
  args.num_splits = c.num_splits;
  std::optional<gpu_testing::ScopedEnv> zero_v_tail;
  // The default: seqused_k and page tables get the V tail zeroed.
  if (c.nan_tail || c.zero_v_tail) zero_v_tail.emplace("CUFLASH_FWD_ZERO_V_TAIL", c.zero_v_tail ? c.zero_v_tail : "auto");
  std::optional<gpu_testing::ScopedEnv> stream_k;
  if (c.stream_k) stream_k.emplace("CUFLASH_FWD_STREAM_K", c.stream_k);
  forward(args);
  gpu_testing::check_cuda(cudaDeviceSynchronize(), "forward kernel");

  Result result;
  // out in wider rows too: its values, and the padding between head vectors left as it was.
  const std::vector<std::uint16_t> out_bits = out.to_host<std::uint16_t>();
  std::size_t padding_written = 0;
  for (std::size_t i = 0; i < out_bits.size(); ++i) {
    if (int(i % (c.head_dim_v + pad)) < c.head_dim_v) {
      result.out.push_back(gpu_testing::from_bits(out_bits[i], c.dtype));
    } else if (out_bits[i] != gpu_testing::kPoison16 && padding_written++ == 0) {
      ADD_FAILURE() << "out's padding written at " << i;
    }
  }
  if (c.with_lse) {
    for (float x : lse.to_host<float>()) result.lse.push_back(x);
  }
  return result;
}

// How many CTAs share the stream-K tail of a dense, non-causal case on this device under
// "always" (dispatch's plan, detail::fwd_stream_k_ctas); 0: the case runs no tail here.
int stream_k_ctas_here(const FwdCase& c) {
  int device = 0;
  FwdParams p;
  gpu_testing::check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  gpu_testing::check_cuda(cudaDeviceGetAttribute(&p.num_sm, cudaDevAttrMultiProcessorCount, device),
                          "SM count");
  p.batch = c.batch;
  p.seqlen_q = c.seqlen_q;
  p.seqlen_k = c.seqlen_k;
  p.num_heads = c.heads;
  p.num_heads_kv = c.heads_kv;
  p.head_dim = c.head_dim;
  p.head_dim_v = c.head_dim_v;
  p.softcap = c.softcap;
  return detail::fwd_stream_k_ctas(p, detail::FwdStreamK::kAlways);
}

class GpuForward : public ::testing::TestWithParam<FwdCase> {};

TEST_P(GpuForward, MatchesReference) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  const FwdCase& c = GetParam();
  const Problem pb(c);
  const std::optional<Result> gpu = gpu_testing::run_if_built([&] { return run_gpu(pb); });
  if (!gpu) return;
  const Result ref = run_reference(pb);
  const Result naive = naive_low_precision(pb);
  expect_output_close("out", gpu->out, naive.out, ref.out);
  if (c.with_lse) expect_output_close("lse", gpu->lse, naive.lse, ref.lse);
  if (c.stream_k) {  // the merge order is fixed: a second run gives the same bits
    EXPECT_GT(stream_k_ctas_here(c), 0) << "the case's shape leaves no stream-K tail on this device";
    const Result again = run_gpu(pb);
    EXPECT_TRUE(again.out == gpu->out) << "out differs between two runs";
    EXPECT_TRUE(again.lse == gpu->lse) << "lse differs between two runs";
  }
}

std::vector<FwdCase> forward_cases() {
  const std::pair<int, int> head_dims[] = {{64, 64},   {96, 96},   {128, 128},
                                           {192, 192}, {192, 128}, {256, 256}};
  std::vector<FwdCase> cases;
  unsigned seed = 1;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (auto [d, dv] : head_dims) {
      // fp16 runs the first cases and those marked for both dtypes; bf16 runs every case.
      auto add = [&](FwdCase c, bool fp16_too = false) {
        if (dtype == DType::kFloat16 && !fp16_too) return;
        c.dtype = dtype;
        c.head_dim = d;
        c.head_dim_v = dv;
        c.seed = seed++;
        cases.push_back(c);
      };
      FwdCase c;
      c = {};
      c.label = "dense", c.batch = 2, c.seqlen_q = 257, c.seqlen_k = 257, c.heads = 3,
      c.heads_kv = 3;
      add(c, true);
      c = {};
      c.label = "causal_long", c.batch = 1, c.seqlen_q = 1023, c.seqlen_k = 1023, c.heads = 2,
      c.heads_kv = 2, c.causal = true;
      add(c, true);
      c = {};
      c.label = "varlen_causal_gqa", c.batch = 4, c.seqlen_q = 300, c.seqlen_k = 333, c.heads = 4,
      c.heads_kv = 1, c.causal = true, c.varlen = true;
      add(c, true);
      // Stream-K tail (head dims up to 128, 128-row tiles: fwd_stream_k_tile): 144 tiles, keys
      // not a whole number of blocks; each tail tile in two to four pieces. hdim64 runs these
      // rows on its 192-row tile, which has no tail; its cases below take the 128-row tile.
      const bool stream_k = d <= 128;
      c = {};
      c.label = "stream_k_tail_gqa3", c.batch = 2, c.seqlen_q = 1024, c.seqlen_k = 1000,
      c.heads = 9, c.heads_kv = 3, c.stream_k = "always";
      if (stream_k && d > 64) add(c, true);
      // Sequences with queries and no keys (rows fully masked: out 0, lse -inf, or lse = the
      // sink with one), with a sink, and through split-KV's combine (all partials masked).
      c = {};
      c.label = "varlen_keyless_sink_causal_gqa", c.batch = 4, c.seqlen_q = 300, c.seqlen_k = 333,
      c.heads = 4, c.heads_kv = 1, c.causal = true, c.varlen = true, c.keyless = true,
      c.sink = DType::kFloat32;
      add(c, true);
      c = {};
      c.label = "split3_varlen_keyless_causal_gqa", c.batch = 4, c.seqlen_q = 64, c.seqlen_k = 1200,
      c.heads = 8, c.heads_kv = 2, c.causal = true, c.varlen = true, c.keyless = true, c.num_splits = 3;
      add(c);
      c = {};
      c.label = "split3_no_lse", c.batch = 2, c.seqlen_q = 33, c.seqlen_k = 900, c.heads = 4,
      c.heads_kv = 2, c.num_splits = 3, c.with_lse = false;
      add(c);
      c = {};  // softcap inside a window, on the plain kernels
      c.label = "softcap_local_gqa", c.batch = 2, c.seqlen_q = 300, c.seqlen_k = 420, c.heads = 4,
      c.heads_kv = 2, c.window_left = 80, c.window_right = 16, c.softcap = 20.f;
      add(c, true);
      c = {};  // right side only, more queries than keys: the first rows see no key
      c.label = "local_right_only_sq_gt_sk", c.batch = 1, c.seqlen_q = 400, c.seqlen_k = 150,
      c.heads = 2, c.heads_kv = 2, c.window_right = 10;
      add(c);
      c = {};  // masked keys (causal, past the keys in the last block) under a scale of 0
      c.label = "zero_scale_causal", c.batch = 2, c.seqlen_q = 200, c.seqlen_k = 333, c.heads = 2,
      c.heads_kv = 2, c.causal = true, c.zero_scale = true;
      add(c);
      c = {};  // rows past seqlen_q in the tail tiles; sink, softcap (hdim64: 128 x 192), strided
      c.label = "stream_k_tail_sink_softcap_strided", c.batch = 1, c.seqlen_q = 1000,
      c.seqlen_k = 777, c.heads = 23, c.heads_kv = 23, c.sink = DType::kFloat32, c.softcap = 20.f,
      c.strided = true, c.stream_k = "always";
      if (stream_k) add(c);
      c = {};  // two tiles of long rows: each shared by a dozen CTAs or more
      c.label = "stream_k_few_tiles_many_pieces", c.batch = 1, c.seqlen_q = 100, c.seqlen_k = 3000,
      c.heads = 2, c.heads_kv = 1, c.stream_k = "always";
      if (stream_k) add(c);
      c = {};
      c.label = "causal_decode_mqa", c.batch = 2, c.seqlen_q = 17, c.seqlen_k = 1023, c.heads = 8,
      c.heads_kv = 1, c.causal = true;
      add(c);
      c = {};
      c.label = "causal_sq_gt_sk", c.batch = 1, c.seqlen_q = 300, c.seqlen_k = 100, c.heads = 2,
      c.heads_kv = 2, c.causal = true;
      add(c, true);
      c = {};
      c.label = "local", c.batch = 1, c.seqlen_q = 513, c.seqlen_k = 513, c.heads = 4,
      c.heads_kv = 2, c.window_left = 64, c.window_right = 32;
      add(c);
      c = {};
      c.label = "local_left_only", c.batch = 2, c.seqlen_q = 200, c.seqlen_k = 700, c.heads = 2,
      c.heads_kv = 2, c.window_left = 100;
      add(c);
      c = {};
      c.label = "softcap_causal", c.batch = 2, c.seqlen_q = 255, c.seqlen_k = 255, c.heads = 2,
      c.heads_kv = 2, c.causal = true, c.softcap = 30.f;
      add(c);
      c = {};
      c.label = "sink_fp32_one_query", c.batch = 3, c.seqlen_q = 1, c.seqlen_k = 17, c.heads = 4,
      c.heads_kv = 4, c.sink = DType::kFloat32;
      add(c);
      c = {};
      c.label = "sink_bf16_causal", c.batch = 1, c.seqlen_q = 129, c.seqlen_k = 129, c.heads = 2,
      c.heads_kv = 2, c.causal = true, c.sink = DType::kBFloat16;
      add(c);
      c = {};
      c.label = "sink_fp16_local", c.batch = 1, c.seqlen_q = 190, c.seqlen_k = 260, c.heads = 2,
      c.heads_kv = 1, c.window_left = 20, c.window_right = 0, c.sink = DType::kFloat16;
      add(c);
      c = {};
      c.label = "varlen_seqused", c.batch = 5, c.seqlen_q = 200, c.seqlen_k = 150, c.heads = 2,
      c.heads_kv = 2, c.varlen = true, c.seqused = true;
      add(c);
      c = {};
      c.label = "dense_seqused_causal", c.batch = 3, c.seqlen_q = 130, c.seqlen_k = 190,
      c.heads = 2, c.heads_kv = 1, c.causal = true, c.seqused = true;
      add(c);
      c = {};
      c.label = "strided_gqa3", c.batch = 2, c.seqlen_q = 150, c.seqlen_k = 211, c.heads = 6,
      c.heads_kv = 2, c.strided = true;
      add(c);
      c = {};
      c.label = "gqa5_unpacked_no_lse", c.batch = 1, c.seqlen_q = 70, c.seqlen_k = 90, c.heads = 5,
      c.heads_kv = 1, c.pack_gqa = false, c.with_lse = false;
      add(c);
      // Packed GQA (the group's heads share the tiles), asked for explicitly: groups that do
      // not divide the 128-row tile, windows, sinks, seqused, split-KV and softcap.
      c = {};
      c.label = "packed_gqa3_local_sink", c.batch = 2, c.seqlen_q = 77, c.seqlen_k = 300,
      c.heads = 6, c.heads_kv = 2, c.window_left = 40, c.window_right = 10,
      c.sink = DType::kFloat32, c.pack_gqa = true;
      add(c, true);
      c = {};
      c.label = "packed_gqa2_causal_strided", c.batch = 2, c.seqlen_q = 300, c.seqlen_k = 260,
      c.heads = 4, c.heads_kv = 2, c.causal = true, c.strided = true, c.pack_gqa = true;
      add(c);
      c = {};  // packed sequences in wider rows (q, k, v and out), with seqused
      c.label = "varlen_strided_seqused_causal_gqa", c.batch = 4, c.seqlen_q = 280, c.seqlen_k = 310,
      c.heads = 4, c.heads_kv = 2, c.causal = true, c.varlen = true, c.seqused = true, c.strided = true;
      add(c);
      c = {};
      c.label = "varlen_strided_split3_local", c.batch = 3, c.seqlen_q = 70, c.seqlen_k = 900, c.heads = 4,
      c.heads_kv = 1, c.varlen = true, c.window_left = 300, c.window_right = 20, c.strided = true,
      c.num_splits = 3;
      add(c);
      c = {};
      c.label = "packed_gqa5_varlen_seqused", c.batch = 3, c.seqlen_q = 40, c.seqlen_k = 150,
      c.heads = 5, c.heads_kv = 1, c.causal = true, c.varlen = true, c.seqused = true,
      c.pack_gqa = true;
      add(c);
      c = {};
      c.label = "packed_gqa4_split3_sink", c.batch = 2, c.seqlen_q = 5, c.seqlen_k = 1000,
      c.heads = 8, c.heads_kv = 2, c.sink = DType::kBFloat16, c.num_splits = 3, c.pack_gqa = true;
      add(c);
      c = {};
      c.label = "packed_gqa4_softcap", c.batch = 1, c.seqlen_q = 33, c.seqlen_k = 200, c.heads = 4,
      c.heads_kv = 1, c.softcap = 20.f, c.pack_gqa = true;
      add(c);
      c = {};  // softcap with split-KV (softcap_split_packgqa); the heuristic's splits too
      c.label = "packed_gqa4_softcap_split3_causal", c.batch = 2, c.seqlen_q = 3, c.seqlen_k = 900,
      c.heads = 8, c.heads_kv = 2, c.causal = true, c.softcap = 30.f, c.num_splits = 3,
      c.pack_gqa = true;
      add(c, true);
      c = {};
      c.label = "softcap_decode_gqa8_auto", c.batch = 2, c.seqlen_q = 1, c.seqlen_k = 1500,
      c.heads = 8, c.heads_kv = 1, c.softcap = 25.f, c.num_splits = 0;
      add(c);
      c = {};
      c.label = "unpacked_decode_gqa4", c.batch = 2, c.seqlen_q = 2, c.seqlen_k = 300, c.heads = 8,
      c.heads_kv = 2, c.causal = true, c.pack_gqa = false;
      add(c);
      c = {};
      c.label = "single_row_and_key", c.batch = 3, c.seqlen_q = 1, c.seqlen_k = 1, c.heads = 2,
      c.heads_kv = 2;
      add(c);
      c = {};
      c.label = "split3_causal_sink", c.batch = 2, c.seqlen_q = 65, c.seqlen_k = 1000, c.heads = 4,
      c.heads_kv = 2, c.causal = true, c.sink = DType::kFloat32, c.num_splits = 3;
      add(c, true);
      c = {};
      c.label = "split_auto_varlen_seqused", c.batch = 3, c.seqlen_q = 17, c.seqlen_k = 900,
      c.heads = 2, c.heads_kv = 1, c.varlen = true, c.seqused = true, c.num_splits = 0;
      add(c);
      c = {};  // more splits than a warp's lanes: the combine weighs them in groups of 32
      c.label = "split40_decode_gqa4", c.batch = 2, c.seqlen_q = 1, c.seqlen_k = 5000, c.heads = 8,
      c.heads_kv = 2, c.num_splits = 40;
      add(c);
      c = {};  // 12 key blocks over 40 splits: 28 see no key (their partials: lse -inf, out 0)
      c.label = "split40_mostly_empty_causal", c.batch = 2, c.seqlen_q = 3, c.seqlen_k = 1500, c.heads = 4,
      c.heads_kv = 2, c.causal = true, c.num_splits = 40;
      add(c);
      c = {};
      c.label = "split5_local_decode", c.batch = 2, c.seqlen_q = 1, c.seqlen_k = 777, c.heads = 8,
      c.heads_kv = 2, c.window_left = 300, c.window_right = 0, c.num_splits = 5;
      add(c);
      // Device seqused past the rows (not checkable on the host): capped at each length.
      add(gpu_testing::varlen_seqused_past_case<FwdCase>());
      c = {};
      c.label = "dense_seqused_past_split3", c.batch = 3, c.seqlen_q = 70, c.seqlen_k = 400,
      c.heads = 2, c.heads_kv = 2, c.seqused = true, c.seqused_past = 129, c.num_splits = 3;
      add(c);
      // NaN in the keys' rows past seqused_k (a cache's unfilled tail).
      c = {};
      c.label = "varlen_seqused_nan_tail", c.batch = 4, c.seqlen_q = 100, c.seqlen_k = 300,
      c.heads = 4, c.heads_kv = 2, c.varlen = true, c.seqused = true, c.nan_tail = true;
      add(c);
      // Sequences of several row tiles: the tiles below seqused_q are normalised without the
      // per-row select, and only the last one holds NaN query rows.
      c = {};
      c.label = "varlen_seqused_nan_tail_long_q", c.batch = 3, c.seqlen_q = 400, c.seqlen_k = 300,
      c.heads = 2, c.heads_kv = 2, c.varlen = true, c.seqused = true, c.nan_tail = true;
      add(c);
      c = {};
      c.label = "dense_seqused_nan_tail_causal_split2", c.batch = 3, c.seqlen_q = 50, c.seqlen_k = 333,
      c.heads = 2, c.heads_kv = 1, c.causal = true, c.seqused = true, c.nan_tail = true, c.num_splits = 2;
      add(c);
      // The zeroing forced on a dense call, where auto leaves it off (TMA already reads zeros
      // past the tensor): the last block's V rows are zeroed in shared memory all the same.
      c = {};
      c.label = "dense_zero_v_tail_forced", c.batch = 2, c.seqlen_q = 200, c.seqlen_k = 333,
      c.heads = 2, c.heads_kv = 2, c.zero_v_tail = "1";
      add(c);
    }
  }
  // Head dims between the compiled ones run on the next larger kernel (TMA zero-fills the
  // extra columns; only the real ones are stored).
  const std::pair<int, int> odd_head_dims[] = {{32, 32}, {80, 80}, {160, 128}, {128, 64}};
  for (auto [d, dv] : odd_head_dims) {
    FwdCase c;
    c.label = "odd_head_dim_causal", c.dtype = DType::kBFloat16, c.batch = 2, c.seqlen_q = 100,
    c.seqlen_k = 230, c.heads = 4, c.heads_kv = 2, c.head_dim = d, c.head_dim_v = dv,
    c.causal = true, c.seed = seed++;
    cases.push_back(c);
  }
  // The running max moving by more than 2^8 between blocks, in fp16: its scores are rounded
  // finely enough at these magnitudes (about 140) for the rule's naive reference to stay close,
  // where bf16's would allow errors of about 1. Seeds of their own, so that adding them left
  // the other cases' inputs as they were.
  unsigned ramp_seed = 1000;
  for (auto [d, dv] : head_dims) {
    for (int ramp : {1, -1}) {
      FwdCase c;
      c.label = ramp > 0 ? "keys_growing" : "keys_shrinking", c.dtype = DType::kFloat16,
      c.batch = 2, c.seqlen_q = 300, c.seqlen_k = 1000, c.heads = 2, c.heads_kv = 2,
      c.head_dim = d, c.head_dim_v = dv, c.key_ramp = ramp, c.seed = ramp_seed++;
      cases.push_back(c);
    }
  }
  // Packed sequences without the max_seqlen hints: the tiles walk the row-block list, built on
  // the device from cu_seqlens_q (each case's rectangle, batch x total_q rows, is more than twice
  // the list). Sequence 0 is the longest and sequence 1 has no queries (draw_lengths); more
  // sequences than the list kernel's 512 threads take two chunks. Seeds of their own.
  unsigned list_seed = 2000;
  for (auto [d, dv] : head_dims) {
    auto add = [&](FwdCase c) {
      c.head_dim = d, c.head_dim_v = dv, c.varlen = true, c.no_hints = true, c.seed = list_seed++;
      cases.push_back(c);
    };
    FwdCase c;
    c = {};  // causal: each sequence's last row blocks first
    c.label = "row_list_causal_gqa", c.batch = 12, c.seqlen_q = 300, c.seqlen_k = 333, c.heads = 4,
    c.heads_kv = 1, c.causal = true;
    add(c);
    c = {};
    c.label = "row_list_long_causal", c.batch = 3, c.seqlen_q = 1100, c.seqlen_k = 1100, c.heads = 2,
    c.heads_kv = 2, c.causal = true;
    add(c);
    c = {};
    c.label = "row_list_packed_gqa4_split3_local", c.batch = 6, c.seqlen_q = 200, c.seqlen_k = 700,
    c.heads = 8, c.heads_kv = 2, c.window_left = 100, c.window_right = 20, c.num_splits = 3,
    c.pack_gqa = true;
    add(c);
    c = {};
    c.label = "row_list_seqused_keyless_sink", c.batch = 9, c.seqlen_q = 260, c.seqlen_k = 300,
    c.heads = 2, c.heads_kv = 2, c.seqused = true, c.keyless = true, c.sink = DType::kFloat32;
    add(c);
    c = {};
    c.label = "row_list_600_sequences_softcap", c.batch = 600, c.seqlen_q = 20, c.seqlen_k = 30,
    c.heads = 2, c.heads_kv = 1, c.softcap = 20.f;
    add(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Options, GpuForward, ::testing::ValuesIn(forward_cases()),
                         gpu_testing::CaseName());

}  // namespace
}  // namespace cuflash

#endif  // CUFLASH_HAS_CUDA
