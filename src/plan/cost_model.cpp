// cost_model.cpp — step time and memory per rank of each strategy (cost_model.h).
#include "plan/cost_model.h"

#include <algorithm>
#include <stdexcept>

namespace zeroshard::plan {
namespace {

// One ring collective's shape: `ranks` ranks over `hosts` hosts, and how many
// such rings run at once over each host's link (hybrid replica rings: one per
// rank of a host).
struct Ring {
  int ranks = 1;
  int hosts = 1;
  int concurrent = 1;
};

double ring_s(const Cluster& c, double bytes, const Ring& r, double* inter_bytes, double* intra_bytes) {
  if (r.ranks <= 1 || bytes <= 0) return 0;
  const double per_link = (r.ranks - 1.0) / r.ranks * bytes;
  double t_inter = 0, t_intra = 0, alpha = 0;
  if (r.hosts > 1) {
    t_inter = per_link * r.concurrent / c.inter.bytes_per_s;
    alpha = std::max(alpha, c.inter.alpha_s);
    if (inter_bytes != nullptr) *inter_bytes += per_link * r.concurrent;
  }
  if (r.ranks > r.hosts) {
    t_intra = per_link / c.intra.bytes_per_s;
    alpha = std::max(alpha, c.intra.alpha_s);
    if (intra_bytes != nullptr) *intra_bytes += per_link;
  }
  return (r.ranks - 1) * alpha + std::max(t_inter, t_intra);
}

// The hosts a group of `size` consecutive members of a data-parallel group
// spans. A data-parallel group is `dp` consecutive ranks (PipelineGrid: stage =
// rank / dp), ranks numbered host by host: without a pipeline it spans every
// host; a pipeline's stages take whole hosts before the next stage begins.
int hosts_spanned(const Cluster& c, int dp, int size) {
  const int per_host = std::max(1, std::min(dp, c.ranks_per_host));
  return std::max(1, (size + per_host - 1) / per_host);
}

// How many rings of groups of `size` consecutive ranks (groups side by side from
// rank 0) cross one host's link at once: the most groups spanning hosts that
// share a host. 1 where groups align with hosts; more where they straddle one
// (3 hosts x 2 ranks, pp 2: dp groups {0,1,2} and {3,4,5} both cross host 1).
int concurrent_rings(const Cluster& c, int size) {
  const int groups = c.ranks() / size;
  int most = 1;
  for (int h = 0; h < c.hosts; ++h) {
    int n = 0;
    for (int g = 0; g < groups; ++g) {
      const int first = g * size / c.ranks_per_host, last = ((g + 1) * size - 1) / c.ranks_per_host;
      if (first != last && first <= h && h <= last) ++n;
    }
    most = std::max(most, n);
  }
  return most;
}

}  // namespace

std::string Strategy::describe() const {
  std::string s = zero_stage == 0 ? "replicated (ZeRO-0)" : "ZeRO-" + std::to_string(zero_stage);
  if (zero_stage > 0) s += shard_size > 0 ? ", sharded per " + std::to_string(shard_size) + " ranks" : ", flat";
  if (pp > 1) s = "pp " + std::to_string(pp) + " x " + s;
  if (micro_batches > 1) s += ", " + std::to_string(micro_batches) + " micro-batches";
  if (gather_bytes == 2) s += ", bf16 gathers";
  if (activation_checkpointing) s += ", activation checkpointing";
  return s;
}

double ring_gather_s(const Cluster& c, double bytes, int ranks, int hosts) {
  return ring_s(c, bytes, {ranks, hosts, 1}, nullptr, nullptr);
}

namespace {

// A strategy laid out on a cluster: the groups, their rings, the busiest
// pipeline stage's share of the model.
struct Layout {
  int dp = 1, shard = 1, replicas = 1;
  Ring shard_ring, replica_ring, dp_ring;
  int stage_units = 1;
  double unit_params = 0, params = 0;  // the busiest stage's: its share of the layers, and the root
  double p = 0, sharded_state = 0;     // bytes per parameter: the model's dtype; master and moments
  double mb_tokens = 0;                // tokens of a micro-batch on one rank
};

Layout lay_out(const Model& m, const Cluster& c, const Strategy& s, const Step& step) {
  if (s.pp < 1 || c.ranks() % s.pp != 0) throw std::invalid_argument("pp must divide the ranks");
  Layout l;
  l.dp = c.ranks() / s.pp;
  l.shard = s.zero_stage == 0 ? 1 : (s.shard_size > 0 ? std::min(s.shard_size, l.dp) : l.dp);
  if (l.dp % l.shard != 0) throw std::invalid_argument("shard_size must divide the data-parallel ranks");
  l.replicas = l.dp / l.shard;
  const int dp_hosts = hosts_spanned(c, l.dp, l.dp);
  const int shard_hosts = hosts_spanned(c, l.dp, l.shard);
  // A replica ring has one rank per shard group; the shard groups of one host run theirs at once.
  l.shard_ring = Ring{l.shard, shard_hosts, concurrent_rings(c, l.shard)};
  l.replica_ring = Ring{l.replicas, std::min(l.replicas, dp_hosts), std::max(1, l.shard / shard_hosts)};
  l.dp_ring = Ring{l.dp, dp_hosts, concurrent_rings(c, l.dp)};
  l.stage_units = std::max(1, (m.units + s.pp - 1) / s.pp);
  l.unit_params = m.unit_params * l.stage_units / m.units;
  l.params = l.unit_params + m.root_params;
  l.p = m.param_bytes;
  const double master = m.param_bytes == 4 ? 0 : 4;
  l.sharded_state = 4 + master + 8;
  l.mb_tokens = step.tokens / l.dp / s.micro_batches;
  return l;
}

// Model states, the gathered working set and activations, per rank.
void predict_memory(const Model& m, const Cluster& c, const Strategy& s, const Layout& l, Prediction& out) {
  const double p = l.p, params = l.params, unit_params = l.unit_params, shard = l.shard;
  switch (s.zero_stage) {
    case 0: out.model_states = params * (2 * p + (m.param_bytes == 4 ? 0 : 4) + 8); break;
    case 1: out.model_states = params * 2 * p + params * l.sharded_state / shard; break;
    case 2: out.model_states = params * p + params * l.sharded_state / shard; break;
    default:
      out.model_states = unit_params * (p + l.sharded_state) / shard + m.root_params * (p + l.sharded_state / shard);
      // Units gathered at once: the current one and two prefetched; a pipeline stage keeps
      // its units gathered for the step (bart_pretrain's --pp-gather step).
      out.working_set = shard == 1 ? 0 : s.pp > 1 ? p * unit_params : 3 * p * unit_params / l.stage_units;
  }
  // Activations saved for backward, per layer and token (Korthikanti et al.:
  // (34 d + 5 heads seq) bytes in 16 bits); with checkpointing only each layer's input.
  const double act_bytes = m.param_bytes == 4 ? 2.0 : 1.0;  // the formula's 16-bit bytes, scaled
  const double per_layer_token = act_bytes * (34.0 * m.d_model + 5.0 * m.heads * m.seq_len);
  const int in_flight = s.pp > 1 ? std::min(s.pp, s.micro_batches) : 1;  // 1F1B: the first stage holds pp micro-batches
  out.activations = s.activation_checkpointing
                        ? in_flight * l.mb_tokens * (l.stage_units * m.d_model * p + per_layer_token)
                        : in_flight * l.mb_tokens * l.stage_units * per_layer_token;
  out.fits = c.memory_bytes <= 0 || out.memory() <= c.memory_bytes;
}

// Compute time and the pipeline's bubble; returns the backward's share of the compute.
double predict_compute(const Model& m, const Cluster& c, const Strategy& s, const Step& step, const Layout& l,
                       Prediction& out) {
  // Compute: 6 flops per parameter and token, plus attention's 12 L d seq; a recompute adds a forward.
  const double tokens = step.tokens / l.dp;  // each pipeline's share; each stage computes its layers of it
  const double flops_per_token =
      6 * l.params + 12.0 * l.stage_units * static_cast<double>(m.d_model) * static_cast<double>(m.seq_len);
  // A measured time per token is the whole model's: a stage takes its share of the flops.
  const double model_flops_per_token =
      6 * m.params() + 12.0 * m.units * static_cast<double>(m.d_model) * static_cast<double>(m.seq_len);
  const double fwd = c.seconds_per_token > 0 ? tokens * c.seconds_per_token * flops_per_token / model_flops_per_token / 3
                                            : tokens * flops_per_token / 3 / c.flops_per_s;
  out.compute_s = fwd * (s.activation_checkpointing ? 4 : 3);
  if (s.pp > 1) out.bubble_s = (s.pp - 1) * out.compute_s / s.micro_batches;
  return out.compute_s - fwd;
}

// A step's collectives, split into what compute may hide and what it cannot.
struct Collectives {
  double overlappable = 0, exposed = 0, hideable = 0;  // hideable: what compute can hide of `overlappable`
  double inter_bytes = 0, intra_bytes = 0;             // what a host sends over each kind of link
};

// The data-parallel collectives (gradients reduced in the parameters' dtype).
Collectives data_parallel(const Model& m, const Cluster& c, const Strategy& s, const Layout& l) {
  Collectives k;
  // `times` such rings one after the other (an all-reduce is a reduce-scatter and an all-gather).
  auto ring = [&](double bytes, const Ring& r, int times = 1) {
    double t = 0;
    for (int i = 0; i < times; ++i) t += ring_s(c, bytes, r, &k.inter_bytes, &k.intra_bytes);
    return t;
  };
  const double grad_bytes = l.params * l.p;
  if (s.zero_stage == 0) {
    k.overlappable = ring(grad_bytes, l.dp_ring, 2);  // all-reduce = reduce-scatter + all-gather
    k.hideable = c.reduce_overlap * k.overlappable;
    return k;
  }
  // Without a pipeline, ZeRO-2 and 3 reduce every micro-batch's gradients (and ZeRO-3 gathers
  // for each); ZeRO-1 and pipelines accumulate and reduce once.
  const int passes = s.pp == 1 && s.zero_stage >= 2 ? s.micro_batches : 1;
  const double rs = ring(grad_bytes, l.shard_ring, passes);
  const double rep = l.replicas > 1 ? ring(grad_bytes / l.shard, l.replica_ring, 2 * passes) : 0;
  if (s.zero_stage == 3) {
    const double gather = s.gather_bytes > 0 ? s.gather_bytes : l.p;
    const double gathers = ring(l.unit_params * gather, l.shard_ring, 2 * passes);  // forward, and again for backward
    const double root = ring(m.root_params * l.p, l.shard_ring);                     // the root, after the update
    if (s.pp > 1) {  // gathered once per step and kept (keep_gathered); reduced after the last micro-batch
      k.exposed = gathers / 2 + rs + rep + root;
    } else {
      k.overlappable = gathers + rs + rep;  // each unit's replica average starts when its reduce-scatter ends
      k.hideable = c.gather_overlap * gathers + c.reduce_overlap * (rs + rep);
      k.exposed = root + gathers / (2 * passes * l.stage_units);  // the root's gather after the update; the first unit's
    }
    return k;
  }
  const double ag = ring(l.params * l.p, l.shard_ring);  // the updated shards, after the step
  if (s.zero_stage == 2 && s.pp == 1) {
    k.overlappable = rs + rep;
    k.hideable = c.reduce_overlap * k.overlappable;
    k.exposed = ag;
  } else {  // ZeRO-1, or a pipeline: reduced after backward
    k.exposed = rs + rep + ag;
  }
  return k;
}

// A pipeline's sends: activations and their gradients cross each stage
// boundary; fill and drain are exposed, and so are the reductions (after the
// last backward).
void pipeline_sends(const Model& m, const Cluster& c, const Strategy& s, const Layout& l, Collectives& k) {
  const double message = l.mb_tokens * m.d_model * l.p;
  for (int i = 0; i + 1 < s.pp; ++i) {
    // Stage i holds ranks [i dp, (i+1) dp): the boundary crosses hosts where its stages begin on
    // different hosts, and then the pipelines of a host send over its link at once.
    const bool crosses = i * l.dp / c.ranks_per_host != (i + 1) * l.dp / c.ranks_per_host;
    const Link& link = crosses ? c.inter : c.intra;
    const int concurrent = crosses ? std::min(l.dp, c.ranks_per_host) : 1;
    k.exposed += 2 * (link.alpha_s + concurrent * message / link.bytes_per_s);
    (crosses ? k.inter_bytes : k.intra_bytes) += s.micro_batches * concurrent * message;  // what a host sends, each way
  }
  k.exposed += k.overlappable;
  k.overlappable = k.hideable = 0;
}

}  // namespace

Prediction predict(const Model& m, const Cluster& c, const Strategy& s, const Step& step) {
  const Layout l = lay_out(m, c, s, step);
  Prediction out;
  predict_memory(m, c, s, l, out);
  const double backward_s = predict_compute(m, c, s, step, l, out);
  Collectives k = data_parallel(m, c, s, l);
  if (s.pp > 1) pipeline_sends(m, c, s, l, k);
  out.comm_s = k.overlappable + k.exposed;
  const double hidden_by = s.zero_stage == 3 ? out.compute_s : backward_s;
  out.exposed_comm_s = k.exposed + k.overlappable - std::min(k.hideable, hidden_by);
  out.inter_host_bytes = k.inter_bytes;
  out.intra_host_bytes = k.intra_bytes;
  out.step_s = out.compute_s + out.bubble_s + out.exposed_comm_s;
  return out;
}

Strategy with_micro_batches(const Model& m, const Cluster& c, Strategy s, const Step& step, int64_t sequences) {
  const int64_t dp = c.ranks() / s.pp;
  const int64_t per_rank = sequences / dp;  // sequences each pipeline (or rank) takes per step
  const int least = s.pp > 1 ? 4 * s.pp : 1;  // a pipeline wants micro-batches to fill it
  int best = 0;
  for (int64_t k = least; k <= per_rank; k *= 2) {
    if (per_rank % k != 0) continue;
    s.micro_batches = static_cast<int>(k);
    if (best == 0) best = s.micro_batches;
    if (predict(m, c, s, step).fits) return s;
  }
  s.micro_batches = best;  // none fits: the fewest, which predict() reports as not fitting
  return s;
}

std::vector<Strategy> candidates(const Cluster& c, const Model& m, const Step& step, int64_t sequences) {
  std::vector<Strategy> shapes, out;
  for (bool ac : {false, true}) {
    for (int stage = 0; stage <= 3; ++stage) shapes.push_back({stage, 0, 1, 1, ac, 0});
    if (c.hosts > 1 && c.ranks_per_host > 1) {
      for (int stage = 1; stage <= 3; ++stage) shapes.push_back({stage, c.ranks_per_host, 1, 1, ac, 0});
    }
    for (int pp = 2; pp <= 8; pp *= 2) {
      if (c.ranks() % pp != 0 || pp > m.units) continue;
      for (int stage : {1, 3}) shapes.push_back({stage, 0, pp, 1, ac, 0});
    }
  }
  for (const auto& s : shapes) {
    const int64_t dp = c.ranks() / s.pp;
    if (sequences % dp != 0) continue;  // every rank takes whole sequences
    auto fitted = with_micro_batches(m, c, s, step, sequences);
    if (fitted.micro_batches > 0) out.push_back(fitted);
  }
  return out;
}

Model bart(int64_t d, int64_t ffn, int64_t heads, int64_t layers, int64_t vocab, int64_t positions, int64_t seq_len) {
  const double encoder = 4.0 * (d * d + d) + (d * ffn + ffn) + (ffn * d + d) + 4.0 * d;
  const double decoder = 8.0 * (d * d + d) + (d * ffn + ffn) + (ffn * d + d) + 6.0 * d;
  Model m;
  m.name = "BART, " + std::to_string(layers) + " + " + std::to_string(layers) + " layers of " + std::to_string(d);
  m.unit_params = layers * (encoder + decoder);
  m.root_params = static_cast<double>(vocab) * d + 2.0 * (positions + 2) * d + 4.0 * d;
  m.units = static_cast<int>(2 * layers);
  m.d_model = d;
  m.heads = heads;
  m.seq_len = seq_len;
  return m;
}

Model named_model(const std::string& name, int64_t seq_len) {
  if (name == "bart-base") {
    auto m = bart(768, 3072, 12, 6, 50265, 1024, seq_len);
    m.name = "bart-base";
    return m;
  }
  if (name == "bart-large") {
    auto m = bart(1024, 4096, 16, 12, 50265, 1024, seq_len);
    m.name = "bart-large";
    return m;
  }
  if (name == "7b") {
    auto m = llama(4096, 11008, 32, 32, 32000, seq_len);
    m.name = "7B (LLaMA-7B's shape)";
    return m;
  }
  throw std::invalid_argument("unknown model '" + name + "'; known: bart-base, bart-large, 7b");
}

Model llama(int64_t d_model, int64_t ffn, int64_t heads, int64_t layers, int64_t vocab, int64_t seq_len) {
  if (d_model <= 0 || ffn <= 0 || heads <= 0 || layers <= 0 || vocab <= 0 || d_model % heads != 0) {
    throw std::invalid_argument("a decoder needs positive sizes and heads dividing d_model");
  }
  Model m;
  m.name = "decoder, " + std::to_string(layers) + " layers of " + std::to_string(d_model);
  const double d = static_cast<double>(d_model);
  m.units = static_cast<int>(layers);
  // Attention 4 d^2, SwiGLU 3 d ffn, 2 RMSNorms per layer; embedding and head untied, a final norm.
  m.unit_params = m.units * (4 * d * d + 3 * d * static_cast<double>(ffn) + 2 * d);
  m.root_params = 2 * static_cast<double>(vocab) * d + d;
  m.d_model = d_model;
  m.heads = heads;
  m.seq_len = seq_len;
  return m;
}

}  // namespace zeroshard::plan
