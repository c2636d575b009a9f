#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/distributed/tensor_parallel.h"
#include "vlmgen/error.h"

namespace vlmgen {

/// How the next token is chosen from the last position's logits.
struct SamplingOptions {
  /// 0: greedy (argmax, ties to the lowest id). > 0: sample from softmax(logits / temperature).
  double temperature = 0.0;
  /// Keep only the k most likely tokens before sampling (0: off).
  int64_t top_k = 0;
  /// Keep the smallest set of most likely tokens whose probability reaches top_p (1: off).
  double top_p = 1.0;
  /// Seed of every row's random stream; a row's tokens depend on its seed only, never on the
  /// batch it runs in.
  uint64_t seed = 0;
  /// Per-row seeds overriding `seed` (empty: every row uses `seed`).
  std::vector<uint64_t> row_seeds;
  /// Token ids never chosen (the generator puts the model's image/video placeholders here).
  std::vector<int64_t> suppressed_tokens;

  bool greedy() const { return temperature <= 0.0; }

  void validate(int64_t batch) const {
    VLMGEN_CHECK(std::isfinite(temperature) && temperature >= 0.0,
                 "temperature must be a finite number >= 0 (0 = greedy), got {}", temperature);
    VLMGEN_CHECK(top_k >= 0, "top_k must be >= 0 (0 = off), got {}", top_k);
    VLMGEN_CHECK(top_p > 0.0 && top_p <= 1.0, "top_p must be in (0, 1], got {}", top_p);
    VLMGEN_CHECK(row_seeds.empty() || static_cast<int64_t>(row_seeds.size()) == batch,
                 "row_seeds has {} entries for a batch of {} rows", row_seeds.size(), batch);
  }
};

/// Where one tensor-parallel rank's vocab-parallel logits sit in the vocabulary.
struct VocabShard {
  /// First global id of this rank's block (tp_rank * block width).
  int64_t start = 0;
  /// Real ids of the whole vocabulary; columns from here on are padding and never chosen.
  int64_t vocab_size = 0;
  /// The tensor-parallel group whose ranks hold the other blocks (null: this block is all).
  Communicator* group = nullptr;
};

/// Chooses tokens for a batch, one random stream per row. Logits are read on the host in
/// float32, so the same seed gives the same tokens on every device and every rank.
class Sampler {
 public:
  Sampler(SamplingOptions options, int64_t batch) : options_(std::move(options)) {
    options_.validate(batch);
    if (!options_.greedy()) {
      for (int64_t b = 0; b < batch; ++b) {
        generators_.push_back(
            detail::make_cpu_generator(options_.row_seeds.empty() ? options_.seed : options_.row_seeds[b]));
      }
    }
  }

  const SamplingOptions& options() const { return options_; }

  /// Next token of every row from `logits` [B, V]; rows with active[b] == false get -1 and do
  /// not advance their random stream. When `logprobs` is given, it receives
  /// log_softmax(logits)[token] of each chosen token (the model's distribution, before
  /// temperature, filtering and suppression).
  std::vector<int64_t> choose(const at::Tensor& logits, const std::vector<bool>& active,
                              std::vector<float>* logprobs = nullptr) {
    VLMGEN_CHECK(logits.dim() == 2 && logits.size(0) == static_cast<int64_t>(active.size()),
                 "sampler expects logits [{}, V], got {}", active.size(), detail::shape_str(logits));
    const int64_t batch = logits.size(0);
    std::vector<int64_t> tokens(static_cast<size_t>(batch), -1);
    // A copy with the suppressed ids at -inf (NaN checks read the logits before this).
    auto suppress = [&](const at::Tensor& t) {
      if (options_.suppressed_tokens.empty()) return t;
      at::Tensor out = t.clone();
      for (int64_t id : options_.suppressed_tokens) {
        if (id >= 0 && id < t.size(1)) out.select(1, id).fill_(-std::numeric_limits<float>::infinity());
      }
      return out;
    };
    // One read back to the host a step (on an accelerator each one waits for the device): the
    // greedy choices and the unusable-row flags together, or the logits themselves when sampling.
    std::vector<bool> bad_rows(static_cast<size_t>(batch), false);
    if (options_.greedy()) {
      const at::Tensor allowed = suppress(logits);
      const std::vector<int64_t> picked =
          detail::to_int64_vector(at::stack({allowed.argmax(-1), unusable_rows(logits, allowed).to(at::kLong)}));
      for (int64_t b = 0; b < batch; ++b) bad_rows[b] = picked[batch + b] != 0;
      check_usable(bad_rows, active);
      for (int64_t b = 0; b < batch; ++b) {
        if (active[b]) tokens[b] = picked[b];
      }
    } else {
      const at::Tensor host = logits.to(at::kCPU, at::kFloat).contiguous();
      const at::Tensor allowed = suppress(host);
      bad_rows = detail::to_bool_vector(unusable_rows(host, allowed));
      check_usable(bad_rows, active);
      for (int64_t b = 0; b < batch; ++b) {
        if (active[b]) tokens[b] = sample_row(allowed[b], generators_[b]);
      }
    }
    if (logprobs != nullptr) {
      at::Tensor lp = at::log_softmax(logits.to(at::kFloat), -1).to(at::kCPU);
      logprobs->assign(static_cast<size_t>(batch), 0.0f);
      auto acc = lp.accessor<float, 2>();
      for (int64_t b = 0; b < batch; ++b) {
        if (active[b]) (*logprobs)[b] = acc[b][tokens[b]];
      }
    }
    return tokens;
  }

  /// choose() over vocab-parallel logits: `local_logits` [B, W] are this rank's block
  /// [shard.start, shard.start + W) of the vocabulary. Greedy without logprobs takes each rank's
  /// local argmax and all-gathers (value, id) pairs, never the vocabulary; sampling and logprobs
  /// gather the full rows of this one position. Every rank of the group must call it with the
  /// same `active` and options; all get the same tokens (the gathered rows are bitwise equal,
  /// and so are the seeds). Suppressed ids are masked on the rank that holds them.
  std::vector<int64_t> choose_vocab_parallel(const at::Tensor& local_logits, const VocabShard& shard,
                                             const std::vector<bool>& active, std::vector<float>* logprobs = nullptr) {
    VLMGEN_CHECK(local_logits.dim() == 2 && local_logits.size(0) == static_cast<int64_t>(active.size()),
                 "sampler expects vocab-parallel logits [{}, V/tp], got {}", active.size(),
                 detail::shape_str(local_logits));
    const int64_t width = local_logits.size(1);
    const int64_t ranks = detail::group_size(shard.group);
    VLMGEN_CHECK(shard.start >= 0 && shard.start % std::max<int64_t>(width, 1) == 0 && shard.start < width * ranks,
                 "vocab shard start {} is not a block boundary of {} ranks holding {} ids each", shard.start, ranks,
                 width);
    VLMGEN_CHECK(shard.vocab_size > 0 && width * ranks >= shard.vocab_size,
                 "{} ranks holding {} logits each cover {} ids, fewer than the vocabulary of {}", ranks, width,
                 width * ranks, shard.vocab_size);
    if (ranks == 1) return choose(local_logits.narrow(1, 0, shard.vocab_size), active, logprobs);
    if (!options_.greedy() || logprobs != nullptr) {
      at::Tensor full = gather_last_position_logits(local_logits, shard.group).narrow(1, 0, shard.vocab_size);
      return choose(full, active, logprobs);
    }
    const int64_t padding_from = std::clamp<int64_t>(shard.vocab_size - shard.start, 0, width);
    // A NaN or +inf among a rank's real ids (suppressed ones included, as choose() reads them)
    // makes that block's row NaN, so every rank sees the row as unusable after the gather.
    const at::Tensor real = local_logits.narrow(1, 0, padding_from);
    at::Tensor allowed = local_logits.masked_fill((real.isnan().any(-1) | real.isposinf().any(-1)).unsqueeze(1),
                                                  std::numeric_limits<float>::quiet_NaN());
    const float neg_inf = -std::numeric_limits<float>::infinity();
    if (padding_from < width) allowed.narrow(1, padding_from, width - padding_from).fill_(neg_inf);
    for (int64_t id : options_.suppressed_tokens) {
      if (id >= shard.start && id < shard.start + width) allowed.select(1, id - shard.start).fill_(neg_inf);
    }
    std::vector<bool> bad_rows;
    const std::vector<int64_t> best =
        detail::to_int64_vector(vocab_parallel_argmax(allowed, shard.start, shard.group, &bad_rows));
    check_usable(bad_rows, active);
    std::vector<int64_t> tokens(active.size(), -1);
    for (size_t b = 0; b < active.size(); ++b) {
      if (active[b]) tokens[b] = best[b];
    }
    return tokens;
  }

 private:
  // Rows no token can honestly be chosen from: a NaN or +inf logit anywhere (no distribution:
  // softmax gives NaN; argmax would return an artefact of the ordering), or no allowed token
  // above -inf. `allowed`: the logits with the suppressed ids at -inf. -inf elsewhere is fine.
  static at::Tensor unusable_rows(const at::Tensor& logits, const at::Tensor& allowed) {
    return logits.isnan().any(-1) | logits.isposinf().any(-1) | allowed.amax(-1).isneginf();
  }
  static void check_usable(const std::vector<bool>& bad_rows, const std::vector<bool>& active) {
    for (size_t b = 0; b < bad_rows.size() && b < active.size(); ++b) {
      VLMGEN_CHECK(!(bad_rows[b] && active[b]),
                   "the model's logits for row {} hold NaN or +inf, or no allowed token has a logit above -inf: no "
                   "token can be chosen (expected finite logits; check the model's weights and inputs)",
                   b);
    }
  }

  int64_t sample_row(const at::Tensor& row_logits, at::Generator& gen) const {
    // In float64: logits / a tiny temperature stay finite (a float32 quotient would overflow).
    at::Tensor scaled = row_logits.to(at::kDouble) / options_.temperature;
    const int64_t vocab = scaled.size(0);
    at::Tensor probs;       // candidate probabilities, most likely first when filtered
    at::Tensor candidates;  // their token ids (undefined: the whole vocabulary in order)
    if (options_.top_k > 0 && options_.top_k < vocab) {
      at::Tensor values;
      std::tie(values, candidates) = at::topk(scaled, options_.top_k, 0, /*largest=*/true, /*sorted=*/true);
      probs = at::softmax(values, 0);
    } else {
      probs = at::softmax(scaled, 0);
    }
    if (options_.top_p < 1.0) {
      if (!candidates.defined()) {
        // The nucleus almost always lies in the few most likely tokens: sort those only, and
        // the whole vocabulary only when they do not reach top_p.
        const int64_t head = std::min<int64_t>(vocab, 1024);
        std::tie(probs, candidates) = at::topk(probs, head, 0, /*largest=*/true, /*sorted=*/true);
        if (head < vocab && probs.sum().item<double>() < options_.top_p) {
          std::tie(probs, candidates) = at::sort(at::softmax(scaled, 0), 0, /*descending=*/true);
        }
      }
      // Keep tokens while the mass before them is below top_p: the first token always stays.
      at::Tensor before = probs.cumsum(0) - probs;
      const int64_t kept = std::max<int64_t>(1, (before < options_.top_p).sum().item<int64_t>());
      probs = probs.narrow(0, 0, kept);
      candidates = candidates.narrow(0, 0, kept);
    }
    const int64_t pick = at::multinomial(probs, 1, /*replacement=*/false, gen).item<int64_t>();
    return candidates.defined() ? candidates[pick].item<int64_t>() : pick;
  }

  SamplingOptions options_;
  std::vector<at::Generator> generators_;  // one per row, CPU
};

}  // namespace vlmgen
