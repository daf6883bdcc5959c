// GPU backward kernels against the CPU reference (DESIGN.md section 5): random shapes over every
// backward option the sm90 kernels support; dq / dk / dv / d_sink are poisoned before each run,
// every element is checked for NaN and compared with the accuracy rule in gpu_test_util.hpp
// (at most twice the error of the same backward done naively in the input dtype).
// The workspace starts as NaN bytes (backward_on_poisoned_workspace), so a workspace row read
// before it is written or cleared fails the case too.
// Deterministic mode runs twice and must agree bit for bit. Cases with dlse give the backward a
// gradient reaching lse as well (the caller's loss uses return_lse). Paged cases hand the same
// keys to the kernels through a shuffled page table and read dk / dv back from the pages.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuflash/cuflash.hpp"
#include "gpu_test_problem.hpp"
#include "gpu_test_util.hpp"

namespace cuflash {
namespace {

using gpu_testing::DeviceBuffer;
using gpu_testing::expect_grad_close;
using gpu_testing::kCpu, gpu_testing::kCuda, gpu_testing::kNegInf;

struct BwdCase {
  std::string label;
  DType dtype = DType::kBFloat16;
  int batch = 1, seqlen_q = 1, seqlen_k = 1, heads = 1, heads_kv = 1, head_dim = 128, head_dim_v = 128;
  bool causal = false;
  int window_left = -1, window_right = -1;
  float softcap = 0.f;
  std::optional<DType> sink;
  bool varlen = false;   // packed rows with cu_seqlens; lengths drawn up to seqlen_q/k
  bool seqused = false;  // seqused_q/k cap each sequence below its length
  int seqused_past = 0;  // device seqused past the rows on even sequences (capped by the kernel)
  // seqused: NaN in q, k, v, out and dout past each sequence's used rows. With seqused_past too,
  // the odd sequences use none of their rows, so that the full even ones' boundary blocks run
  // into NaN rows of the next sequence.
  bool nan_tail = false;
  bool strided = false;  // every tensor, gradients included, lives in wider rows
  bool deterministic = false;
  bool dlse = false;  // a random gradient of lse as well
  bool zero_scale = false;  // softmax_scale 0: uniform weights over the visible keys, dq = dk = 0
  // Paged k / v on the GPU (seqlen_k a multiple of it): each sequence's keys in pages of this many
  // rows, reached through a shuffled page table (PagePool below). The reference runs dense. With
  // seqused, the last sequence has no keys (unless seqused_past keeps it whole).
  int page_size = 0;
  // Paged: sequence 1 starts with sequence 0's first page (the same keys, a shared prefix); that
  // page's dk / dv are the sum of both sequences' gradients.
  bool shared_pages = false;
  // varlen without the max_seqlen hints: the host's longest is the total, and the kernels walk
  // the block lists built on the device (varlen_block_list_sm90.hpp).
  bool no_hints = false;
  unsigned seed = 1;
};

// The options every call of a case takes (the reference forward, the reference backward, the GPU).
void set_options(AttentionOptions& opts, const BwdCase& c) {
  gpu_testing::set_window_options(opts, c);
  if (c.zero_scale) opts.softmax_scale = 0.f;
}

std::string case_name(const BwdCase& c) {
  return gpu_testing::case_name(c.label, c.dtype, c.head_dim, c.head_dim_v);
}

// Host copy of one problem in the rows of gpu_testing::RowLayout; varlen batches also hold a
// sequence without keys (every row fully masked). out and lse come from the reference forward;
// every 16-bit input is already rounded to the dtype.
struct Problem : gpu_testing::RowLayout {
  BwdCase c;
  std::vector<float> q, k, v, out, dout, lse, dlse, sink;
  float scale = 1.f;

  explicit Problem(const BwdCase& bc) : RowLayout(bc, bc.seqused, true), c(bc) {
    seqused_past = c.seqused_past;
    max_seqlen_hints = !c.no_hints;
    std::mt19937 rng(c.seed);
    draw_lengths(rng);
    if (c.nan_tail && c.seqused_past > 0) {
      for (int b = 1; b < batch; b += 2) used_q[b] = used_k[b] = given_q[b] = given_k[b] = 0;
    }
    const int last = batch - 1;
    if (c.page_size > 0 && c.seqused && last > 0 && !(c.seqused_past > 0 && last % 2 == 0) &&
        !(c.shared_pages && last == 1)) {
      used_k[last] = given_k[last] = 0;
    }
    if (c.shared_pages) {  // both sequences read the shared page: at least a key and a query each
      if (batch < 2) throw std::logic_error(c.label + ": shared_pages needs two sequences");
      for (int b : {0, 1}) {
        const bool past_k = given_k[b] != used_k[b], past_q = given_q[b] != used_q[b];
        used_k[b] = std::max(used_k[b], b == 0 ? c.page_size : 1);
        used_q[b] = std::max(used_q[b], 1);
        if (!past_k) given_k[b] = used_k[b];
        if (!past_q) given_q[b] = used_q[b];
      }
    }
    std::normal_distribution<float> normal(0.f, 1.f);
    using gpu_testing::fill_normal;
    fill_normal(q, std::size_t(rows_q) * c.heads * c.head_dim, c.dtype, normal, rng);
    fill_normal(k, std::size_t(rows_k) * c.heads_kv * c.head_dim, c.dtype, normal, rng);
    fill_normal(v, std::size_t(rows_k) * c.heads_kv * c.head_dim_v, c.dtype, normal, rng);
    if (c.shared_pages) {  // sequence 1's first page holds sequence 0's first page's keys
      for (auto [x, dim] : {std::pair{&k, c.head_dim}, std::pair{&v, c.head_dim_v}}) {
        const std::size_t width = std::size_t(c.heads_kv) * dim;
        std::copy_n(x->begin() + std::size_t(start_k[0]) * width, std::size_t(c.page_size) * width,
                    x->begin() + std::size_t(start_k[1]) * width);
      }
    }
    fill_normal(dout, std::size_t(rows_q) * c.heads * c.head_dim_v, c.dtype, normal, rng);
    if (c.sink) {
      sink.resize(c.heads);
      // An fp32 sink keeps its fp32 value (a kernel that rounded it to 16 bits would fail).
      for (float& x : sink)
        x = *c.sink == DType::kFloat32 ? normal(rng) : gpu_testing::round_to(normal(rng), *c.sink);
    }
    scale = c.zero_scale ? 0.f : 1.f / std::sqrt(float(c.head_dim));
    run_forward();
    if (c.dlse) {
      // NaN where lse is -inf (rows without a visible key, rows past the sequences): no
      // gradient exists there, and neither backward may read it.
      fill_normal(dlse, lse.size(), DType::kFloat32, normal, rng);
      for (std::size_t i = 0; i < lse.size(); ++i) {
        if (lse[i] == kNegInf) dlse[i] = std::nanf("");
      }
    }
    if (c.nan_tail) {
      fill_unused_rows_with_nan(q, /*query=*/true, c.heads, c.head_dim);
      fill_unused_rows_with_nan(out, /*query=*/true, c.heads, c.head_dim_v);
      fill_unused_rows_with_nan(dout, /*query=*/true, c.heads, c.head_dim_v);
      fill_unused_rows_with_nan(k, /*query=*/false, c.heads_kv, c.head_dim);
      fill_unused_rows_with_nan(v, /*query=*/false, c.heads_kv, c.head_dim_v);
    }
  }

  // out and lse of the reference forward; out rounded to the dtype as a kernel would store it.
  void run_forward() {
    std::vector<float> qf = q, kf = k, vf = v;
    out.assign(std::size_t(rows_q) * c.heads * c.head_dim_v, 0.f);
    lse.assign(lse_size(), kNegInf);
    gpu_testing::HostSequences sequences(*this);
    std::vector<float> sink_copy = sink;
    ForwardArgs args;
    args.q = query_view(qf.data(), DType::kFloat32, c.head_dim, kCpu);
    args.k = key_view(kf.data(), DType::kFloat32, c.head_dim, kCpu);
    args.v = key_view(vf.data(), DType::kFloat32, c.head_dim_v, kCpu);
    args.out = query_view(out.data(), DType::kFloat32, c.head_dim_v, kCpu);
    args.lse = lse_view(lse.data(), kCpu);
    if (c.sink) args.learnable_sink = TensorView(sink_copy.data(), DType::kFloat32, {c.heads}, kCpu);
    set_sequences(args.seq, kCpu, sequences.pointers());
    set_options(args.opts, c);
    forward(args);
    for (float& x : out) x = gpu_testing::round_to(x, c.dtype);
  }
};

struct Grads {
  std::vector<double> dq, dk, dv, d_sink;  // layouts of q, k, v (unpadded), sink
};

Grads run_reference(const Problem& pb) {
  const BwdCase& c = pb.c;
  std::vector<float> q = pb.q, k = pb.k, v = pb.v, out = pb.out, dout = pb.dout, lse = pb.lse, dlse = pb.dlse,
                     sink = pb.sink;
  std::vector<float> dq(q.size(), std::nanf("")), dk(k.size(), std::nanf("")), dv(v.size(), std::nanf(""));
  std::vector<float> d_sink(c.heads, std::nanf(""));
  gpu_testing::HostSequences sequences(pb);
  BackwardArgs args;
  args.q = pb.query_view(q.data(), DType::kFloat32, c.head_dim, kCpu);
  args.k = pb.key_view(k.data(), DType::kFloat32, c.head_dim, kCpu);
  args.v = pb.key_view(v.data(), DType::kFloat32, c.head_dim_v, kCpu);
  args.out = pb.query_view(out.data(), DType::kFloat32, c.head_dim_v, kCpu);
  args.dout = pb.query_view(dout.data(), DType::kFloat32, c.head_dim_v, kCpu);
  args.lse = pb.lse_view(lse.data(), kCpu);
  if (c.dlse) args.dlse = pb.lse_view(dlse.data(), kCpu);
  args.dq = pb.query_view(dq.data(), DType::kFloat32, c.head_dim, kCpu);
  args.dk = pb.key_view(dk.data(), DType::kFloat32, c.head_dim, kCpu);
  args.dv = pb.key_view(dv.data(), DType::kFloat32, c.head_dim_v, kCpu);
  if (c.sink) {
    args.learnable_sink = TensorView(sink.data(), DType::kFloat32, {c.heads}, kCpu);
    args.d_sink = TensorView(d_sink.data(), DType::kFloat32, {c.heads}, kCpu);
  }
  args.deterministic = c.deterministic;
  pb.set_sequences(args.seq, kCpu, sequences.pointers());
  set_options(args.opts, c);
  backward(args);
  Grads g{{dq.begin(), dq.end()}, {dk.begin(), dk.end()}, {dv.begin(), dv.end()}, {}};
  if (c.sink) g.d_sink.assign(d_sink.begin(), d_sink.end());
  return g;
}

// The same backward done naively in the input dtype, as a plain framework would: scores,
// probabilities, dP, the row sums and dS each rounded to the dtype, gradients accumulated in
// fp32 and rounded once.
Grads naive_low_precision(const Problem& pb) {
  const BwdCase& c = pb.c;
  auto r = [&](float x) { return gpu_testing::round_to(x, c.dtype); };
  std::vector<float> dq(pb.q.size(), 0.f), dk(pb.k.size(), 0.f), dv(pb.v.size(), 0.f), d_sink(c.heads, 0.f);
  const int group = c.heads / c.heads_kv;
  const int right = c.causal ? 0 : c.window_right;
  std::vector<float> qs(c.head_dim);
  for (int b = 0; b < c.batch; ++b) {
    const int sq = pb.used_q[b], sk = pb.used_k[b];
    for (int h = 0; h < c.heads; ++h) {
      const int hk = h / group;
      for (int i = 0; i < sq; ++i) {
        const float lse = pb.lse[pb.lse_index(b, h, i)];
        if (lse == kNegInf) continue;
        const std::size_t qrow = (std::size_t(pb.start_q[b] + i) * c.heads + h);
        for (int d = 0; d < c.head_dim; ++d) qs[d] = r(pb.q[qrow * c.head_dim + d] * pb.scale);
        float delta = 0.f;
        for (int d = 0; d < c.head_dim_v; ++d) delta += pb.dout[qrow * c.head_dim_v + d] * pb.out[qrow * c.head_dim_v + d];
        delta = c.dlse ? r(delta - pb.dlse[pb.lse_index(b, h, i)]) : r(delta);
        if (c.sink) d_sink[h] -= std::exp(pb.sink[h] - lse) * delta;
        for (int j = 0; j < sk; ++j) {
          const int diag = i + sk - sq;
          if ((right >= 0 && j > diag + right) || (c.window_left >= 0 && j < diag - c.window_left)) continue;
          const std::size_t krow = std::size_t(pb.start_k[b] + j) * c.heads_kv + hk;
          float dot = 0.f;
          for (int d = 0; d < c.head_dim; ++d) dot += qs[d] * pb.k[krow * c.head_dim + d];
          float s = r(dot), deriv = 1.f;
          if (c.softcap > 0.f) {
            const float t = std::tanh(s / c.softcap);
            s = r(c.softcap * t);
            deriv = 1.f - t * t;
          }
          const float p = r(std::exp(s - lse));
          float dp = 0.f;
          for (int d = 0; d < c.head_dim_v; ++d) dp += pb.dout[qrow * c.head_dim_v + d] * pb.v[krow * c.head_dim_v + d];
          const float ds = r(p * (r(dp) - delta) * deriv);
          for (int d = 0; d < c.head_dim; ++d) {
            dq[qrow * c.head_dim + d] += ds * pb.k[krow * c.head_dim + d] * pb.scale;
            dk[krow * c.head_dim + d] += ds * pb.q[qrow * c.head_dim + d] * pb.scale;
          }
          for (int d = 0; d < c.head_dim_v; ++d) dv[krow * c.head_dim_v + d] += p * pb.dout[qrow * c.head_dim_v + d];
        }
      }
    }
  }
  Grads g;
  for (float x : dq) g.dq.push_back(r(x));
  for (float x : dk) g.dk.push_back(r(x));
  for (float x : dv) g.dv.push_back(r(x));
  if (c.sink) g.d_sink.assign(d_sink.begin(), d_sink.end());
  return g;
}

// The pages of a paged case: key j of sequence b lives in pool row
// table[b][j / page] * page + j % page. Pages wholly past a sequence's used keys get entries
// outside the pool (the backward must not follow them), rows past the used keys hold NaN (it
// must not read them), and the spare pages that no entry reads (two, three with a shared page)
// must come back with zero dk / dv. Gradients are compared in the pool's rows: the reference's
// dense rows summed into the rows that hold them.
struct PagePool {
  int page = 0, per_sequence = 0, pages = 0;
  std::vector<int> table;  // (batch, per_sequence)
  const Problem* pb = nullptr;

  explicit PagePool(const Problem& problem) : pb(&problem) {
    const BwdCase& c = problem.c;
    page = c.page_size, per_sequence = c.seqlen_k / c.page_size, pages = c.batch * per_sequence + 2;
    std::vector<int> order(pages);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(c.seed + 17));
    table.resize(std::size_t(c.batch) * per_sequence);
    for (int b = 0; b < c.batch; ++b) {
      for (int p = 0; p < per_sequence; ++p) {
        const int entry = b * per_sequence + p;
        table[entry] = p * page < problem.used_k[b] ? order[entry] : pages + (1 << 20);
      }
    }
    if (c.shared_pages) table[std::size_t(per_sequence)] = table[0];
  }

  // Pool row of key j of sequence b, or -1 where the entry is no page.
  std::int64_t row(int b, int j) const {
    const int p = table[std::size_t(b) * per_sequence + j / page];
    return p < pages ? std::int64_t(p) * page + j % page : -1;
  }
  // The pool holding dense key rows `dense` ((rows_k, width)); NaN where no used key lives.
  std::vector<float> scatter(const std::vector<float>& dense, int width) const {
    std::vector<float> pool(std::size_t(pages) * page * width, std::numeric_limits<float>::quiet_NaN());
    for (int b = 0; b < pb->batch; ++b) {
      for (int j = 0; j < pb->used_k[b]; ++j) {
        std::copy_n(dense.begin() + std::size_t(pb->start_k[b] + j) * width, width,
                    pool.begin() + std::size_t(row(b, j)) * width);
      }
    }
    return pool;
  }
  // Dense gradient rows ((rows_k, width)) summed into the pool rows that hold them (0 in rows
  // no entry reaches).
  std::vector<double> summed_into_pool(const std::vector<double>& dense, int width) const {
    std::vector<double> pool(std::size_t(pages) * page * width, 0.0);
    for (int b = 0; b < pb->batch; ++b) {
      for (int j = 0; j < pb->seqlen_k; ++j) {
        const std::int64_t r = row(b, j);
        if (r < 0) continue;
        for (int i = 0; i < width; ++i) {
          pool[std::size_t(r) * width + i] += dense[std::size_t(pb->start_k[b] + j) * width + i];
        }
      }
    }
    return pool;
  }
  // Pages no entry reads: their gradient rows must be written as zeros.
  void expect_spare_pages_zero(const std::vector<std::uint16_t>& bits, int width, const char* name) const {
    std::vector<bool> read(pages, false);
    for (int p : table) {
      if (p < pages) read[p] = true;
    }
    for (int p = 0; p < pages; ++p) {
      if (read[p]) continue;
      for (std::size_t i = std::size_t(p) * page * width; i < std::size_t(p + 1) * page * width; ++i) {
        if (bits[i] != 0) {
          ADD_FAILURE() << name << " of spare page " << p << " is not zero at element " << i;
          return;
        }
      }
    }
  }
  TensorView view(void* data, DType dtype, int dim) const {
    return TensorView(data, dtype, {pages, page, pb->heads_kv, dim}, kCuda);
  }
};

struct GpuRun {
  Grads grads;
  std::vector<std::uint16_t> dq_bits, dk_bits, dv_bits;  // raw outputs, padding included
  std::vector<float> d_sink;
};

GpuRun run_gpu(const Problem& pb) {
  const BwdCase& c = pb.c;
  const int pad = c.strided ? 8 : 0;  // keeps 16-byte aligned rows
  auto device_copy = [&](const std::vector<float>& values, int rows, int heads, int dim) {
    return gpu_testing::to_device_16bit_padded(values, std::size_t(rows) * heads, dim, pad, c.dtype);
  };
  auto poisoned = [&](int rows, int heads, int dim) {
    return gpu_testing::poisoned_16bit(std::size_t(rows) * heads * (dim + pad));
  };
  std::optional<PagePool> pool;
  if (c.page_size > 0) pool.emplace(pb);
  const int key_rows = pool ? pool->pages * pool->page : pb.rows_k;
  auto key_copy = [&](const std::vector<float>& values, int dim) {
    return pool ? gpu_testing::to_device_16bit(pool->scatter(values, c.heads_kv * dim), c.dtype)
                : device_copy(values, pb.rows_k, c.heads_kv, dim);
  };
  DeviceBuffer q = device_copy(pb.q, pb.rows_q, c.heads, c.head_dim);
  DeviceBuffer k = key_copy(pb.k, c.head_dim);
  DeviceBuffer v = key_copy(pb.v, c.head_dim_v);
  DeviceBuffer out = device_copy(pb.out, pb.rows_q, c.heads, c.head_dim_v);
  DeviceBuffer dout = device_copy(pb.dout, pb.rows_q, c.heads, c.head_dim_v);
  DeviceBuffer lse = DeviceBuffer::from(pb.lse);
  DeviceBuffer dlse = c.dlse ? DeviceBuffer::from(pb.dlse) : DeviceBuffer{};
  DeviceBuffer dq = poisoned(pb.rows_q, c.heads, c.head_dim);
  DeviceBuffer dk = poisoned(key_rows, c.heads_kv, c.head_dim);
  DeviceBuffer dv = poisoned(key_rows, c.heads_kv, c.head_dim_v);
  DeviceBuffer page_table = pool ? DeviceBuffer::from(pool->table) : DeviceBuffer{};
  const gpu_testing::DeviceSequences sequences(pb);
  DeviceBuffer sink, d_sink;
  if (c.sink) {
    sink = gpu_testing::to_device_as(pb.sink, *c.sink);
    d_sink = gpu_testing::poisoned_fp32(c.heads);
  }

  BackwardArgs args;
  args.q = pb.query_view(q.data(), c.dtype, c.head_dim, kCuda, pad);
  args.k = pool ? pool->view(k.data(), c.dtype, c.head_dim) : pb.key_view(k.data(), c.dtype, c.head_dim, kCuda, pad);
  args.v = pool ? pool->view(v.data(), c.dtype, c.head_dim_v)
                : pb.key_view(v.data(), c.dtype, c.head_dim_v, kCuda, pad);
  args.out = pb.query_view(out.data(), c.dtype, c.head_dim_v, kCuda, pad);
  args.dout = pb.query_view(dout.data(), c.dtype, c.head_dim_v, kCuda, pad);
  args.lse = pb.lse_view(lse.data(), kCuda);
  if (c.dlse) args.dlse = pb.lse_view(dlse.data(), kCuda);
  args.dq = pb.query_view(dq.data(), c.dtype, c.head_dim, kCuda, pad);
  args.dk = pool ? pool->view(dk.data(), c.dtype, c.head_dim) : pb.key_view(dk.data(), c.dtype, c.head_dim, kCuda, pad);
  args.dv = pool ? pool->view(dv.data(), c.dtype, c.head_dim_v)
                 : pb.key_view(dv.data(), c.dtype, c.head_dim_v, kCuda, pad);
  if (c.sink) {
    args.learnable_sink = TensorView(sink.data(), *c.sink, {c.heads}, kCuda);
    args.d_sink = TensorView(d_sink.data(), DType::kFloat32, {c.heads}, kCuda);
  }
  args.deterministic = c.deterministic;
  pb.set_sequences(args.seq, kCuda, sequences.pointers());
  if (pool) args.seq.page_table = TensorView(page_table.data(), DType::kInt32, {c.batch, pool->per_sequence}, kCuda);
  set_options(args.opts, c);
  gpu_testing::backward_on_poisoned_workspace(args);

  GpuRun run;
  run.dq_bits = dq.to_host<std::uint16_t>();
  run.dk_bits = dk.to_host<std::uint16_t>();
  run.dv_bits = dv.to_host<std::uint16_t>();
  auto unpad = [&](const std::vector<std::uint16_t>& bits, int dim) {
    std::vector<double> values;
    for (std::size_t i = 0; i < bits.size(); ++i) {
      if (int(i % (dim + pad)) < dim) values.push_back(gpu_testing::from_bits(bits[i], c.dtype));
    }
    return values;
  };
  run.grads.dq = unpad(run.dq_bits, c.head_dim);
  run.grads.dk = unpad(run.dk_bits, c.head_dim);  // paged: the pool's rows
  run.grads.dv = unpad(run.dv_bits, c.head_dim_v);
  if (pool) {
    pool->expect_spare_pages_zero(run.dk_bits, c.heads_kv * c.head_dim, "dk");
    pool->expect_spare_pages_zero(run.dv_bits, c.heads_kv * c.head_dim_v, "dv");
  }
  if (c.sink) {
    run.d_sink = d_sink.to_host<float>();
    run.grads.d_sink.assign(run.d_sink.begin(), run.d_sink.end());
  }
  // Padding between head vectors is not the kernels' to write.
  for (const auto* bits : {&run.dq_bits, &run.dk_bits, &run.dv_bits}) {
    const int dim = bits == &run.dv_bits ? c.head_dim_v : c.head_dim;
    for (std::size_t i = 0; i < bits->size(); ++i) {
      if (int(i % (dim + pad)) >= dim) EXPECT_EQ((*bits)[i], gpu_testing::kPoison16) << "padding written at " << i;
    }
  }
  return run;
}

class GpuBackward : public ::testing::TestWithParam<BwdCase> {};

TEST_P(GpuBackward, MatchesReference) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  const BwdCase& c = GetParam();
  const Problem pb(c);
  const std::optional<GpuRun> gpu = gpu_testing::run_if_built([&] { return run_gpu(pb); });
  if (!gpu) return;
  Grads ref = run_reference(pb);
  Grads naive = naive_low_precision(pb);
  if (c.page_size > 0) {  // compared in the pool's rows
    const PagePool pool(pb);
    for (Grads* g : {&ref, &naive}) {
      g->dk = pool.summed_into_pool(g->dk, c.heads_kv * c.head_dim);
      g->dv = pool.summed_into_pool(g->dv, c.heads_kv * c.head_dim_v);
    }
    // The naive sums rounded once more, as a kernel storing them does (shared pages).
    for (auto* x : {&naive.dk, &naive.dv}) {
      for (double& value : *x) value = gpu_testing::round_to(float(value), c.dtype);
    }
  }
  expect_grad_close("dq", gpu->grads.dq, naive.dq, ref.dq);
  expect_grad_close("dk", gpu->grads.dk, naive.dk, ref.dk);
  expect_grad_close("dv", gpu->grads.dv, naive.dv, ref.dv);
  if (c.sink) expect_grad_close("d_sink", gpu->grads.d_sink, naive.d_sink, ref.d_sink);

  if (c.deterministic) {
    const GpuRun again = run_gpu(pb);
    EXPECT_EQ(gpu->dq_bits, again.dq_bits) << "dq differs between two deterministic runs";
    EXPECT_EQ(gpu->dk_bits, again.dk_bits) << "dk differs between two deterministic runs";
    EXPECT_EQ(gpu->dv_bits, again.dv_bits) << "dv differs between two deterministic runs";
    if (c.sink) {
      EXPECT_EQ(0, std::memcmp(gpu->d_sink.data(), again.d_sink.data(), gpu->d_sink.size() * sizeof(float)))
          << "d_sink differs between two deterministic runs";
    }
  }
}

std::vector<BwdCase> backward_cases() {
  const std::pair<int, int> head_dims[] = {{64, 64}, {96, 96}, {128, 128}, {192, 192}, {192, 128}, {256, 256}};
  std::vector<BwdCase> cases;
  unsigned seed = 1000;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (auto [d, dv] : head_dims) {
      // fp16 runs the first cases and those marked for both dtypes; bf16 runs every case.
      auto add = [&](BwdCase c, bool fp16_too = false) {
        if (dtype == DType::kFloat16 && !fp16_too) return;
        c.dtype = dtype;
        c.head_dim = d;
        c.head_dim_v = dv;
        c.seed = seed++;
        cases.push_back(c);
      };
      BwdCase c;
      c = {};
      c.label = "dense", c.batch = 2, c.seqlen_q = 257, c.seqlen_k = 257, c.heads = 3, c.heads_kv = 3;
      add(c, true);
      c = {};
      c.label = "causal_long", c.batch = 1, c.seqlen_q = 1023, c.seqlen_k = 1023, c.heads = 2, c.heads_kv = 2,
      c.causal = true;
      add(c, true);
      c = {};
      c.label = "varlen_causal_gqa", c.batch = 4, c.seqlen_q = 300, c.seqlen_k = 333, c.heads = 4, c.heads_kv = 1,
      c.causal = true, c.varlen = true;
      add(c, true);
      c = {};  // a gradient reaching lse where rows see no key (lse -inf, dlse NaN there: unread)
      c.label = "dlse_causal_sq_gt_sk", c.batch = 2, c.seqlen_q = 300, c.seqlen_k = 100, c.heads = 4, c.heads_kv = 2,
      c.causal = true, c.dlse = true;
      add(c, true);
      c = {};  // masked keys (causal, past the keys in the last block) under a scale of 0
      c.label = "zero_scale_causal", c.batch = 2, c.seqlen_q = 200, c.seqlen_k = 333, c.heads = 2, c.heads_kv = 2,
      c.causal = true, c.zero_scale = true;
      add(c);
      c = {};
      c.label = "odd_lengths_sq_ne_sk", c.batch = 2, c.seqlen_q = 17, c.seqlen_k = 1023, c.heads = 2, c.heads_kv = 2;
      add(c);
      c = {};
      c.label = "causal_decode_mqa", c.batch = 2, c.seqlen_q = 17, c.seqlen_k = 700, c.heads = 8, c.heads_kv = 1,
      c.causal = true;
      add(c);
      c = {};
      c.label = "causal_sq_gt_sk", c.batch = 1, c.seqlen_q = 300, c.seqlen_k = 100, c.heads = 2, c.heads_kv = 2,
      c.causal = true;
      add(c, true);
      c = {};
      c.label = "local_gqa2", c.batch = 1, c.seqlen_q = 513, c.seqlen_k = 513, c.heads = 4, c.heads_kv = 2,
      c.window_left = 64, c.window_right = 32;
      add(c);
      c = {};
      c.label = "local_left_only", c.batch = 2, c.seqlen_q = 200, c.seqlen_k = 700, c.heads = 2, c.heads_kv = 2,
      c.window_left = 100;
      add(c);
      c = {};
      c.label = "local_right_only_sq_gt_sk", c.batch = 1, c.seqlen_q = 400, c.seqlen_k = 150, c.heads = 2,
      c.heads_kv = 2, c.window_right = 10;
      add(c);
      c = {};
      c.label = "softcap", c.batch = 2, c.seqlen_q = 255, c.seqlen_k = 255, c.heads = 2, c.heads_kv = 2,
      c.softcap = 30.f;
      add(c);
      c = {};
      c.label = "softcap_causal_gqa", c.batch = 1, c.seqlen_q = 300, c.seqlen_k = 300, c.heads = 4, c.heads_kv = 2,
      c.causal = true, c.softcap = 15.f;
      add(c);
      // Softcap changes the tile at some head dims (a per-element derivative): the workspace
      // rows, the semaphores and the packed sequences must follow it.
      c = {};
      c.label = "softcap_deterministic_varlen_local", c.batch = 3, c.seqlen_q = 420, c.seqlen_k = 390, c.heads = 4,
      c.heads_kv = 2, c.varlen = true, c.window_left = 90, c.window_right = 20, c.softcap = 20.f,
      c.deterministic = true;
      add(c, true);
      c = {};
      c.label = "sink_fp32_one_query", c.batch = 3, c.seqlen_q = 1, c.seqlen_k = 17, c.heads = 4, c.heads_kv = 4,
      c.sink = DType::kFloat32;
      add(c);
      c = {};
      c.label = "sink_bf16_causal", c.batch = 1, c.seqlen_q = 129, c.seqlen_k = 129, c.heads = 2, c.heads_kv = 2,
      c.causal = true, c.sink = DType::kBFloat16;
      add(c, true);
      c = {};
      c.label = "sink_fp16_local_mqa", c.batch = 1, c.seqlen_q = 190, c.seqlen_k = 260, c.heads = 2, c.heads_kv = 1,
      c.window_left = 20, c.window_right = 0, c.sink = DType::kFloat16;
      add(c);
      c = {};
      c.label = "varlen_seqused", c.batch = 5, c.seqlen_q = 200, c.seqlen_k = 150, c.heads = 2, c.heads_kv = 2,
      c.varlen = true, c.seqused = true;
      add(c);
      c = {};
      c.label = "dense_seqused_causal_gqa", c.batch = 3, c.seqlen_q = 130, c.seqlen_k = 190, c.heads = 2,
      c.heads_kv = 1, c.causal = true, c.seqused = true;
      add(c);
      c = {};
      c.label = "strided_gqa3", c.batch = 2, c.seqlen_q = 150, c.seqlen_k = 211, c.heads = 6, c.heads_kv = 2,
      c.strided = true;
      add(c);
      c = {};  // packed sequences in wider rows (inputs and gradients), deterministic
      c.label = "varlen_strided_local_deterministic", c.batch = 3, c.seqlen_q = 330, c.seqlen_k = 300, c.heads = 4,
      c.heads_kv = 2, c.varlen = true, c.seqused = true, c.window_left = 70, c.window_right = 30, c.strided = true,
      c.deterministic = true;
      add(c);
      c = {};
      c.label = "gqa8", c.batch = 1, c.seqlen_q = 128, c.seqlen_k = 384, c.heads = 8, c.heads_kv = 1;
      add(c);
      c = {};
      c.label = "single_row_and_key", c.batch = 3, c.seqlen_q = 1, c.seqlen_k = 1, c.heads = 2, c.heads_kv = 2;
      add(c);
      c = {};
      c.label = "deterministic_dense", c.batch = 2, c.seqlen_q = 700, c.seqlen_k = 700, c.heads = 2, c.heads_kv = 2,
      c.deterministic = true;
      add(c);
      c = {};
      c.label = "deterministic_causal_gqa_sink", c.batch = 2, c.seqlen_q = 600, c.seqlen_k = 650, c.heads = 6,
      c.heads_kv = 2, c.causal = true, c.sink = DType::kFloat32, c.deterministic = true;
      add(c, true);
      c = {};
      c.label = "deterministic_varlen_local", c.batch = 4, c.seqlen_q = 500, c.seqlen_k = 520, c.heads = 3,
      c.heads_kv = 1, c.varlen = true, c.window_left = 150, c.window_right = 40, c.deterministic = true;
      add(c);
      // The deterministic orders: rotated walks per packed sequence (no window, keys no more
      // numerous than rows), plain ascending order (more column blocks than row blocks), and the
      // descending causal order with more queries than keys.
      c = {};
      c.label = "deterministic_varlen_gqa", c.batch = 3, c.seqlen_q = 640, c.seqlen_k = 560, c.heads = 4,
      c.heads_kv = 2, c.varlen = true, c.deterministic = true;
      add(c);
      c = {};
      c.label = "deterministic_wide_keys", c.batch = 2, c.seqlen_q = 100, c.seqlen_k = 900, c.heads = 2,
      c.heads_kv = 2, c.deterministic = true;
      add(c);
      c = {};
      c.label = "deterministic_causal_tall", c.batch = 2, c.seqlen_q = 900, c.seqlen_k = 300, c.heads = 3,
      c.heads_kv = 3, c.causal = true, c.seqused = true, c.deterministic = true;
      add(c);
      // Deterministic causal / local without GQA: more CTAs than an H200 has SMs (144 at hdim128,
      // 234 at hdim256), so later column blocks launch as earlier ones end; and a local window
      // over packed sequences, whose column blocks walk unequal numbers of row blocks.
      c = {};
      c.label = "deterministic_causal_mha_many_ctas", c.batch = 3, c.seqlen_q = 1024, c.seqlen_k = 1024,
      c.heads = 6, c.heads_kv = 6, c.causal = true, c.deterministic = true;
      add(c);
      c = {};
      c.label = "deterministic_varlen_local_mha", c.batch = 3, c.seqlen_q = 520, c.seqlen_k = 500,
      c.heads = 3, c.heads_kv = 3, c.varlen = true, c.window_left = 130, c.window_right = 20,
      c.deterministic = true;
      add(c);
      // More CTAs than SMs (160-256: 5-8 column blocks per head, none dividing 132): on 132 SMs
      // some head's column blocks split over two launch windows and rotate within each (the
      // rotated walks auto takes here; as many rows as keys, so that no group has more column
      // blocks than row blocks).
      c = {};
      c.label = "deterministic_many_ctas", c.batch = 4, c.seqlen_q = 600, c.seqlen_k = 600, c.heads = 8,
      c.heads_kv = 2, c.deterministic = true;
      add(c);
      // Device seqused past the rows (not checkable on the host): capped at each length.
      add(gpu_testing::varlen_seqused_past_case<BwdCase>());
      // NaN in the rows past seqused (unfilled cache tails): the kernel must not read them into
      // any gradient (0 * NaN is NaN).
      c = {};
      c.label = "varlen_seqused_nan_tail", c.batch = 4, c.seqlen_q = 300, c.seqlen_k = 333, c.heads = 4,
      c.heads_kv = 2, c.varlen = true, c.seqused = true, c.nan_tail = true;
      add(c);
      c = {};
      c.label = "varlen_full_then_nan_tail", c.batch = 5, c.seqlen_q = 300, c.seqlen_k = 333, c.heads = 2,
      c.heads_kv = 1, c.varlen = true, c.seqused = true, c.seqused_past = 7, c.nan_tail = true;
      add(c);
      c = {};
      c.label = "dense_seqused_nan_tail_causal_deterministic", c.batch = 3, c.seqlen_q = 190, c.seqlen_k = 250,
      c.heads = 2, c.heads_kv = 1, c.causal = true, c.seqused = true, c.nan_tail = true, c.deterministic = true;
      add(c);
      c = {};
      c.label = "dense_seqused_past_deterministic", c.batch = 3, c.seqlen_q = 150, c.seqlen_k = 230,
      c.heads = 2, c.heads_kv = 2, c.seqused = true, c.seqused_past = 129, c.deterministic = true;
      add(c);
      // Paged k / v (gathered into dense rows, the dense backward, dk / dv summed back per page):
      // whole-block and odd page sizes, keys ending mid-page, a sequence without keys, a page two
      // sequences share, seqused past the pages, a window with a gradient of lse, softcap with a
      // sink, deterministic twice.
      c = {};
      c.label = "paged_causal_gqa_seqused", c.batch = 3, c.seqlen_q = 90, c.seqlen_k = 6 * 64, c.heads = 4,
      c.heads_kv = 2, c.causal = true, c.seqused = true, c.page_size = 64;
      add(c, true);
      c = {};
      c.label = "paged_shared_softcap_sink_deterministic", c.batch = 3, c.seqlen_q = 70, c.seqlen_k = 20 * 16,
      c.heads = 4, c.heads_kv = 1, c.seqused = true, c.softcap = 20.f, c.sink = DType::kFloat32,
      c.deterministic = true, c.page_size = 16, c.shared_pages = true;
      add(c, true);
      c = {};
      c.label = "paged_local_dlse", c.batch = 2, c.seqlen_q = 150, c.seqlen_k = 3 * 128, c.heads = 2, c.heads_kv = 2,
      c.window_left = 100, c.window_right = 0, c.dlse = true, c.page_size = 128;
      add(c);
      c = {};
      c.label = "paged_page3_decode_gqa4_seqused_past", c.batch = 4, c.seqlen_q = 3, c.seqlen_k = 50 * 3, c.heads = 8,
      c.heads_kv = 2, c.causal = true, c.seqused = true, c.seqused_past = 40, c.page_size = 3;
      add(c);
    }
  }
  // Head dims that are not a kernel's own (zero-filled up to the next compiled one).
  BwdCase c;
  c.label = "head_dim_40", c.batch = 2, c.seqlen_q = 190, c.seqlen_k = 170, c.heads = 2, c.heads_kv = 1,
  c.head_dim = 40, c.head_dim_v = 40, c.causal = true, c.seed = seed++;
  cases.push_back(c);
  c = {};
  c.label = "head_dim_120", c.batch = 1, c.seqlen_q = 333, c.seqlen_k = 290, c.heads = 2, c.heads_kv = 2,
  c.head_dim = 120, c.head_dim_v = 120, c.seed = seed++;
  cases.push_back(c);
  c = {};
  c.label = "head_dims_64_128", c.batch = 1, c.seqlen_q = 200, c.seqlen_k = 200, c.heads = 2, c.heads_kv = 2,
  c.head_dim = 64, c.head_dim_v = 128, c.causal = true, c.seed = seed++;
  cases.push_back(c);
  // Padded to 256: the sliced hdim256 kernel's head-dim halves with zero columns in the second,
  // key lengths not a multiple of its 80-key column blocks, GQA.
  c = {};
  c.label = "head_dim_200_causal_gqa", c.batch = 2, c.seqlen_q = 333, c.seqlen_k = 410, c.heads = 4,
  c.heads_kv = 2, c.head_dim = 200, c.head_dim_v = 200, c.causal = true, c.seed = seed++;
  cases.push_back(c);
  // The sliced hdim256 kernel's dQ by bulk copies: a local window whose column blocks see row
  // blocks in different numbers and whose last column block is partial; packed causal sequences
  // capped by seqused, where walks differ in length and some column blocks see no row.
  c = {};
  c.label = "local_odd_columns", c.batch = 2, c.seqlen_q = 450, c.seqlen_k = 390, c.heads = 2,
  c.heads_kv = 2, c.head_dim = 256, c.head_dim_v = 256, c.window_left = 100, c.window_right = 30, c.seed = seed++;
  cases.push_back(c);
  c = {};
  c.label = "varlen_seqused_causal", c.batch = 4, c.seqlen_q = 380, c.seqlen_k = 410, c.heads = 3,
  c.heads_kv = 1, c.head_dim = 256, c.head_dim_v = 256, c.varlen = true, c.seqused = true, c.causal = true,
  c.seed = seed++;
  cases.push_back(c);
  // A narrow local window past the sliced kernels' 32 row blocks (35 of 64 rows): dQ from first
  // stores there too (dq_narrow_window), deterministic and not.
  c = {};
  c.label = "local_narrow_long", c.batch = 1, c.seqlen_q = 2200, c.seqlen_k = 2150, c.heads = 2,
  c.heads_kv = 1, c.head_dim = 256, c.head_dim_v = 256, c.window_left = 200, c.window_right = 60, c.seed = seed++;
  cases.push_back(c);
  c.label = "local_narrow_long_deterministic", c.deterministic = true, c.seed = seed++;
  cases.push_back(c);
  // Deterministic without a window and more column blocks (134 of 80 keys) than an H200 has SMs:
  // the plain ascending dQ order instead of the rotated one.
  c = {};
  c.label = "deterministic_many_columns", c.batch = 1, c.seqlen_q = 70, c.seqlen_k = 10700, c.heads = 2,
  c.heads_kv = 2, c.head_dim = 256, c.head_dim_v = 256, c.deterministic = true, c.seed = seed++;
  cases.push_back(c);
  // A gradient reaching lse (dPsum = rowsum(dO * O) - dlse in the preprocess): with a sink and
  // softcap over packed sequences with empty rows, and deterministic causal GQA, at every head dim.
  for (auto [d, dv] : head_dims) {
    c = {};
    c.label = "dlse_varlen_sink_softcap", c.batch = 3, c.seqlen_q = 230, c.seqlen_k = 250, c.heads = 4,
    c.heads_kv = 2, c.head_dim = d, c.head_dim_v = dv, c.varlen = true, c.sink = DType::kFloat32,
    c.softcap = 20.f, c.dlse = true, c.seed = seed++;
    cases.push_back(c);
    c = {};
    c.label = "dlse_causal_gqa_deterministic", c.batch = 2, c.seqlen_q = 300, c.seqlen_k = 300, c.heads = 4,
    c.heads_kv = 1, c.head_dim = d, c.head_dim_v = dv, c.causal = true, c.deterministic = true, c.dlse = true,
    c.seed = seed++;
    cases.push_back(c);
  }
  // Packed sequences without the max_seqlen hints: the preprocess and the dQ conversion walk the
  // row-block list, the main kernel and the dK / dV conversion the column-block list (each case's
  // rectangle, batch x the total, is more than twice the lists). Sequence 0 is the longest,
  // sequence 1 has no queries and sequence 2 no keys (draw_lengths); the dQ conversion waits for
  // each sequence's own count of column blocks. The orders: heads inner (MHA causal at hdim128
  // and the bulk-dQ hdim256), deterministic causal (each sequence's column blocks from the last
  // down) and without a window (rotated walks); more sequences than the list kernel's 512
  // threads. Seeds of their own.
  unsigned list_seed = 3000;
  for (auto [d, dv] : head_dims) {
    auto add = [&](BwdCase c) {
      c.head_dim = d, c.head_dim_v = dv, c.varlen = true, c.no_hints = true, c.seed = list_seed++;
      cases.push_back(c);
    };
    c = {};
    c.label = "block_list_causal_gqa", c.batch = 12, c.seqlen_q = 300, c.seqlen_k = 333, c.heads = 4, c.heads_kv = 1,
    c.causal = true;
    add(c);
    c = {};
    c.label = "block_list_causal_mha", c.batch = 6, c.seqlen_q = 400, c.seqlen_k = 400, c.heads = 3, c.heads_kv = 3,
    c.causal = true;
    add(c);
    c = {};
    c.label = "block_list_deterministic_causal", c.batch = 5, c.seqlen_q = 420, c.seqlen_k = 450, c.heads = 3,
    c.heads_kv = 3, c.causal = true, c.deterministic = true;
    add(c);
    c = {};
    c.label = "block_list_deterministic_gqa", c.batch = 4, c.seqlen_q = 640, c.seqlen_k = 560, c.heads = 4,
    c.heads_kv = 2, c.deterministic = true;
    add(c);
    c = {};
    c.label = "block_list_seqused_sink_dlse", c.batch = 9, c.seqlen_q = 260, c.seqlen_k = 300, c.heads = 2,
    c.heads_kv = 2, c.seqused = true, c.sink = DType::kFloat32, c.dlse = true;
    add(c);
    c = {};
    c.label = "block_list_local_strided_softcap", c.batch = 7, c.seqlen_q = 330, c.seqlen_k = 300, c.heads = 4,
    c.heads_kv = 2, c.window_left = 70, c.window_right = 30, c.strided = true, c.softcap = 20.f;
    add(c);
    c = {};
    c.label = "block_list_600_sequences", c.batch = 600, c.seqlen_q = 20, c.seqlen_k = 30, c.heads = 2,
    c.heads_kv = 1;
    add(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Options, GpuBackward, ::testing::ValuesIn(backward_cases()), gpu_testing::CaseName());

}  // namespace
}  // namespace cuflash
