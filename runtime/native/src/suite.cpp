#include "suite.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <sys/resource.h>

#include "errors.h"

namespace mtp {
namespace {

double rounded(double x, int digits) {
  const double scale = std::pow(10.0, digits);
  return std::round(x * scale) / scale;
}

double rate(double tokens, double seconds) { return seconds > 0 ? tokens / seconds : 0.0; }

char fmt_buffer[256];
const char* fmt1(double x) {
  std::snprintf(fmt_buffer, sizeof fmt_buffer, "%.1f", x);
  return fmt_buffer;
}

// Per-prompt verdict: identical, or the first divergence and whether it is a near-tie.
nlohmann::json compare_runs(const GenerationResult& plain, const GenerationResult& spec) {
  const int64_t j = first_divergence(plain.token_ids, spec.token_ids);
  if (j < 0)
    return {{"identical", true}, {"first_divergence", nullptr}, {"top2_gap", nullptr},
            {"near_tie", nullptr}};
  nlohmann::json gap = nullptr;
  bool near_tie = false;
  if (j < int64_t(plain.top2_gaps.size())) {
    gap = plain.top2_gaps[j];
    near_tie = plain.top2_gaps[j] < kNearTie;
  }
  return {{"identical", false}, {"first_divergence", j}, {"top2_gap", gap},
          {"near_tie", near_tie}};
}

// Passes everything through to `inner` and keeps the tokens of each draft it proposed, cut to k
// as the loop cuts them.
class RecordingDrafter : public ForwardingDrafter {
 public:
  using ForwardingDrafter::ForwardingDrafter;
  Draft propose(const std::vector<int64_t>& context, const Hidden* hidden, int64_t k,
                Sampler& sampler) override {
    Draft draft = ForwardingDrafter::propose(context, hidden, k, sampler);
    if (k <= 0) return draft;  // asked for nothing (a drafter keeping state takes in the rows)
    const size_t n = std::min(draft.tokens.size(), size_t(k));
    drafts.emplace_back(draft.tokens.begin(), draft.tokens.begin() + n);
    return draft;
  }
  std::vector<std::vector<int64_t>> drafts;
};

}  // namespace

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::vector<Prompt> load_prompts(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw UserError("cannot read prompts file " + path);
  std::vector<Prompt> prompts;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      nlohmann::json row = nlohmann::json::parse(line);
      Prompt p;
      p.id = row.at("id").is_string() ? row["id"].get<std::string>() : row["id"].dump();
      p.category = row.value("category", std::string("default"));
      p.max_new_tokens = row.value("max_new_tokens", int64_t(128));
      if (row.contains("prompt_ids")) p.ids = row["prompt_ids"].get<std::vector<int64_t>>();
      if (row.contains("prompt")) p.text = row["prompt"].get<std::string>();
      if (p.ids.empty() && !row.contains("prompt")) throw std::runtime_error("no prompt");
      prompts.push_back(std::move(p));
    } catch (const std::exception& e) {
      throw UserError(path + " line " + std::to_string(n) +
                      ": expected JSON with id, category, prompt (or prompt_ids), "
                      "max_new_tokens (" + e.what() + ")");
    }
  }
  if (prompts.empty()) throw UserError(path + " holds no prompts");
  return prompts;
}

nlohmann::json run_suite(Engine& engine, const std::vector<Prompt>& prompts,
                         const SuiteOptions& options,
                         const std::function<void(const std::string&)>& progress) {
  const int64_t K = options.config.k;
  nlohmann::json rows = nlohmann::json::array();
  double ar_tokens = 0, ar_s = 0, spec_tokens = 0, spec_s = 0;
  int64_t steps = 0, drafted = 0, accepted = 0, spec_generated_minus_one = 0;
  std::vector<int64_t> accepted_pos(K, 0), drafted_pos(K, 0);
  std::vector<double> ttft_ar, ttft_spec, ar_steps, verify_steps, draft_steps;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const Prompt& p = prompts[i];
    const std::vector<int64_t> ids =
        p.ids.empty() ? engine.encode_prompt(p.text, options.chat) : p.ids;
    GenerationConfig cfg = options.config;
    cfg.max_new_tokens = options.max_new_tokens ? options.max_new_tokens : p.max_new_tokens;
    std::vector<double> ar_rates, spec_rates;
    GenerationResult plain, spec;
    std::vector<std::vector<int64_t>> spec_drafts;
    int64_t store_extended = 0;
    for (int r = 0; r < options.repeat; ++r) {
      // Interleaved, so that machine drift affects both alike.
      plain = engine.generate(ids, nullptr, cfg, nullptr, false);
      const int64_t store_drafts = options.store ? options.store->drafts() : 0;
      if (options.record_drafts && engine.drafter() != nullptr) {
        RecordingDrafter recording(engine.drafter());
        spec = engine.generate(ids, &recording, cfg, nullptr, false);
        spec_drafts = std::move(recording.drafts);
      } else {
        spec = engine.generate(ids, engine.drafter(), cfg, nullptr, false);
      }
      if (options.store) store_extended = options.store->drafts() - store_drafts;
      ar_rates.push_back(plain.stats.decode_tokens_per_s());
      spec_rates.push_back(spec.stats.decode_tokens_per_s());
      ar_tokens += std::max<int64_t>(plain.stats.generated_tokens - 1, 0);
      ar_s += plain.stats.decode_seconds;
      spec_tokens += std::max<int64_t>(spec.stats.generated_tokens - 1, 0);
      spec_s += spec.stats.decode_seconds;
      ttft_ar.push_back(plain.stats.ttft_ms);
      ttft_spec.push_back(spec.stats.ttft_ms);
    }
    if (options.store != nullptr) {
      std::vector<int64_t> request = ids;
      request.insert(request.end(), spec.token_ids.begin(), spec.token_ids.end());
      options.store->add(request, int64_t(ids.size()));
    }
    const GenerationStats& s = spec.stats;
    steps += s.verify_steps;
    drafted += s.drafted_tokens;
    accepted += s.accepted_tokens;
    spec_generated_minus_one += s.generated_tokens - 1;
    for (int64_t j = 0; j < K; ++j) {
      if (j < int64_t(s.accepted_per_position.size())) accepted_pos[j] += s.accepted_per_position[j];
      if (j < int64_t(s.drafted_per_position.size())) drafted_pos[j] += s.drafted_per_position[j];
    }
    const double ar_rate = median(ar_rates), spec_rate = median(spec_rates);
    const double per_step = 1e3 / double(std::max<int64_t>(s.verify_steps, 1));
    const double ar_step = plain.stats.verify_seconds * 1e3 /
                           double(std::max<int64_t>(plain.stats.verify_steps, 1));
    nlohmann::json row = {
        {"id", p.id},
        {"category", p.category},
        {"prompt_tokens", ids.size()},
        {"ar_tokens", plain.stats.generated_tokens},
        {"spec_tokens", s.generated_tokens},
        {"ar_tokens_per_s", rounded(ar_rate, 3)},
        {"spec_tokens_per_s", rounded(spec_rate, 3)},
        {"speedup", rounded(rate(spec_rate, ar_rate), 4)},
        {"tau", rounded(s.tau(), 4)},
        {"acceptance_rate", rounded(s.acceptance_rate(), 4)},
        {"verify_steps", s.verify_steps},
        {"draft_ms_per_step", rounded(s.draft_seconds * per_step, 4)},
        {"verify_ms_per_step", rounded(s.verify_seconds * per_step, 4)},
        {"ar_ms_per_step", rounded(ar_step, 4)},
        {"stop_reason_ar", plain.stop_reason},
        {"stop_reason_spec", spec.stop_reason},
    };
    row.update(compare_runs(plain, spec));
    row["ar_token_ids"] = plain.token_ids;
    row["spec_token_ids"] = spec.token_ids;
    if (options.store != nullptr) row["store_extended"] = store_extended;
    if (options.record_drafts) {
      row["spec_drafts"] = spec_drafts;
      row["spec_steps"] = spec.step_counts;  // per verify step [drafted, accepted]
    }
    ar_steps.push_back(row["ar_ms_per_step"]);
    verify_steps.push_back(row["verify_ms_per_step"]);
    draft_steps.push_back(row["draft_ms_per_step"]);
    if (progress) {
      std::ostringstream line;
      line << "[" << i + 1 << "/" << prompts.size() << "] " << p.id << ": plain "
           << fmt1(ar_rate) << " tok/s, spec " << fmt1(spec_rate) << " tok/s, tau "
           << rounded(s.tau(), 2) << ", " << (row["identical"] ? "identical" : "DIFFERS");
      progress(line.str());
    }
    rows.push_back(std::move(row));
  }
  const double ar_step = median(ar_steps), verify_step = median(verify_steps),
               draft_step = median(draft_steps);
  const double ar = rate(ar_tokens, ar_s), sp = rate(spec_tokens, spec_s);
  int64_t divergences = 0, near_ties = 0;
  for (const auto& r : rows)
    if (!r["identical"].get<bool>()) {
      ++divergences;
      near_ties += r["near_tie"].get<bool>();
    }
  nlohmann::json by_position = nlohmann::json::array();
  for (int64_t j = 0; j < K; ++j)
    by_position.push_back(drafted_pos[j] ? nlohmann::json(rounded(
                                               double(accepted_pos[j]) / drafted_pos[j], 4))
                                         : nlohmann::json(nullptr));
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  nlohmann::json summary = {
      {"prompts", rows.size()},
      {"lossless", divergences == near_ties},
      {"divergences", divergences},
      {"near_tie_divergences", near_ties},
      {"near_tie_tolerance", kNearTie},
      {"ar_tokens_per_s", rounded(ar, 3)},
      {"spec_tokens_per_s", rounded(sp, 3)},
      {"speedup", rounded(rate(sp, ar), 4)},
      {"tau", rounded(double(spec_generated_minus_one) / double(std::max<int64_t>(steps, 1)), 4)},
      {"acceptance_rate", drafted ? rounded(double(accepted) / drafted, 4) : 0.0},
      {"acceptance_by_position", by_position},
      {"ar_ms_per_step", rounded(ar_step, 4)},
      {"verify_ms_per_step", rounded(verify_step, 4)},
      {"verify_over_decode", rounded(rate(verify_step, ar_step), 4)},
      {"draft_ms_per_step", rounded(draft_step, 4)},
      {"draft_over_decode", rounded(rate(draft_step, ar_step), 4)},
      {"ttft_ms_ar", rounded(median(ttft_ar), 3)},
      {"ttft_ms_spec", rounded(median(ttft_spec), 3)},
      {"peak_rss_mb", rounded(double(usage.ru_maxrss) / 1024.0, 1)},
  };
  nlohmann::json per_category = nlohmann::json::object();
  std::set<std::string> categories;
  for (const auto& r : rows) categories.insert(r["category"].get<std::string>());
  for (const std::string& c : categories) {
    std::vector<double> a, sp_, speedup, tau;
    int64_t identical = 0;
    for (const auto& r : rows) {
      if (r["category"] != c) continue;
      a.push_back(r["ar_tokens_per_s"]);
      sp_.push_back(r["spec_tokens_per_s"]);
      speedup.push_back(r["speedup"]);
      tau.push_back(r["tau"]);
      identical += r["identical"].get<bool>();
    }
    per_category[c] = {
        {"prompts", a.size()},
        {"ar_tokens_per_s", rounded(median(a), 3)},
        {"spec_tokens_per_s", rounded(median(sp_), 3)},
        {"speedup", rounded(median(speedup), 4)},
        {"tau", rounded(median(tau), 4)},
        {"identical", identical},
    };
  }
  return {{"summary", summary}, {"per_category", per_category}, {"prompts", rows}};
}

}  // namespace mtp
