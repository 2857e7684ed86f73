// Routing math shared by the CPU twin and the CUDA kernel: scores, group-limited top-k, and the expert-major
// schedule's offsets. Everything here is written once for one token (or one expert) and called from both sides.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/common.h"

namespace jk::routing {

enum Score : int32_t { kSoftmax = 0, kSigmoid = 1 };

struct RouteParams {
  int32_t num_experts;
  int32_t top_k;
  int32_t score;        // Score
  bool renormalize;     // divide the chosen weights by their sum
  int32_t num_groups;   // experts split into this many contiguous groups; 1 = no group limit
  int32_t top_groups;   // only experts of the best `top_groups` groups can be chosen
  bool has_bias;        // sigmoid only: bias added to the score for selection, not to the weight
};

JK_HOST_DEVICE float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// The key experts are ranked by. Softmax ranks by the logit (order-equivalent to the probability, and free of the
// rounding of the normaliser); sigmoid by sigmoid(logit) + bias, as DeepSeek-V3 does. NaN ranks last.
template <typename Logit>
JK_HOST_DEVICE float selection_key(const Logit* logits, const float* bias, const RouteParams& p, int e) {
  float logit = load_as_float(logits, e);
  float key = p.score == kSoftmax ? logit : sigmoid(logit) + (p.has_bias ? bias[e] : 0.0f);
  return key != key ? -INFINITY : key;
}

// Total order of (key, expert): a higher key first, then the lower expert id, so ties break deterministically.
JK_HOST_DEVICE bool ranks_before(float key_a, int a, float key_b, int b) {
  return key_a > key_b || (key_a == key_b && a < b);
}

// Group score: the sum of the two best keys of the group (one when groups have a single expert), DeepSeek-V3 style.
template <typename Logit>
JK_HOST_DEVICE float group_score(const Logit* logits, const float* bias, const RouteParams& p, int group) {
  int group_size = p.num_experts / p.num_groups;
  int first = group * group_size;
  float best = -INFINITY, second = -INFINITY;
  int best_expert = -1, second_expert = -1;
  for (int e = first; e < first + group_size; ++e) {
    float key = selection_key(logits, bias, p, e);
    if (best_expert < 0 || ranks_before(key, e, best, best_expert)) {
      second = best, second_expert = best_expert;
      best = key, best_expert = e;
    } else if (second_expert < 0 || ranks_before(key, e, second, second_expert)) {
      second = key, second_expert = e;
    }
  }
  return group_size > 1 ? best + second : best;
}

// Bit g set when group g may be chosen from (num_groups <= 64, checked in Python).
template <typename Logit>
JK_HOST_DEVICE uint64_t allowed_groups(const Logit* logits, const float* bias, const RouteParams& p) {
  if (p.num_groups <= 1) return ~uint64_t(0);
  uint64_t allowed = 0;
  float previous_score = INFINITY;
  int previous_group = -1;
  for (int pick = 0; pick < p.top_groups; ++pick) {
    float best = -INFINITY;
    int best_group = -1;
    for (int g = 0; g < p.num_groups; ++g) {
      float score = group_score(logits, bias, p, g);
      bool after_previous = previous_group < 0 || ranks_before(previous_score, previous_group, score, g);
      if (after_previous && (best_group < 0 || ranks_before(score, g, best, best_group))) best = score, best_group = g;
    }
    allowed |= uint64_t(1) << best_group;
    previous_score = best, previous_group = best_group;
  }
  return allowed;
}

// Routes one token: logits [num_experts] -> weights [top_k] f32, ids [top_k] int32, best first.
// Top-k as k passes, each taking the best expert ranked after the previous pick: no scratch, any num_experts.
template <typename Logit>
JK_HOST_DEVICE void route_token(const Logit* logits, const float* bias, const RouteParams& p, float* weights,
                                int32_t* ids) {
  uint64_t groups = allowed_groups(logits, bias, p);
  int group_size = p.num_experts / (p.num_groups > 1 ? p.num_groups : 1);

  float previous_key = INFINITY;
  int previous_expert = -1;
  for (int j = 0; j < p.top_k; ++j) {
    float best = -INFINITY;
    int best_expert = -1;
    for (int e = 0; e < p.num_experts; ++e) {
      if (!((groups >> (e / group_size)) & 1)) continue;
      float key = selection_key(logits, bias, p, e);
      bool after_previous = previous_expert < 0 || ranks_before(previous_key, previous_expert, key, e);
      if (after_previous && (best_expert < 0 || ranks_before(key, e, best, best_expert))) best = key, best_expert = e;
    }
    ids[j] = best_expert;
    previous_key = best, previous_expert = best_expert;
  }

  // Weights: softmax over all experts (then optionally over the chosen), or the unbiased sigmoid.
  float max_logit = -INFINITY, normaliser = 1.0f;
  if (p.score == kSoftmax) {
    for (int e = 0; e < p.num_experts; ++e) max_logit = fmaxf(max_logit, load_as_float(logits, e));
    normaliser = 0.0f;
    for (int e = 0; e < p.num_experts; ++e) normaliser += expf(load_as_float(logits, e) - max_logit);
  }
  float chosen_sum = 0.0f;
  for (int j = 0; j < p.top_k; ++j) {
    float logit = load_as_float(logits, ids[j]);
    weights[j] = p.score == kSoftmax ? expf(logit - max_logit) / normaliser : sigmoid(logit);
    chosen_sum += weights[j];
  }
  if (p.renormalize) {
    for (int j = 0; j < p.top_k; ++j) weights[j] /= chosen_sum;
  }
}

// Expert-major schedule: offsets[e] = sum over earlier experts of their counts rounded up to `align`.
JK_HOST_DEVICE int32_t align_up(int32_t count, int32_t align) { return (count + align - 1) / align * align; }

// The CUDA schedule cuts the (token, slot) entries into chunks of kChunk and counts each chunk's entries per expert
// in its chunk_counts workspace, [num_experts, schedule_chunks(entries)] (kernels/routing.cuh).
constexpr int kChunk = 256;

JK_HOST_DEVICE int64_t schedule_chunks(int64_t entries) { return (entries + kChunk - 1) / kChunk; }

}  // namespace jk::routing
