// Expression programs (ScoreModKind / MaskModKind::kExpression, cuflash/expression.hpp) on the
// CPU reference: a program that spells out a built-in (alibi, softcap, causal, document) gives
// the built-in's forward and backward results; malformed programs are refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "cuflash/cuflash.hpp"
#include "naive_attention.hpp"

namespace cuflash::testing {
namespace {

// Appends instructions; each returns its register.
struct ProgramBuilder {
  ExprProgram program;
  std::vector<double> constants;

  int op(ExprOp code, int a = -1, int b = -1, int c = -1) {
    program.code.insert(program.code.end(), {static_cast<std::int32_t>(code), a, b, c});
    return program.num_ops() - 1;
  }
  // A load; the fourth index register goes into bits 16..23 of the opcode word (plus one).
  int load(int slot, int a, int b = -1, int c = -1, int d = -1) {
    program.code.insert(program.code.end(),
                        {static_cast<std::int32_t>(ExprOp::kLoad) | (slot << 8) | ((d + 1) << 16), a, b, c});
    return program.num_ops() - 1;
  }
  int constant(double value) {
    constants.push_back(value);
    return op(ExprOp::kFloat, static_cast<int>(constants.size()) - 1);
  }
};

// score + slopes[h] * (kv_idx - q_idx), d/d score = 1.
ScoreMod alibi_expression(const TensorView& slopes) {
  ProgramBuilder p;
  const int s = p.op(ExprOp::kScore), h = p.op(ExprOp::kHead), q = p.op(ExprOp::kQIdx),
            kv = p.op(ExprOp::kKvIdx);
  const int slope = p.load(0, h);
  const int distance = p.op(ExprOp::kToFloat, p.op(ExprOp::kSub, kv, q));
  p.program.result = p.op(ExprOp::kAdd, s, p.op(ExprOp::kMul, slope, distance));
  p.program.grad = p.constant(1.0);
  ScoreMod mod;
  mod.kind = ScoreModKind::kExpression;
  mod.program = p.program;
  mod.scalars = p.constants;
  mod.aux = {slopes};
  return mod;
}

// cap * tanh(score / cap), d/d score = 1 - tanh^2.
ScoreMod softcap_expression(double cap) {
  ProgramBuilder p;
  const int s = p.op(ExprOp::kScore);
  const int c = p.constant(cap);
  const int t = p.op(ExprOp::kTanh, p.op(ExprOp::kDiv, s, c));
  p.program.result = p.op(ExprOp::kMul, c, t);
  p.program.grad = p.op(ExprOp::kSub, p.constant(1.0), p.op(ExprOp::kMul, t, t));
  ScoreMod mod;
  mod.kind = ScoreModKind::kExpression;
  mod.program = p.program;
  mod.scalars = p.constants;
  return mod;
}

// kv_idx <= q_idx.
MaskMod causal_expression() {
  ProgramBuilder p;
  const int q = p.op(ExprOp::kQIdx), kv = p.op(ExprOp::kKvIdx);
  p.program.result = p.op(ExprOp::kLe, kv, q);
  MaskMod mod;
  mod.kind = MaskModKind::kExpression;
  mod.program = p.program;
  return mod;
}

// ids[b, q_idx] == ids[b, kv_idx].
MaskMod document_expression(const TensorView& ids) {
  ProgramBuilder p;
  const int b = p.op(ExprOp::kBatch), q = p.op(ExprOp::kQIdx), kv = p.op(ExprOp::kKvIdx);
  p.program.result = p.op(ExprOp::kEq, p.load(0, b, q), p.load(0, b, kv));
  MaskMod mod;
  mod.kind = MaskModKind::kExpression;
  mod.program = p.program;
  mod.aux = {ids};
  return mod;
}

std::vector<double> values_of(const HostTensor& t) {
  std::vector<double> values;
  t.for_each([&](const Index& index) { values.push_back(t.at(index)); });
  return values;
}

void expect_same(const std::vector<double>& expected, const std::vector<double>& actual,
                 const std::string& name, double tol = 1e-6) {
  ASSERT_EQ(expected.size(), actual.size()) << name;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    if (std::isnan(expected[i])) {  // padding that neither run writes (still poisoned)
      EXPECT_TRUE(std::isnan(actual[i])) << name << " @" << i;
      continue;
    }
    if (std::isinf(expected[i])) {
      EXPECT_EQ(expected[i], actual[i]) << name << " @" << i;
      continue;
    }
    ASSERT_FALSE(std::isnan(actual[i])) << name << " @" << i;
    EXPECT_NEAR(expected[i], actual[i], tol * (1.0 + std::fabs(expected[i]))) << name << " @" << i;
  }
}

// Runs `config` (a built-in) forward and backward, then again with `replace` applied to the
// options, and compares out, lse, dq, dk, dv.
template <class Replace>
void expect_matches_builtin(const CaseConfig& config, Replace replace) {
  SCOPED_TRACE(describe(config));
  AttentionCase c(config);
  c.run_backward();
  const std::vector<double> out = values_of(c.out), lse = values_of(c.lse), dq = values_of(c.dq),
                            dk = values_of(c.dk), dv = values_of(c.dv);

  ForwardArgs fwd = c.forward_args();
  replace(c, fwd.opts);
  c.out.poison();
  c.lse.poison();
  cuflash::forward(fwd);
  expect_same(out, values_of(c.out), "out");
  expect_same(lse, values_of(c.lse), "lse");

  BackwardArgs bwd = c.backward_args();
  replace(c, bwd.opts);
  c.dq.poison();
  c.dk.poison();
  c.dv.poison();
  cuflash::backward(bwd);
  expect_same(dq, values_of(c.dq), "dq");
  expect_same(dk, values_of(c.dk), "dk");
  expect_same(dv, values_of(c.dv), "dv");
}

TEST(ReferenceExpression, AlibiProgramMatchesBuiltin) {
  unsigned seed = 700;
  for (bool causal : {false, true}) {
    CaseConfig config;
    config.score_mod = ScoreModKind::kAlibi;
    config.causal = causal;
    config.heads = 4;
    config.heads_kv = 2;
    config.seqlen_q = 7;
    config.seqlen_k = 11;
    config.seed = seed++;
    expect_matches_builtin(config, [](const AttentionCase& c, AttentionOptions& opts) {
      opts.score_mod = alibi_expression(c.score_aux.view());
    });
  }
  CaseConfig packed;
  packed.score_mod = ScoreModKind::kAlibi;
  packed.packed_q = {4, 0, 7};
  packed.packed_k = {6, 3, 7};
  packed.seed = seed++;
  expect_matches_builtin(packed, [](const AttentionCase& c, AttentionOptions& opts) {
    opts.score_mod = alibi_expression(c.score_aux.view());
  });
}

TEST(ReferenceExpression, SoftcapProgramMatchesSoftcapOption) {
  CaseConfig config;
  config.softcap = 2.0f;
  config.seqlen_q = 6;
  config.seqlen_k = 9;
  config.seed = 710;
  expect_matches_builtin(config, [](const AttentionCase&, AttentionOptions& opts) {
    opts.softcap = 0.0f;
    opts.score_mod = softcap_expression(2.0);
  });
}

TEST(ReferenceExpression, CausalProgramMatchesBuiltin) {
  unsigned seed = 720;
  for (auto lengths : {std::pair{7, 7}, std::pair{5, 11}, std::pair{11, 5}}) {
    CaseConfig config;
    config.mask_mod = MaskModKind::kCausal;
    config.seqlen_q = lengths.first;
    config.seqlen_k = lengths.second;
    config.seed = seed++;
    expect_matches_builtin(config, [](const AttentionCase&, AttentionOptions& opts) {
      opts.mask_mod = causal_expression();
    });
  }
}

TEST(ReferenceExpression, DocumentProgramMatchesBuiltin) {
  unsigned seed = 730;
  for (bool causal : {false, true}) {
    CaseConfig config;
    config.mask_mod = MaskModKind::kDocument;
    config.causal = causal;
    config.seqlen_q = 9;
    config.seqlen_k = 12;
    config.seed = seed++;
    expect_matches_builtin(config, [](const AttentionCase& c, AttentionOptions& opts) {
      opts.mask_mod = document_expression(c.documents.view());
    });
  }
}

TEST(ReferenceExpression, ScoreAndMaskProgramsTogether) {
  CaseConfig config;
  config.score_mod = ScoreModKind::kAlibi;
  config.mask_mod = MaskModKind::kDocument;
  config.heads = 2;
  config.heads_kv = 1;
  config.seqlen_q = 10;
  config.seqlen_k = 10;
  config.seed = 740;
  expect_matches_builtin(config, [](const AttentionCase& c, AttentionOptions& opts) {
    opts.score_mod = alibi_expression(c.score_aux.view());
    opts.mask_mod = document_expression(c.documents.view());
  });
}

// --- validation and errors --------------------------------------------------------------

void expect_error(const ForwardArgs& args, const std::string& argument, const std::string& fragment) {
  try {
    cuflash::forward(args);
    ADD_FAILURE() << "expected an error naming " << argument;
  } catch (const Error& error) {
    EXPECT_EQ(error.argument(), argument) << error.what();
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
  }
}

// score + bias[b, h, q_idx, kv_idx] read with four indices, against the same values read from
// the (B * H, Q, K) view with the first index computed: the fourth index reaches the element.
TEST(ReferenceExpression, FourDimensionalLoadMatchesItsFoldedView) {
  CaseConfig config;
  config.seed = 740;
  AttentionCase c(config);
  HostTensor bias(DType::kFloat32, {config.batch, config.heads, config.seqlen_q, config.seqlen_k});
  int value = 0;
  bias.for_each([&](const Index& index) { bias.set(index, 0.37 * ((value++ * 7919) % 23) - 4.0); });
  TensorView folded = bias.view();
  folded.ndim = 3;
  folded.shape[0] = std::int64_t(config.batch) * config.heads;
  folded.stride[0] = folded.stride[1];  // contiguous: batch and head step as one index
  for (int d = 1; d < 3; ++d) {
    folded.shape[d] = folded.shape[d + 1];
    folded.stride[d] = folded.stride[d + 1];
  }
  auto run = [&](bool four) {
    ProgramBuilder p;
    const int s = p.op(ExprOp::kScore), b = p.op(ExprOp::kBatch), h = p.op(ExprOp::kHead),
              q = p.op(ExprOp::kQIdx), kv = p.op(ExprOp::kKvIdx);
    int element;
    if (four) {
      element = p.load(0, b, h, q, kv);
    } else {
      const int heads = p.op(ExprOp::kInt, config.heads);
      element = p.load(0, p.op(ExprOp::kAdd, p.op(ExprOp::kMul, b, heads), h), q, kv);
    }
    p.program.result = p.op(ExprOp::kAdd, s, element);
    p.program.grad = p.constant(1.0);
    ForwardArgs args = c.forward_args();
    args.opts.score_mod.kind = ScoreModKind::kExpression;
    args.opts.score_mod.program = p.program;
    args.opts.score_mod.scalars = p.constants;
    args.opts.score_mod.aux = {four ? bias.view() : folded};
    c.out.poison();
    c.lse.poison();
    cuflash::forward(args);
    return std::make_pair(values_of(c.out), values_of(c.lse));
  };
  const auto [out3, lse3] = run(false);
  const auto [out4, lse4] = run(true);
  expect_same(out3, out4, "out", 0.0);
  expect_same(lse3, lse4, "lse", 0.0);
  // The bias moved the result (the test would pass on a load that ignored it otherwise).
  ForwardArgs plain = c.forward_args();
  c.out.poison();
  cuflash::forward(plain);
  const std::vector<double> out = values_of(c.out);
  double largest = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (!std::isnan(out[i])) largest = std::max(largest, std::fabs(out[i] - out4[i]));
  }
  EXPECT_GT(largest, 1e-3);
}

TEST(ReferenceExpression, MalformedProgramsAreRefusedByName) {
  CaseConfig config;
  config.seed = 750;
  AttentionCase c(config);

  {  // A mask program must produce a bool.
    ForwardArgs args = c.forward_args();
    ProgramBuilder p;
    p.program.result = p.op(ExprOp::kQIdx);
    args.opts.mask_mod.kind = MaskModKind::kExpression;
    args.opts.mask_mod.program = p.program;
    expect_error(args, "mask_mod.program.result", "expected a bool register");
  }
  {  // Operands name earlier registers.
    ForwardArgs args = c.forward_args();
    ProgramBuilder p;
    const int q = p.op(ExprOp::kQIdx);
    p.program.result = p.op(ExprOp::kLe, q, 5);
    args.opts.mask_mod.kind = MaskModKind::kExpression;
    args.opts.mask_mod.program = p.program;
    expect_error(args, "mask_mod.program[1]", "earlier register");
  }
  {  // Types of operands agree.
    ForwardArgs args = c.forward_args();
    ProgramBuilder p;
    const int s = p.op(ExprOp::kScore), q = p.op(ExprOp::kQIdx);
    p.program.result = p.op(ExprOp::kAdd, s, q);
    p.program.grad = p.constant(1.0);
    args.opts.score_mod.kind = ScoreModKind::kExpression;
    args.opts.score_mod.program = p.program;
    args.opts.score_mod.scalars = p.constants;
    expect_error(args, "score_mod.program[2]", "one type");
  }
  {  // A score program names its derivative.
    ForwardArgs args = c.forward_args();
    ProgramBuilder p;
    p.program.result = p.op(ExprOp::kScore);
    args.opts.score_mod.kind = ScoreModKind::kExpression;
    args.opts.score_mod.program = p.program;
    expect_error(args, "score_mod.program.grad", "expected a register");
  }
  {  // Too many instructions.
    ForwardArgs args = c.forward_args();
    ProgramBuilder p;
    int r = p.op(ExprOp::kQIdx);
    for (int i = 0; i < kMaxExprOps; ++i) r = p.op(ExprOp::kNeg, r);
    p.program.result = p.op(ExprOp::kLe, r, r);
    args.opts.mask_mod.kind = MaskModKind::kExpression;
    args.opts.mask_mod.program = p.program;
    expect_error(args, "mask_mod.program", "at most 64 instructions");
  }
  {  // A load indexes every dimension of its tensor.
    HostTensor ids(DType::kInt32, {2, 16});
    ForwardArgs args = c.forward_args();
    ProgramBuilder p;
    const int q = p.op(ExprOp::kQIdx);
    p.program.result = p.op(ExprOp::kEq, p.load(0, q), q);
    args.opts.mask_mod.kind = MaskModKind::kExpression;
    args.opts.mask_mod.program = p.program;
    args.opts.mask_mod.aux = {ids.view()};
    expect_error(args, "mask_mod.program[1]", "operand 1");
  }
  {  // A 4-D tensor takes a fourth index register, a 3-D one none.
    HostTensor bias(DType::kFloat32, {2, 2, 5, 7});
    HostTensor table(DType::kFloat32, {2, 5, 7});
    for (bool four_d : {true, false}) {
      ForwardArgs args = c.forward_args();
      ProgramBuilder p;
      const int s = p.op(ExprOp::kScore), b = p.op(ExprOp::kBatch), q = p.op(ExprOp::kQIdx),
                kv = p.op(ExprOp::kKvIdx);
      p.program.result = p.op(ExprOp::kAdd, s, four_d ? p.load(0, b, b, q) : p.load(0, b, q, kv, kv));
      p.program.grad = p.constant(1.0);
      args.opts.score_mod.kind = ScoreModKind::kExpression;
      args.opts.score_mod.program = p.program;
      args.opts.score_mod.scalars = p.constants;
      args.opts.score_mod.aux = {four_d ? bias.view() : table.view()};
      if (four_d) {
        expect_error(args, "score_mod.program[4]", "operand 3");
      } else {
        expect_error(args, "score_mod.program[4]", "takes 3 index register(s)");
      }
    }
  }
  {  // An index out of range is an error on the CPU.
    HostTensor table(DType::kFloat32, {1});
    table.for_each([&](const Index& index) { table.set(index, 0.5); });
    ForwardArgs args = c.forward_args();
    ProgramBuilder p;
    const int s = p.op(ExprOp::kScore), kv = p.op(ExprOp::kKvIdx);
    p.program.result = p.op(ExprOp::kAdd, s, p.load(0, kv));
    p.program.grad = p.constant(1.0);
    args.opts.score_mod.kind = ScoreModKind::kExpression;
    args.opts.score_mod.program = p.program;
    args.opts.score_mod.scalars = p.constants;
    args.opts.score_mod.aux = {table.view()};
    expect_error(args, "score_mod.aux[0]", "out of range for dimension 0 of size 1");
  }
  {  // A program on a built-in kind is refused.
    ForwardArgs args = c.forward_args();
    args.opts.mask_mod = causal_expression();
    args.opts.mask_mod.kind = MaskModKind::kCausal;
    expect_error(args, "mask_mod.program", "only taken by the expression kind");
  }
}

}  // namespace
}  // namespace cuflash::testing
