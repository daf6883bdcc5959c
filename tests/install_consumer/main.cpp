// Calls cuflash::forward on small CPU tensors through the installed headers and library and
// checks the result against a direct computation.
#include <cmath>
#include <cstdio>
#include <cuflash/cuflash.hpp>
#include <vector>

int main() {
  constexpr int kSeqQ = 3, kSeqK = 5, kHeads = 2, kDim = 8;
  std::vector<float> q(kSeqQ * kHeads * kDim), k(kSeqK * kHeads * kDim), v(k.size());
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * i);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = std::cos(0.23f * i);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.11f * i + 1.f);
  std::vector<float> out(q.size(), 0.f), lse(kHeads * kSeqQ, 0.f);

  cuflash::ForwardArgs args;
  args.q = cuflash::TensorView(q.data(), cuflash::DType::kFloat32, {1, kSeqQ, kHeads, kDim});
  args.k = cuflash::TensorView(k.data(), cuflash::DType::kFloat32, {1, kSeqK, kHeads, kDim});
  args.v = cuflash::TensorView(v.data(), cuflash::DType::kFloat32, {1, kSeqK, kHeads, kDim});
  args.out = cuflash::TensorView(out.data(), cuflash::DType::kFloat32, {1, kSeqQ, kHeads, kDim});
  args.lse = cuflash::TensorView(lse.data(), cuflash::DType::kFloat32, {1, kHeads, kSeqQ});
  cuflash::forward(args);

  double worst = 0;
  const double scale = 1.0 / std::sqrt(double{kDim});
  for (int h = 0; h < kHeads; ++h) {
    for (int i = 0; i < kSeqQ; ++i) {
      double scores[kSeqK], top = -1e300, sum = 0;
      for (int j = 0; j < kSeqK; ++j) {
        double dot = 0;
        for (int c = 0; c < kDim; ++c)
          dot += double{q[(i * kHeads + h) * kDim + c]} * k[(j * kHeads + h) * kDim + c];
        scores[j] = dot * scale;
        top = std::fmax(top, scores[j]);
      }
      for (double& s : scores) sum += (s = std::exp(s - top));
      for (int c = 0; c < kDim; ++c) {
        double expected = 0;
        for (int j = 0; j < kSeqK; ++j)
          expected += scores[j] / sum * v[(j * kHeads + h) * kDim + c];
        worst = std::fmax(worst, std::fabs(expected - out[(i * kHeads + h) * kDim + c]));
      }
      worst = std::fmax(worst, std::fabs(top + std::log(sum) - lse[h * kSeqQ + i]));
    }
  }
  std::printf("cuflash %s from the install prefix: forward max error %.2e, cuda_available %d\n",
              cuflash::version(), worst, cuflash::cuda_available() ? 1 : 0);
  return worst < 1e-4 ? 0 : 1;
}
