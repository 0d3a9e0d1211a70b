#include "loop.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <stdexcept>

#include "errors.h"

namespace mtp {
namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

float top2_gap(const float* row, int64_t n) {
  float first = -INFINITY, second = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    if (row[i] > first) {
      second = first;
      first = row[i];
    } else if (row[i] > second) {
      second = row[i];
    }
  }
  return first - second;
}

}  // namespace

double GenerationStats::tau() const {
  return verify_steps ? double(generated_tokens - 1) / double(verify_steps) : 0.0;
}

double GenerationStats::acceptance_rate() const {
  return drafted_tokens ? double(accepted_tokens) / double(drafted_tokens) : 0.0;
}

double GenerationStats::decode_tokens_per_s() const {
  return decode_seconds > 0 ? double(generated_tokens - 1) / decode_seconds : 0.0;
}

GenerationResult generate(Model& target, const std::vector<int64_t>& prompt, Drafter* drafter,
                          const GenerationConfig& config, const Detokenize& detokenize,
                          const OnToken& on_token, int64_t cached_prefix) {
  if (prompt.empty()) throw UserError("the prompt is empty: give at least one token of text");
  if (int64_t(prompt.size()) >= target.max_seq_len)
    throw UserError("the prompt has " + std::to_string(prompt.size()) +
                    " tokens but the context holds " + std::to_string(target.max_seq_len) +
                    ": shorten the prompt or raise --max-seq-len");
  if (config.max_new_tokens < 1) throw UserError("--max-new-tokens must be >= 1");
  if (config.k < 0) throw UserError("--k must be >= 0");
  if (cached_prefix < 0) throw std::invalid_argument("cached_prefix must be >= 0");
  if (!config.stop_strings.empty() && !detokenize)
    throw std::invalid_argument("stop strings need a detokenize function");
  Sampler sampler(config.sampling);
  const bool wants_hidden = drafter != nullptr && drafter->needs_hidden();
  const int64_t k_max = drafter != nullptr ? config.k : 0;
  int64_t k_now = k_max;
  StepCosts own_costs;
  std::optional<Fallback> fallback;
  if (drafter != nullptr && config.fallback.value_or(sampler.greedy()) && k_max > 0)
    fallback.emplace(k_max, config.costs ? *config.costs : own_costs,
                     [drafter](const std::vector<int64_t>& context) {
                       return drafter->source(context);
                     });
  GenerationResult result;
  GenerationStats& stats = result.stats;
  stats.accepted_per_position.assign(k_max, 0);
  stats.drafted_per_position.assign(k_max, 0);
  std::vector<int64_t>& generated = result.token_ids;

  // Appends tokens one by one, exactly as plain decoding would; returns a stop reason or "".
  auto emit = [&](const std::vector<int64_t>& tokens, const Output& out) -> std::string {
    for (size_t i = 0; i < tokens.size(); ++i) {
      const int64_t token = tokens[i];
      if (std::find(config.eos_ids.begin(), config.eos_ids.end(), token) != config.eos_ids.end())
        return "eos";
      generated.push_back(token);
      result.top2_gaps.push_back(double(top2_gap(out.logit_row(int64_t(i)), out.vocab)));
      if (on_token && !on_token(token)) return "stopped";
      if (!config.stop_strings.empty()) {
        const size_t from = generated.size() - std::min(generated.size(), kStopTailTokens);
        const std::string tail =
            detokenize(std::vector<int64_t>(generated.begin() + from, generated.end()));
        for (const std::string& s : config.stop_strings)
          if (tail.find(s) != std::string::npos) return "stop_string";
      }
      if (int64_t(generated.size()) >= config.max_new_tokens) return "max_tokens";
    }
    return "";
  };

  // Prefill: the prompt in chunks, past what the cache already holds (at least its last token,
  // whose logits give the first token).
  const double start = now();
  const int64_t reused = result.reused_tokens =
      std::min<int64_t>(cached_prefix, int64_t(prompt.size()) - 1);
  Output out = prefill(target, {prompt.begin() + reused, prompt.end()}, reused, wants_hidden);
  Hidden hidden;  // the rows the target's last call added (the prefilled ones after prefill)
  if (wants_hidden) {
    hidden.dim = out.dim;
    hidden.rows = out.dim > 0 ? int64_t(out.hidden.size()) / out.dim : 0;
    hidden.data = std::move(out.hidden);
  }
  const int64_t first = sampler.pick(out.logit_row(out.rows - 1), out.vocab);
  stats.ttft_ms = (now() - start) * 1e3;
  const double decode_start = now();
  std::string stop = emit({first}, out);
  std::vector<int64_t> context = prompt;
  context.push_back(first);
  int64_t pos = int64_t(prompt.size());

  while (stop.empty()) {
    const int64_t room = target.max_seq_len - pos;  // free slots: the pending token plus drafts
    if (room < 1) {
      stop = "context_full";
      break;
    }
    const double t0 = now();
    const int64_t k =
        std::min({k_now, room - 1, config.max_new_tokens - int64_t(generated.size()) - 1});
    int64_t requested = k;
    bool shadow = false;
    if (fallback) {
      const Fallback::Plan plan = fallback->plan(k, context);
      requested = plan.draft;
      shadow = plan.shadow;
      stats.fallback_steps += k > 0 && requested == 0;
      if (shadow) requested = k;  // drafted to learn whether drafting pays again, not verified
    }
    Draft draft;
    if (drafter != nullptr)
      draft = drafter->propose(context, wants_hidden ? &hidden : nullptr, requested, sampler);
    if (shadow) {
      const size_t n = std::min(draft.tokens.size(), size_t(k));
      fallback->start_shadow({draft.tokens.begin(), draft.tokens.begin() + n},
                             int64_t(context.size()));
      draft = Draft{};
    }
    if (int64_t(draft.tokens.size()) > requested) draft.tokens.resize(requested);
    if (draft.probs.size() > draft.tokens.size()) draft.probs.resize(draft.tokens.size());
    const double t1 = now();
    std::vector<int64_t> inputs{context.back()};
    inputs.insert(inputs.end(), draft.tokens.begin(), draft.tokens.end());
    out = target.forward(inputs, pos, wants_hidden);
    const Accepted a =
        sampler.greedy()
            ? accept_greedy(out.logits.data(), out.vocab, draft.tokens)
            : accept_sampling(out.logits.data(), out.vocab, draft.tokens, draft.probs, sampler);
    const double t2 = now();

    const int64_t drafted = int64_t(draft.tokens.size());
    stats.draft_seconds += t1 - t0;
    stats.verify_seconds += t2 - t1;
    stats.verify_steps += 1;
    stats.drafted_tokens += drafted;
    stats.drafted_steps += drafted > 0;
    stats.accepted_tokens += a.n;
    result.step_counts.emplace_back(drafted, a.n);
    for (int64_t i = 0; i < drafted; ++i) {
      stats.drafted_per_position[i] += 1;
      stats.accepted_per_position[i] += i < a.n;
    }
    if (config.adaptive_k && drafted > 0)
      k_now = a.n == drafted ? std::min(k_max, k_now + 2) : std::max<int64_t>(1, k_now - 1);

    std::vector<int64_t> new_tokens(draft.tokens.begin(), draft.tokens.begin() + a.n);
    new_tokens.push_back(a.next_token);
    stop = emit(new_tokens, out);
    context.insert(context.end(), new_tokens.begin(), new_tokens.end());
    if (fallback) {
      const bool modelled = config.cost_model.has_value();
      fallback->record_step(
          requested, drafted, a.n,
          modelled ? config.cost_model->draft_seconds(fallback->source(), requested) : t1 - t0,
          modelled ? config.cost_model->verify_seconds(drafted + 1) : t2 - t1);
      fallback->check_shadow(context);
    }
    pos += a.n + 1;
    if (wants_hidden) {  // the accepted inputs' rows: context[-(n+2)] .. context[-2]
      hidden.rows = a.n + 1;
      hidden.data.assign(out.hidden_row(0), out.hidden_row(a.n + 1));
    }
  }

  // A drafter that keeps state takes in the last verified rows (runtime/loop.py does the same):
  // a self head's cache then holds the whole answer for a conversation's next turn.
  if (drafter != nullptr) drafter->observe(context, wants_hidden ? &hidden : nullptr);
  stats.decode_seconds = now() - decode_start;
  stats.generated_tokens = int64_t(generated.size());
  result.stop_reason = stop;
  result.cached_tokens.assign(context.begin(), context.begin() + pos);
  return result;
}

int64_t first_divergence(const std::vector<int64_t>& plain, const std::vector<int64_t>& spec) {
  const size_t n = std::min(plain.size(), spec.size());
  for (size_t i = 0; i < n; ++i)
    if (plain[i] != spec[i]) return int64_t(i);
  return plain.size() == spec.size() ? -1 : int64_t(n);
}

}  // namespace mtp
