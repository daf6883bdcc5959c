// cuflash demo: random attention forward + backward.
//
// With a usable Hopper GPU (cuflash::cuda_available()), runs bf16 on the device and compares it
// with the CPU reference; otherwise runs the CPU reference in fp32 and bf16 and compares it with
// a naive computation in double precision. Prints the shapes, the time and the largest error,
// and exits non-zero when an error is out of bounds.
//
//   cuflash_demo          GPU when available, else CPU
//   cuflash_demo --cpu    CPU reference only
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuflash/cuflash.hpp"

#if CUFLASH_HAS_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using cuflash::DType;
using cuflash::TensorView;

// --- bfloat16 storage -------------------------------------------------------------------------

std::uint16_t to_bf16(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);                  // round to nearest even
  return static_cast<std::uint16_t>(bits >> 16);
}

float from_bf16(std::uint16_t value) {
  const std::uint32_t bits = std::uint32_t{value} << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

// --- Problem ----------------------------------------------------------------------------------

struct Problem {
  int batch, seqlen_q, seqlen_k, num_heads, num_heads_kv, head_dim;
  bool causal;

  std::int64_t q_size() const { return std::int64_t{batch} * seqlen_q * num_heads * head_dim; }
  std::int64_t kv_size() const { return std::int64_t{batch} * seqlen_k * num_heads_kv * head_dim; }
  std::int64_t lse_size() const { return std::int64_t{batch} * num_heads * seqlen_q; }
  std::string describe(const char* dtype) const {
    char text[256];
    std::snprintf(text, sizeof(text), "q (%d, %d, %d, %d), k/v (%d, %d, %d, %d), %s, %s", batch,
                  seqlen_q, num_heads, head_dim, batch, seqlen_k, num_heads_kv, head_dim, dtype,
                  causal ? "causal" : "not causal");
    return text;
  }
};

// Host tensors in fp32 holding the values of the run (bf16-representable for bf16 runs).
struct HostData {
  std::vector<float> q, k, v, dout;
  std::vector<float> out, lse, dq, dk, dv;
};

HostData random_data(const Problem& p, bool round_to_bf16, unsigned seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto fill = [&](std::int64_t n) {
    std::vector<float> values(static_cast<std::size_t>(n));
    for (float& x : values)
      x = round_to_bf16 ? from_bf16(to_bf16(normal(generator))) : normal(generator);
    return values;
  };
  HostData d;
  d.q = fill(p.q_size());
  d.k = fill(p.kv_size());
  d.v = fill(p.kv_size());
  d.dout = fill(p.q_size());
  return d;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;  // also equal infinities (lse of a fully masked row)
    const double diff = std::fabs(double{a[i]} - double{b[i]});
    if (std::isnan(diff)) return INFINITY;
    worst = std::max(worst, diff);
  }
  return worst;
}

double elapsed_ms(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// --- Naive attention in double precision (dense, bottom-right causal) -------------------------

void naive_attention(const Problem& p, HostData& d) {
  const int group = p.num_heads / p.num_heads_kv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  const int D = p.head_dim;
  d.out.assign(p.q_size(), 0.f);
  d.lse.assign(p.lse_size(), 0.f);
  d.dq.assign(p.q_size(), 0.f);
  d.dk.assign(p.kv_size(), 0.f);
  d.dv.assign(p.kv_size(), 0.f);
  std::vector<double> dk(p.kv_size(), 0.0), dv(p.kv_size(), 0.0);
  std::vector<double> prob(p.seqlen_k), dprob(p.seqlen_k);
  auto q_at = [&](int b, int i, int h) {
    return ((std::int64_t{b} * p.seqlen_q + i) * p.num_heads + h) * D;
  };
  auto k_at = [&](int b, int j, int h) {
    return ((std::int64_t{b} * p.seqlen_k + j) * p.num_heads_kv + h) * D;
  };
  for (int b = 0; b < p.batch; ++b) {
    for (int h = 0; h < p.num_heads; ++h) {
      const int hk = h / group;
      for (int i = 0; i < p.seqlen_q; ++i) {
        const std::int64_t qi = q_at(b, i, h);
        const int last = p.causal ? i + p.seqlen_k - p.seqlen_q : p.seqlen_k - 1;
        double row_max = -INFINITY;
        for (int j = 0; j < p.seqlen_k; ++j) {
          if (j > last) {
            prob[j] = -INFINITY;
            continue;
          }
          double dot = 0;
          for (int c = 0; c < D; ++c) dot += double{d.q[qi + c]} * d.k[k_at(b, j, hk) + c];
          prob[j] = dot * scale;
          row_max = std::max(row_max, prob[j]);
        }
        double sum = 0;
        for (int j = 0; j < p.seqlen_k; ++j) {
          prob[j] = j > last ? 0.0 : std::exp(prob[j] - row_max);
          sum += prob[j];
        }
        const std::int64_t lse_index = (std::int64_t{b} * p.num_heads + h) * p.seqlen_q + i;
        if (sum == 0) {
          d.lse[lse_index] = -INFINITY;
          continue;  // no visible key: out and gradients stay 0
        }
        d.lse[lse_index] = static_cast<float>(row_max + std::log(sum));
        for (int j = 0; j < p.seqlen_k; ++j) prob[j] /= sum;
        std::vector<double> out(D, 0.0);
        for (int j = 0; j < p.seqlen_k; ++j) {
          for (int c = 0; c < D; ++c) out[c] += prob[j] * d.v[k_at(b, j, hk) + c];
        }
        double dot_out = 0;  // rowsum(dout * out)
        for (int c = 0; c < D; ++c) {
          d.out[qi + c] = static_cast<float>(out[c]);
          dot_out += double{d.dout[qi + c]} * out[c];
        }
        std::vector<double> dq(D, 0.0);
        for (int j = 0; j < p.seqlen_k; ++j) {
          if (prob[j] == 0) continue;
          double dp = 0;
          for (int c = 0; c < D; ++c) dp += double{d.dout[qi + c]} * d.v[k_at(b, j, hk) + c];
          const double ds = prob[j] * (dp - dot_out);
          for (int c = 0; c < D; ++c) {
            dq[c] += ds * scale * d.k[k_at(b, j, hk) + c];
            dk[k_at(b, j, hk) + c] += ds * scale * d.q[qi + c];
            dv[k_at(b, j, hk) + c] += prob[j] * d.dout[qi + c];
          }
        }
        for (int c = 0; c < D; ++c) d.dq[qi + c] = static_cast<float>(dq[c]);
      }
    }
  }
  for (std::size_t i = 0; i < dk.size(); ++i) {
    d.dk[i] = static_cast<float>(dk[i]);
    d.dv[i] = static_cast<float>(dv[i]);
  }
}

// --- cuflash calls on host or device buffers --------------------------------------------------

struct Buffers {
  void *q, *k, *v, *out, *lse, *dout, *dq, *dk, *dv;
};

cuflash::ForwardArgs forward_args(const Problem& p, const Buffers& b, DType dtype,
                                  cuflash::Device device) {
  cuflash::ForwardArgs args;
  args.q = TensorView(b.q, dtype, {p.batch, p.seqlen_q, p.num_heads, p.head_dim}, device);
  args.k = TensorView(b.k, dtype, {p.batch, p.seqlen_k, p.num_heads_kv, p.head_dim}, device);
  args.v = TensorView(b.v, dtype, {p.batch, p.seqlen_k, p.num_heads_kv, p.head_dim}, device);
  args.out = TensorView(b.out, dtype, {p.batch, p.seqlen_q, p.num_heads, p.head_dim}, device);
  args.lse = TensorView(b.lse, DType::kFloat32, {p.batch, p.num_heads, p.seqlen_q}, device);
  args.opts.causal = p.causal;
  return args;
}

cuflash::BackwardArgs backward_args(const cuflash::ForwardArgs& fwd, const Buffers& b) {
  cuflash::BackwardArgs args;
  args.q = fwd.q;
  args.k = fwd.k;
  args.v = fwd.v;
  args.out = fwd.out;
  args.lse = *fwd.lse;
  args.dout = fwd.out;
  args.dout.data = b.dout;
  args.dq = fwd.q;
  args.dq.data = b.dq;
  args.dk = fwd.k;
  args.dk.data = b.dk;
  args.dv = fwd.v;
  args.dv.data = b.dv;
  args.opts = fwd.opts;
  return args;
}

// Host storage of one dtype for the inputs and outputs of a CPU run.
struct HostStorage {
  DType dtype;
  std::vector<float> f32[9];
  std::vector<std::uint16_t> bf16[9];

  void* add(int slot, const std::vector<float>& values) {
    if (dtype == DType::kFloat32) {
      f32[slot] = values;
      return f32[slot].data();
    }
    bf16[slot].resize(values.size());
    for (std::size_t i = 0; i < values.size(); ++i) bf16[slot][i] = to_bf16(values[i]);
    return bf16[slot].data();
  }
  std::vector<float> read(int slot) const {
    if (dtype == DType::kFloat32) return f32[slot];
    std::vector<float> values(bf16[slot].size());
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = from_bf16(bf16[slot][i]);
    return values;
  }
};

// Runs forward + backward on the CPU reference; fills `result` (out, lse, dq, dk, dv).
void run_cpu(const Problem& p, DType dtype, const HostData& in, HostData& result, double& fwd_ms,
             double& bwd_ms) {
  HostStorage s{dtype, {}, {}};
  const std::vector<float> zeros_q(p.q_size(), 0.f), zeros_kv(p.kv_size(), 0.f);
  Buffers b{};
  b.q = s.add(0, in.q);
  b.k = s.add(1, in.k);
  b.v = s.add(2, in.v);
  b.out = s.add(3, zeros_q);
  b.dout = s.add(4, in.dout);
  b.dq = s.add(5, zeros_q);
  b.dk = s.add(6, zeros_kv);
  b.dv = s.add(7, zeros_kv);
  std::vector<float> lse(p.lse_size(), 0.f);
  b.lse = lse.data();

  const cuflash::ForwardArgs fwd = forward_args(p, b, dtype, cuflash::Device{});
  auto start = std::chrono::steady_clock::now();
  cuflash::forward(fwd);
  fwd_ms = elapsed_ms(start);
  start = std::chrono::steady_clock::now();
  cuflash::backward(backward_args(fwd, b));
  bwd_ms = elapsed_ms(start);

  result.out = s.read(3);
  result.lse = lse;
  result.dq = s.read(5);
  result.dk = s.read(6);
  result.dv = s.read(7);
}

struct Report {
  bool ok = true;
  void line(const char* what, double error, double bound) {
    const bool pass = error <= bound;
    ok = ok && pass;
    std::printf("  max |%s - expected| = %.3e  (bound %.1e)%s\n", what, error, bound,
                pass ? "" : "  <-- too large");
  }
};

void compare(Report& report, const HostData& got, const HostData& expected, double bound) {
  report.line("out", max_abs_diff(got.out, expected.out), bound);
  report.line("lse", max_abs_diff(got.lse, expected.lse), bound);
  report.line("dq ", max_abs_diff(got.dq, expected.dq), bound);
  report.line("dk ", max_abs_diff(got.dk, expected.dk), bound);
  report.line("dv ", max_abs_diff(got.dv, expected.dv), bound);
}

int run_cpu_demo() {
  const Problem p{2, 128, 192, 4, 2, 64, true};
  const char* why = cuflash::cuda_available() ? "forced with --cpu"
                    : CUFLASH_HAS_CUDA        ? "no usable Hopper GPU found"
                                              : "cuflash was built without CUDA";
  std::printf("cuflash %s demo on the CPU reference (%s)\n", cuflash::version(), why);
  Report report;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const bool bf16 = dtype == DType::kBFloat16;
    HostData expected = random_data(p, bf16, 1234);
    HostData got;
    double fwd_ms = 0, bwd_ms = 0;
    run_cpu(p, dtype, expected, got, fwd_ms, bwd_ms);
    const auto start = std::chrono::steady_clock::now();
    naive_attention(p, expected);
    const double naive_ms = elapsed_ms(start);
    std::printf("%s\n  forward %.1f ms, backward %.1f ms (naive fp64 forward+backward %.1f ms)\n",
                p.describe(cuflash::dtype_name(dtype)).c_str(), fwd_ms, bwd_ms, naive_ms);
    // fp32 outputs match the fp64 computation closely; bf16 outputs are rounded to 8 bits.
    compare(report, got, expected, bf16 ? 5e-2 : 1e-4);
  }
  std::printf("%s\n", report.ok ? "demo passed" : "demo FAILED");
  return report.ok ? 0 : 1;
}

#if CUFLASH_HAS_CUDA

bool check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "%s failed: %s\n", what, cudaGetErrorString(status));
    return false;
  }
  return true;
}

std::vector<std::uint16_t> to_bf16_vector(const std::vector<float>& values) {
  std::vector<std::uint16_t> bits(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) bits[i] = to_bf16(values[i]);
  return bits;
}

std::vector<float> from_device_bf16(const void* device, std::int64_t n) {
  std::vector<std::uint16_t> bits(static_cast<std::size_t>(n));
  check(cudaMemcpy(bits.data(), device, n * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
  std::vector<float> values(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) values[i] = from_bf16(bits[i]);
  return values;
}

int run_gpu_demo() {
  const Problem p{2, 1024, 1024, 8, 8, 128, false};
  std::printf("cuflash %s demo on the GPU (kernels in this build:", cuflash::version());
  for (const std::string& name : cuflash::built_kernels()) std::printf(" [%s]", name.c_str());
  std::printf(")\n%s\n", p.describe("bfloat16").c_str());

  const HostData in = random_data(p, /*round_to_bf16=*/true, 1234);
  Buffers b{};
  void** slots[] = {&b.q, &b.k, &b.v, &b.out, &b.dout, &b.dq, &b.dk, &b.dv, &b.lse};
  const std::int64_t sizes[] = {p.q_size() * 2,  p.kv_size() * 2, p.kv_size() * 2,
                                p.q_size() * 2,  p.q_size() * 2,  p.q_size() * 2,
                                p.kv_size() * 2, p.kv_size() * 2, p.lse_size() * 4};
  for (int i = 0; i < 9; ++i) {
    if (!check(cudaMalloc(slots[i], sizes[i]), "cudaMalloc")) return 1;
    cudaMemset(*slots[i], 0xff, sizes[i]);  // poison: unwritten outputs show up as NaN
  }
  const std::vector<float>* inputs[] = {&in.q, &in.k, &in.v, nullptr, &in.dout};
  for (int i = 0; i < 5; ++i) {
    if (inputs[i] == nullptr) continue;
    const std::vector<std::uint16_t> bits = to_bf16_vector(*inputs[i]);
    if (!check(cudaMemcpy(*slots[i], bits.data(), bits.size() * 2, cudaMemcpyHostToDevice),
               "cudaMemcpy")) {
      return 1;
    }
  }

  const cuflash::Device device{cuflash::DeviceType::kCUDA, 0};
  const cuflash::ForwardArgs fwd = forward_args(p, b, DType::kBFloat16, device);
  HostData got;
  Report report;
  bool ran_backward = false;
  double fwd_ms = 0, bwd_ms = 0;
  try {
    cuflash::forward(fwd);  // warm-up: first launch loads the module
    check(cudaDeviceSynchronize(), "forward");
    auto start = std::chrono::steady_clock::now();
    cuflash::forward(fwd);
    check(cudaDeviceSynchronize(), "forward");
    fwd_ms = elapsed_ms(start);
    got.out = from_device_bf16(b.out, p.q_size());
    got.lse.resize(p.lse_size());
    check(cudaMemcpy(got.lse.data(), b.lse, p.lse_size() * 4, cudaMemcpyDeviceToHost),
          "cudaMemcpy");
    const double flops = 4.0 * p.batch * p.num_heads * p.seqlen_q * p.seqlen_k * p.head_dim;
    std::printf("  forward %.3f ms (%.1f TFLOP/s)\n", fwd_ms, flops / fwd_ms * 1e-9);
  } catch (const cuflash::Error& error) {
    std::printf("  forward failed: %s\n", error.what());
    return 1;
  }
  try {
    auto start = std::chrono::steady_clock::now();
    cuflash::backward(backward_args(fwd, b));
    check(cudaDeviceSynchronize(), "backward");
    bwd_ms = elapsed_ms(start);
    got.dq = from_device_bf16(b.dq, p.q_size());
    got.dk = from_device_bf16(b.dk, p.kv_size());
    got.dv = from_device_bf16(b.dv, p.kv_size());
    ran_backward = true;
    std::printf("  backward %.3f ms\n", bwd_ms);
  } catch (const cuflash::Error& error) {
    if (error.kind() != cuflash::Error::Kind::kNotSupported &&
        error.kind() != cuflash::Error::Kind::kNotBuilt) {
      std::printf("  backward failed: %s\n", error.what());
      return 1;
    }
    std::printf("  backward not available on the GPU in this build: %s\n", error.what());
  }
  for (void** slot : slots) cudaFree(*slot);

  // The oracle: the CPU reference in fp32 on the same (bf16-representable) values.
  HostData expected;
  double cpu_fwd_ms = 0, cpu_bwd_ms = 0;
  run_cpu(p, DType::kFloat32, in, expected, cpu_fwd_ms, cpu_bwd_ms);
  std::printf("  CPU reference (fp32): forward %.0f ms, backward %.0f ms\n", cpu_fwd_ms,
              cpu_bwd_ms);
  const double bound = 2e-2;
  report.line("out", max_abs_diff(got.out, expected.out), bound);
  report.line("lse", max_abs_diff(got.lse, expected.lse), bound);
  if (ran_backward) {
    report.line("dq ", max_abs_diff(got.dq, expected.dq), bound);
    report.line("dk ", max_abs_diff(got.dk, expected.dk), bound);
    report.line("dv ", max_abs_diff(got.dv, expected.dv), bound);
  }
  std::printf("%s\n", report.ok ? "demo passed" : "demo FAILED");
  return report.ok ? 0 : 1;
}

#endif  // CUFLASH_HAS_CUDA

}  // namespace

int main(int argc, char** argv) {
  const bool force_cpu = argc > 1 && std::string(argv[1]) == "--cpu";
  try {
#if CUFLASH_HAS_CUDA
    if (!force_cpu && cuflash::cuda_available()) return run_gpu_demo();
#else
    (void)force_cpu;
#endif
    return run_cpu_demo();
  } catch (const cuflash::Error& error) {
    std::fprintf(stderr, "cuflash error: %s\n", error.what());
    return 1;
  }
}
