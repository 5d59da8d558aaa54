// The cost model against closed forms: ring times, the ZeRO memory formulas,
// the bytes between hosts that the cluster benches count, the pipeline
// bubble, and the published parameter counts of the named models.
#include "plan/cost_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <stdexcept>

namespace zeroshard::plan {
namespace {

Cluster two_by_two() {
  Cluster c;
  c.hosts = 2;
  c.ranks_per_host = 2;
  c.intra = {1e-5, 10e9};
  c.inter = {1e-4, 125e6};  // 1 Gbit/s
  c.flops_per_s = 1e10;
  return c;
}

Model small_model() {
  Model m;
  m.unit_params = 8e6;
  m.root_params = 1e6;
  m.units = 8;
  m.param_bytes = 4;
  m.d_model = 256;
  m.heads = 4;
  m.seq_len = 128;
  return m;
}

TEST(CostModel, RingTimesAreTheClosedForm) {
  const auto c = two_by_two();
  const double bytes = 64e6;
  // 4 ranks over 2 hosts: 3 steps at the slower link's latency, 3/4 of the buffer over the host link.
  EXPECT_DOUBLE_EQ(ring_gather_s(c, bytes, 4, 2), 3 * 1e-4 + 0.75 * bytes / 125e6);
  // Inside one host: its own link.
  EXPECT_DOUBLE_EQ(ring_gather_s(c, bytes, 2, 1), 1e-5 + 0.5 * bytes / 10e9);
  EXPECT_EQ(ring_gather_s(c, bytes, 1, 1), 0);
}

TEST(CostModel, ModelStatesFollowTheZeroFormulas) {
  auto c = two_by_two();
  const auto m = small_model();
  const double psi = m.params(), n = 4;
  const Step step{4 * 128};
  EXPECT_DOUBLE_EQ(predict(m, c, {0, 0}, step).model_states, 16 * psi);
  EXPECT_DOUBLE_EQ(predict(m, c, {1, 0}, step).model_states, 8 * psi + 12 * psi / n);
  EXPECT_DOUBLE_EQ(predict(m, c, {2, 0}, step).model_states, 4 * psi + 12 * psi / n);
  // ZeRO-3: the units sharded, the root's parameters whole (docs/fully-shard.md).
  EXPECT_DOUBLE_EQ(predict(m, c, {3, 0}, step).model_states,
                   16 * m.unit_params / n + 4 * m.root_params + 12 * m.root_params / n);
  // Hybrid: shard groups of 2, so N is 2.
  EXPECT_DOUBLE_EQ(predict(m, c, {2, 2}, step).model_states, 4 * psi + 12 * psi / 2);
  // bf16: 2-byte parameters and gradients, an fp32 master beside fp32 moments (16 bytes replicated).
  auto half = m;
  half.param_bytes = 2;
  EXPECT_DOUBLE_EQ(predict(half, c, {0, 0}, step).model_states, 16 * psi);
  EXPECT_DOUBLE_EQ(predict(half, c, {3, 0}, step).model_states,
                   18 * m.unit_params / n + 2 * m.root_params + 16 * m.root_params / n);
  // A cap the replicated run exceeds and ZeRO-3 does not.
  c.memory_bytes = 10 * psi;
  EXPECT_FALSE(predict(m, c, {0, 0}, step).fits);
  EXPECT_TRUE(predict(m, c, {3, 0}, step).fits);
}

TEST(CostModel, BytesBetweenHostsAreWhatTheClusterBenchCounts) {
  // bench/cluster_bart_bench.sh's formula at 2 hosts x 2 ranks: flat ZeRO-3 moves
  // 3 x (n-1)/n of the model through each host's link (two gathers, one
  // reduce-scatter, the root's gather after the update); hybrid averages the
  // whole gradient across the 2 replicas once: 2 (R-1)/R of it.
  const auto c = two_by_two();
  const auto m = small_model();
  const double bytes = m.params() * 4;
  const Step step{4 * 128};
  EXPECT_DOUBLE_EQ(predict(m, c, {3, 0}, step).inter_host_bytes,
                   0.75 * (2 * m.unit_params * 4 + bytes + m.root_params * 4));
  EXPECT_DOUBLE_EQ(predict(m, c, {3, 2}, step).inter_host_bytes, bytes);
  EXPECT_DOUBLE_EQ(predict(m, c, {2, 0}, step).inter_host_bytes, 0.75 * 2 * bytes);
  EXPECT_DOUBLE_EQ(predict(m, c, {2, 2}, step).inter_host_bytes, bytes);
  EXPECT_DOUBLE_EQ(predict(m, c, {0, 0}, step).inter_host_bytes, 0.75 * 2 * bytes);
  // bf16 gathers halve the gathers' share.
  Strategy narrow{3, 0};
  narrow.gather_bytes = 2;
  EXPECT_DOUBLE_EQ(predict(m, c, narrow, step).inter_host_bytes,
                   0.75 * (2 * m.unit_params * 2 + bytes + m.root_params * 4));
  // And on a link too slow for compute to hide flat ZeRO-3's traffic (200 Mbit/s), hybrid is the faster.
  auto slow = c;
  slow.inter.bytes_per_s = 25e6;
  const auto flat = predict(m, slow, {3, 0}, step), hybrid = predict(m, slow, {3, 2}, step);
  EXPECT_GT(flat.exposed_comm_s, 0);
  EXPECT_LT(hybrid.step_s, flat.step_s);
}

TEST(CostModel, OverlapHidesTheHideableShareOnly) {
  auto c = two_by_two();
  const auto m = small_model();
  const Step step{4 * 128};
  c.gather_overlap = c.reduce_overlap = 0;  // nothing hidden: the step is compute plus every collective
  for (int stage = 0; stage <= 3; ++stage) {
    const auto p = predict(m, c, {stage, 0}, step);
    EXPECT_NEAR(p.step_s, p.compute_s + p.comm_s, 1e-12) << "ZeRO-" << stage;
  }
  c.gather_overlap = 0;  // ZeRO-2 gathers nothing ahead: it hides its reduce-scatter behind backward (2/3 of compute)
  c.reduce_overlap = 1;  // and never its all-gather
  const auto p = predict(m, c, {2, 0}, step);
  const double rs = ring_gather_s(c, m.params() * 4, 4, 2);
  EXPECT_NEAR(p.exposed_comm_s, std::max(0.0, rs - p.compute_s * 2 / 3) + rs, 1e-12);
  // The TCP transport on shared cores (bench/plan_validate.sh): ZeRO-3's gathers hidden, its
  // reductions not. The step is then compute + the reductions + the root's gather + the first unit's.
  c.gather_overlap = 1;
  c.reduce_overlap = 0;
  auto slow = c;
  slow.flops_per_s = 1e7;  // compute far longer than the gathers: all of them hidden
  const auto z3 = predict(m, slow, {3, 0}, step);
  const double reduce = ring_gather_s(c, m.params() * 4, 4, 2);
  const double root = ring_gather_s(c, m.root_params * 4, 4, 2);
  const double first_unit = ring_gather_s(c, m.unit_params * 4, 4, 2) / m.units;
  EXPECT_LT(2 * ring_gather_s(c, m.unit_params * 4, 4, 2), z3.compute_s);
  EXPECT_NEAR(z3.exposed_comm_s, reduce + root + first_unit, 1e-9);
}

TEST(CostModel, PipelineBubbleIsTheFillAndDrain) {
  Cluster c = two_by_two();
  c.inter = c.intra;  // fast links: the bubble dominates what pipelining adds
  const auto m = small_model();
  const Step step{4 * 128};
  for (int micro : {2, 4, 8}) {
    Strategy s{1, 0, 2, micro};
    const auto p = predict(m, c, s, step);
    EXPECT_DOUBLE_EQ(p.bubble_s, (2 - 1) * p.compute_s / micro);
  }
  // Half the layers per stage: each rank computes about half of what one rank of 4-way data parallelism would
  // with twice the tokens (2 pipelines of 2 stages against 4 replicas).
  const auto flat = predict(m, c, {1, 0}, step), piped = predict(m, c, {1, 0, 2, 4}, step);
  EXPECT_LT(piped.compute_s, 1.2 * flat.compute_s);
  EXPECT_GT(piped.compute_s, 0.8 * flat.compute_s);
  EXPECT_THROW(predict(m, c, {1, 0, 3, 3}, step), std::invalid_argument);
}

TEST(CostModel, PipelineStagesTakeWholeHostsAsThePipelineGridPlacesThem) {
  // PipelineGrid puts stage k on ranks [k dp, (k+1) dp): at 2 hosts x 2 ranks, pp 2 is one stage per host.
  // The data-parallel rings stay inside a host; only activations and their gradients cross, the 2
  // pipelines of a host at once: each host sends micro-batches x 2 pipelines x (tokens, d_model) fp32.
  const auto c = two_by_two();
  const auto m = small_model();
  const Step step{16 * 128};
  const int micro = 8;
  const double message = step.tokens / 2 / micro * m.d_model * 4;
  const auto piped = predict(m, c, {1, 0, 2, micro}, step);
  EXPECT_DOUBLE_EQ(piped.inter_host_bytes, micro * 2 * message);
  const double rings = 2 * ring_gather_s(c, (m.unit_params / 2 + m.root_params) * 4, 2, 1);  // ZeRO-1: RS + AG
  const double boundary = 2 * (c.inter.alpha_s + 2 * message / c.inter.bytes_per_s);        // fill and drain
  EXPECT_NEAR(piped.exposed_comm_s, rings + boundary, 1e-12);
  // Four stages over 2 hosts of 2: dp 1, only the middle boundary crosses hosts.
  const auto four = predict(m, c, {1, 0, 4, micro}, step);
  const double message4 = step.tokens / micro * m.d_model * 4;
  EXPECT_DOUBLE_EQ(four.inter_host_bytes, micro * message4);
  // 3 hosts x 2 ranks, pp 2: the stages' data-parallel groups {0,1,2} and {3,4,5} both cross host 1,
  // whose link carries both rings at once.
  auto three = c;
  three.hosts = 3;
  const Step step3{24 * 128};
  const auto odd = predict(m, three, {1, 0, 2, micro}, step3);
  const double stage_bytes = (m.unit_params / 2 + m.root_params) * 4, per_link = 2.0 / 3 * stage_bytes;
  const double ring3 = 2 * std::max(c.inter.alpha_s, c.intra.alpha_s) +
                       std::max(2 * per_link / c.inter.bytes_per_s, per_link / c.intra.bytes_per_s);
  const double message3 = step3.tokens / 3 / micro * m.d_model * 4;
  EXPECT_NEAR(odd.exposed_comm_s, 2 * ring3 + 2 * (c.inter.alpha_s + 2 * message3 / c.inter.bytes_per_s), 1e-12);
  // A measured time per token is the whole model's: a stage of the two computes its share of the flops.
  auto timed = c;
  timed.seconds_per_token = 1e-3;
  const auto flat = predict(m, timed, {1, 0}, step), half = predict(m, timed, {1, 0, 2, micro}, step);
  const double d = m.d_model * static_cast<double>(m.seq_len);
  const double share = (6 * (m.unit_params / 2 + m.root_params) + 12.0 * 4 * d) / (6 * m.params() + 12.0 * 8 * d);
  EXPECT_NEAR(flat.compute_s, step.tokens / 4 * 1e-3, 1e-12);
  EXPECT_NEAR(half.compute_s, step.tokens / 2 * 1e-3 * share, 1e-12);
}

TEST(CostModel, NamedModelsHaveTheirPublishedSizes) {
  EXPECT_NEAR(named_model("bart-base", 1024).params() / 1e6, 139.4, 0.1);
  EXPECT_NEAR(named_model("bart-large", 1024).params() / 1e6, 406.3, 0.1);
  EXPECT_NEAR(named_model("7b", 4096).params() / 1e9, 6.74, 0.01);
  // bench/memory_wall.sh's BART-large shape with a 4,096-entry vocabulary (359.0M parameters).
  EXPECT_NEAR(bart(1024, 4096, 16, 12, 4096, 1024, 32).params() / 1e6, 359.0, 0.1);
  EXPECT_THROW(named_model("gpt-5", 1024), std::invalid_argument);
  // A decoder of a user's own shape (zeroshard-plan --decoder): LLaMA-2-13B's, 13,015,864,320 parameters.
  EXPECT_DOUBLE_EQ(llama(5120, 13824, 40, 40, 32000, 4096).params(), 13015864320.0);
  EXPECT_THROW(llama(5120, 13824, 3, 40, 32000, 4096), std::invalid_argument);  // heads must divide d_model
}

}  // namespace
}  // namespace zeroshard::plan
