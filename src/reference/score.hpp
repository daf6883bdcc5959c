// Scores of the reference: scale, softcap and the built-in score_mods, with their derivative
// (needed by the backward pass).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cuflash/error.hpp"
#include "cuflash/options.hpp"
#include "reference/expression.hpp"
#include "reference/numeric.hpp"

namespace cuflash::reference {

class ScoreFunction {
 public:
  ScoreFunction(const AttentionOptions& opts, std::int64_t head_dim, std::int64_t num_heads)
      : scale_(opts.softmax_scale ? static_cast<double>(*opts.softmax_scale)
                                  : 1.0 / std::sqrt(static_cast<double>(head_dim))),
        softcap_(opts.softcap),
        kind_(opts.score_mod.kind) {
    if (kind_ == ScoreModKind::kNone) return;
    if (kind_ == ScoreModKind::kExpression) {
      expression_ = ExpressionEvaluator(opts.score_mod.program, opts.score_mod.scalars,
                                        opts.score_mod.aux, "score_mod");
      return;
    }
    const std::vector<TensorView>& aux = opts.score_mod.aux;
    if (aux.empty()) {
      throw Error(Error::Kind::kInvalidArgument, "score_mod.aux",
                  "the built-in score_mod needs aux[0]");
    }
    const TensorView& table = aux[0];
    if (kind_ == ScoreModKind::kAlibi) {
      // (H,) slopes, read once so the inner loop does no dtype dispatch.
      for (std::int64_t h = 0; h < num_heads; ++h) {
        values_.push_back(load(table, h * table.stride[0]));
      }
    } else if (kind_ == ScoreModKind::kRelativeBias) {
      // (H, 2R + 1)
      width_ = table.shape[1];
      radius_ = (width_ - 1) / 2;
      for (std::int64_t h = 0; h < num_heads; ++h) {
        for (std::int64_t r = 0; r < width_; ++r) {
          values_.push_back(load(table, offset_of(table, {h, r})));
        }
      }
    }
  }

  double scale() const { return scale_; }

  // Score of query i and key j (positions within their sequence, top-left aligned as in
  // FlexAttention) of batch entry b and head h, from raw = scale * <q_i, k_j>. *slope receives
  // d score / d raw.
  double operator()(double raw, int b, int h, std::int64_t i, std::int64_t j,
                    double* slope) const {
    double score = raw;
    double derivative = 1.0;
    if (softcap_ > 0.0) {
      const double t = std::tanh(raw / softcap_);
      score = softcap_ * t;
      derivative = 1.0 - t * t;
    }
    // Both built-ins add a bias, so their derivative with respect to the score is 1; an
    // expression gives its own.
    switch (kind_) {
      case ScoreModKind::kNone:
        break;
      case ScoreModKind::kAlibi:
        score += values_[h] * static_cast<double>(j - i);
        break;
      case ScoreModKind::kRelativeBias: {
        const std::int64_t distance = std::clamp<std::int64_t>(j - i, -radius_, radius_);
        score += values_[h * width_ + distance + radius_];
        break;
      }
      case ScoreModKind::kExpression: {
        // The chain rule through softcap: d score / d raw = d mod / d s * d s / d raw.
        double mod_grad = 1.0;
        score = expression_(score, b, h, i, j, &mod_grad);
        derivative *= mod_grad;
        break;
      }
    }
    if (slope) *slope = derivative;
    return score;
  }

 private:
  double scale_;
  double softcap_;
  ScoreModKind kind_;
  std::vector<double> values_;
  std::int64_t width_ = 0;
  std::int64_t radius_ = 0;
  ExpressionEvaluator expression_;
};

}  // namespace cuflash::reference
