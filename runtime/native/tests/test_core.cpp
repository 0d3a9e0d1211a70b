// Unit tests of the core without ExecuTorch programs: SHA-256, sampling and verification rules,
// the n-gram drafter, the MTP drafter's positions and cache-end clamp, the store of past
// requests, and the loop's lossless property on a fake target (a fresh prompt and one that
// starts from a kept cache). Plain asserts; the pytest suite runs this binary, and with
// arguments it runs the C API on a real bundle (tests/test_native.py: one generation, the
// store; tests/test_android_demo.py: a chat), the store driven by a file of requests, or the
// store seeded from a request log.
// Past 600 lines: the core's C++ tests are one binary, which the build (CMakeLists.txt) makes
// from this one file.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "answer_store.h"
#include "drafters.h"
#include "engine.h"
#include "fallback.h"
#include "mtp_edge.h"
#include "errors.h"
#include "loop.h"
#include "sampling.h"
#include "sha256.h"

namespace {

int failures = 0;

#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::fprintf(stderr, "%s:%d: CHECK(%s)\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

using mtp::Output;

// A deterministic "language model": logits depend on the last few tokens and the position, so
// it has real structure for drafters to hit and miss. Its cache is the list of tokens written.
class FakeModel : public mtp::Model {
 public:
  FakeModel(int64_t vocab, int64_t max_seq, int64_t chunk) {
    vocab_size = vocab, max_seq_len = max_seq, max_chunk = chunk;
    cache.assign(max_seq, -1);
  }
  Output forward(const std::vector<int64_t>& tokens, int64_t start, bool want_hidden,
                 bool last_only) override {
    if (tokens.empty() || int64_t(tokens.size()) > max_chunk || start + int64_t(tokens.size()) > max_seq_len)
      throw std::runtime_error("bad call");
    for (size_t i = 0; i < tokens.size(); ++i) cache[start + i] = tokens[i];
    starts.push_back(start);
    Output out;
    out.vocab = vocab_size, out.dim = want_hidden ? 2 : 0;
    // With last_only the last row's logits, but every row's hidden state (as the real model).
    const int64_t first = last_only ? int64_t(tokens.size()) - 1 : 0;
    for (int64_t i = 0; i < int64_t(tokens.size()); ++i) {
      const int64_t p = start + i;
      const int64_t a = cache[p], b = p > 0 ? cache[p - 1] : 0;
      if (want_hidden) out.hidden.insert(out.hidden.end(), {float(a), float(b)});
      if (i < first) continue;
      for (int64_t v = 0; v < vocab_size; ++v)
        out.logits.push_back(float(std::sin(0.7 * double(v * (a + 3)) + 0.3 * double(b * v)) * 3 +
                                   (v == (a * 5 + 1) % vocab_size ? 2.5 : 0.0)));
      ++out.rows;
    }
    ++calls;
    return out;
  }
  std::vector<int64_t> cache;
  std::vector<int64_t> starts;  // where each call wrote
  int calls = 0;
};

// A drafter that is right sometimes: proposes the fake model's likely tokens with noise.
class NoisyDrafter : public mtp::Drafter {
 public:
  std::string name() const override { return "noisy"; }
  bool needs_hidden() const override { return true; }
  mtp::Draft propose(const std::vector<int64_t>& context, const mtp::Hidden* hidden, int64_t k,
                     mtp::Sampler&) override {
    check_rows(context, hidden);
    mtp::Draft d;
    int64_t last = context.back();
    for (int64_t i = 0; i < k; ++i) {
      last = (++turn % 3 == 0) ? (last * 7 + 2) % 11 : (last * 5 + 1) % 11;
      d.tokens.push_back(last);
    }
    return d;
  }
  void observe(const std::vector<int64_t>& context, const mtp::Hidden* hidden) override {
    check_rows(context, hidden);
    ++observed;
  }
  // The hidden rows are those of the target's last call: the whole prompt after prefill, the
  // accepted inputs after a verify; the fake model's row holds the token at its position, and
  // the last row is at context[-2].
  void check_rows(const std::vector<int64_t>& context, const mtp::Hidden* hidden) {
    CHECK(hidden != nullptr && hidden->dim == 2 && hidden->rows >= 1);
    CHECK(int64_t(hidden->data.size()) == hidden->rows * 2);
    CHECK(hidden->rows < int64_t(context.size()));
    const int64_t offset = int64_t(context.size()) - 1 - hidden->rows;
    for (int64_t i = 0; i < hidden->rows; ++i) CHECK(hidden->row(i)[0] == float(context[offset + i]));
    if (++calls == 1)  // after prefill: what was prefilled (the whole prompt unless told)
      CHECK(hidden->rows == (prefilled >= 0 ? prefilled : int64_t(context.size()) - 1));
  }
  int64_t turn = 0, calls = 0, observed = 0, prefilled = -1;
};

void test_sha256() {
  CHECK(mtp::sha256_hex("") ==
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(mtp::sha256_hex("abc") ==
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(mtp::sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // Feeding in odd pieces gives the same digest as one piece.
  std::string text(1000, 'x');
  for (size_t i = 0; i < text.size(); ++i) text[i] = char('a' + i * 7 % 26);
  mtp::Sha256 pieces;
  for (size_t i = 0; i < text.size(); i += 37) pieces.update(text.data() + i, std::min<size_t>(37, text.size() - i));
  CHECK(pieces.hex_digest() == mtp::sha256_hex(text));
}

void test_ngram() {
  mtp::Sampler s({});
  mtp::NgramDrafter ngram(3, 1);
  // The latest earlier occurrence of the longest suffix wins, and what followed it is proposed.
  CHECK((ngram.propose({1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3}, nullptr, 2, s).tokens ==
         std::vector<int64_t>{7, 1}));
  CHECK((ngram.propose({5, 6, 5}, nullptr, 4, s).tokens == std::vector<int64_t>{6, 5}));
  CHECK(ngram.propose({1, 2, 3}, nullptr, 4, s).tokens.empty());
  bool refused = false;
  try {
    mtp::NgramDrafter bad(1, 2);
  } catch (const mtp::UserError&) {
    refused = true;
  }
  CHECK(refused);
}

// An MTP step that records its positions (and rows fed) and always favours draft slot
// (last token + 1) % 4; h has 2 values per row.
struct RecordingStep : mtp::StepProgram {
  std::vector<int64_t>* positions;
  std::vector<std::vector<int64_t>>* fed = nullptr;
  explicit RecordingStep(std::vector<int64_t>* p, std::vector<std::vector<int64_t>>* f = nullptr)
      : positions(p), fed(f) {}
  void step(const std::vector<float>& h, const std::vector<int64_t>& tokens, int64_t position,
            std::vector<float>& logits, std::vector<float>& next_h) override {
    CHECK(!tokens.empty() && h.size() == 2 * tokens.size());
    positions->push_back(position);
    if (fed != nullptr) fed->push_back(tokens);
    logits.assign(4, 0.0f);
    logits[(tokens.back() + 1) % 4] = 5.0f;
    next_h.assign(h.end() - 2, h.end());
  }
};

mtp::Hidden hidden_rows(int64_t rows) {
  mtp::Hidden h;
  h.rows = rows, h.dim = 2;
  h.data.assign(2 * rows, 0.0f);
  return h;
}

void test_mtp_positions_and_cache_end() {
  mtp::Sampler s({});
  const mtp::Hidden hidden = hidden_rows(4);
  std::vector<int64_t> positions;
  // Step i runs at len(context) - 1 + i; draft slot j is target token 10 + j.
  mtp::MtpDrafter own(std::make_unique<RecordingStep>(&positions), {10, 11, 12, 13}, 16);
  CHECK((own.propose({1, 2, 3}, &hidden, 3, s).tokens == std::vector<int64_t>{10, 13, 12}));
  CHECK((positions == std::vector<int64_t>{2, 3, 4}));
  // A head that writes the target's cache (cache_len 8) stops at its end: from position 6 it
  // may write slots 6 and 7 only; past the end it drafts nothing.
  positions.clear();
  mtp::MtpDrafter cached(std::make_unique<RecordingStep>(&positions), {10, 11, 12, 13}, 16, 0.0, 8);
  CHECK(cached.propose({0, 1, 2, 3, 4, 5, 6}, &hidden, 4, s).tokens.size() == 2);
  CHECK((positions == std::vector<int64_t>{6, 7}));
  CHECK(cached.propose({0, 1, 2, 3, 4, 5, 6, 7, 8}, &hidden, 4, s).tokens.empty());
  CHECK(positions.size() == 2);
  // An MLP or cache-reading head reads only the last row and observes nothing.
  own.observe({1, 2, 3}, &hidden);
  CHECK(positions.size() == 2);
}

// A self (EAGLE-style) head: the first step feeds every hidden row with context[-T:] at
// position len(context) - T, later steps one token each; k stops at its cache's end; observe
// feeds the rows of a step another drafter drafted for.
void test_mtp_self_head_feeds_the_verified_rows() {
  mtp::Sampler s({});
  std::vector<int64_t> positions;
  std::vector<std::vector<int64_t>> fed;
  mtp::MtpDrafter self(std::make_unique<RecordingStep>(&positions, &fed), {10, 11, 12, 13}, 16,
                       0.0, 9, /*feeds_context=*/true);
  const mtp::Hidden three = hidden_rows(3);
  CHECK((self.propose({1, 2, 3, 4, 5}, &three, 3, s).tokens == std::vector<int64_t>{12, 11, 10}));
  CHECK((positions == std::vector<int64_t>{2, 5, 6}));
  CHECK((fed == std::vector<std::vector<int64_t>>{{3, 4, 5}, {12}, {11}}));
  positions.clear(), fed.clear();
  // From position 7 of a cache of 9: two steps.
  const mtp::Hidden two = hidden_rows(2);
  CHECK(self.propose({0, 1, 2, 3, 4, 5, 6, 7}, &two, 4, s).tokens.size() == 2);
  CHECK((positions == std::vector<int64_t>{6, 8}));
  CHECK((fed == std::vector<std::vector<int64_t>>{{6, 7}, {(7 + 1) % 4 + 10}}));
  positions.clear(), fed.clear();
  self.observe({1, 2, 3, 4, 5}, &two);
  CHECK((positions == std::vector<int64_t>{3}) && (fed == std::vector<std::vector<int64_t>>{{4, 5}}));
  // Asked for no tokens (the loop asks at every step), it still takes in the rows.
  positions.clear(), fed.clear();
  CHECK(self.propose({1, 2, 3, 4, 5}, &two, 0, s).tokens.empty());
  CHECK((positions == std::vector<int64_t>{3}) && (fed == std::vector<std::vector<int64_t>>{{4, 5}}));
}

// Token ids outside the vocabulary are refused before any kernel could see them.
void test_token_id_check() {
  mtp::check_token_ids({0, 5, 9}, 10);
  const std::vector<std::vector<int64_t>> bad_ids = {{1, 10}, {-5}, {99999999}};
  for (const auto& bad : bad_ids) {
    bool refused = false;
    try {
      mtp::check_token_ids(bad, 10);
    } catch (const mtp::UserError& e) {
      refused = std::strstr(e.what(), "ids must be in 0..9") != nullptr;
    }
    CHECK(refused);
  }
}

// The fallback's choices from given costs, worked by hand as runtime/fallback.py computes them.
void test_fallback_decisions() {
  mtp::StepCosts costs;
  CHECK(!costs.verify_seconds(1));
  mtp::Fallback f(4, costs, [](const std::vector<int64_t>&) { return std::string("m"); });
  const mtp::Fallback::Plan first = f.plan(4, {1});
  CHECK(first.draft == 0 && first.shadow);  // nothing measured: a plain step, a shadow draft
  for (int i = 0; i < 3; ++i) costs.record_verify(1, 1.0);
  // An unmeasured width: verify(1) scaled by the prior slope 0.1 per token.
  CHECK(std::fabs(*costs.verify_seconds(3) - 1.2) < 1e-12);
  // Prior acceptance 0.5 per position and free drafts: n = 2 gives 1.75 / 1.2 tokens per
  // second, more than n = 1 (1.5 / 1.1), n = 3 (1.875 / 1.3) or none (1).
  CHECK(f.best_k(4, "m") == 2 && f.best_k(1, "m") == 1);
  costs.record_draft("m", 4, 2.0);  // 0.5 s a token: no draft pays (1.5 / 1.6 < 1)
  CHECK(f.best_k(4, "m") == 0);
  const mtp::Fallback::Plan second = f.plan(4, {1}), third = f.plan(4, {1});
  CHECK(second.draft == 0 && !second.shadow && third.draft == 0 && third.shadow);
  // A shadow draft of two: the first kept, the second not.
  f.start_shadow({5, 6}, 1);
  f.check_shadow({1, 5, 7});
  const std::vector<double> a = f.acceptance("m");
  CHECK(std::fabs(a[0] - 0.575) < 1e-12 && std::fabs(a[1] - 0.48875) < 1e-12 && a[3] == a[1]);
  // One call of width 3 above the prior's estimate: the lower of the two stands until trusted.
  costs.record_verify(3, 1.5);
  CHECK(std::fabs(*costs.verify_seconds(3) - 1.2) < 1e-12);
  CHECK(std::fabs(*costs.verify_seconds(2) - 1.1) < 1e-12);
  costs.record_verify(3, 1.5), costs.record_verify(3, 1.4);
  CHECK(*costs.verify_seconds(3) == 1.5 && std::fabs(*costs.verify_seconds(2) - 1.25) < 1e-12);
}

// With the fallback the loop's output is plain decoding's; it asks the drafter at every step
// (for 0 tokens too) and tells it the last verified rows at the end, as runtime/loop.py does.
void test_loop_fallback_and_observe() {
  mtp::GenerationConfig cfg;
  cfg.max_new_tokens = 30;
  cfg.k = 4;
  const std::vector<int64_t> prompt = {1, 2, 3, 4, 1, 2, 3};
  FakeModel a(11, 64, 6);
  const auto plain = mtp::generate(a, prompt, nullptr, cfg);
  for (const double draft_ms : {0.0, 1e6}) {
    FakeModel b(11, 64, 6);
    NoisyDrafter noisy;
    mtp::GenerationConfig c = cfg;
    c.fallback = true;
    c.cost_model = mtp::CostModel{10, 0.1, draft_ms};
    const auto spec = mtp::generate(b, prompt, &noisy, c);
    CHECK(spec.token_ids == plain.token_ids && spec.stop_reason == plain.stop_reason);
    CHECK(noisy.observed == 1 && noisy.calls == spec.stats.verify_steps + 1);
    CHECK(int64_t(spec.step_counts.size()) == spec.stats.verify_steps);
    int64_t drafted = 0;
    for (const auto& [d, kept] : spec.step_counts) {
      drafted += d;
      CHECK(kept <= d);
    }
    CHECK(drafted == spec.stats.drafted_tokens);
    if (draft_ms > 0)  // drafts never pay: none verified, every step a fallback step
      CHECK(drafted == 0 && spec.stats.fallback_steps > 0);
    else
      CHECK(drafted > 0 && spec.stats.drafted_steps > 0);
  }
}

// mtp+ngram: the lookup's draft where it finds one (the model only observes the step), the
// model's draft elsewhere.
void test_hybrid_drafter() {
  mtp::Sampler s({});
  std::vector<int64_t> positions;
  std::vector<std::vector<int64_t>> fed;
  auto model = std::make_unique<mtp::MtpDrafter>(std::make_unique<RecordingStep>(&positions, &fed),
                                                 std::vector<int64_t>{10, 11, 12, 13}, 16, 0.0,
                                                 64, /*feeds_context=*/true);
  mtp::HybridDrafter hybrid(std::move(model), 3, 2);
  CHECK(hybrid.name() == "mtp+ngram" && hybrid.needs_hidden());
  const mtp::Hidden two = hidden_rows(2);
  // The last 2 tokens (1, 2) occurred before: the lookup proposes what followed; the self head
  // takes in the verified rows (context[-2:] at position 5) and drafts nothing.
  CHECK((hybrid.propose({1, 2, 7, 8, 1, 2}, &two, 3, s).tokens == std::vector<int64_t>{7, 8, 1}));
  CHECK((positions == std::vector<int64_t>{4}) && (fed == std::vector<std::vector<int64_t>>{{1, 2}}));
  CHECK(hybrid.from_lookup() == 1);
  positions.clear(), fed.clear();
  // Only a 1-token match (min_match 2): the model drafts.
  CHECK((hybrid.propose({1, 2, 7, 8, 1, 3}, &two, 2, s).tokens == std::vector<int64_t>{10, 13}));
  CHECK((positions == std::vector<int64_t>{4, 6}) && hybrid.from_lookup() == 1);
  bool refused = false;
  try {
    mtp::HybridDrafter bad(std::make_unique<mtp::NgramDrafter>(), 1, 2);
  } catch (const mtp::UserError&) {
    refused = true;
  }
  CHECK(refused);
}

void test_accept_rules() {
  const int64_t V = 4;
  // Row i's argmax: 2, 3, 1.
  std::vector<float> logits = {0, 0, 5, 1, 0, 1, 0, 7, 0, 9, 0, 0};
  auto a = mtp::accept_greedy(logits.data(), V, {2, 3});
  CHECK(a.n == 2 && a.next_token == 1);
  a = mtp::accept_greedy(logits.data(), V, {2, 0});
  CHECK(a.n == 1 && a.next_token == 3);
  // top-p keeps the smallest head reaching p; top-k the k best.
  mtp::Sampler top_p({1.0, 0, 0.5, 0});
  std::vector<float> row = {3, 2, 1, 0};
  auto p = top_p.probs(row.data(), V);
  CHECK(p[0] == 1.0 && p[1] == 0.0);
  mtp::Sampler top_k({1.0, 2, 1.0, 0});
  p = top_k.probs(row.data(), V);
  CHECK(p[2] == 0.0 && p[3] == 0.0 && std::fabs(p[0] + p[1] - 1) < 1e-12);
  // Same seed, same samples; the empirical distribution matches p.
  mtp::Sampler one({1.0, 0, 1.0, 7}), two({1.0, 0, 1.0, 7});
  auto q = one.probs(row.data(), V);
  std::vector<int> counts(V);
  for (int i = 0; i < 20000; ++i) {
    const int64_t x = one.sample(q);
    CHECK(x == two.sample(q));
    ++counts[x];
  }
  for (int64_t v = 0; v < V; ++v) CHECK(std::fabs(counts[v] / 20000.0 - q[v]) < 0.015);
}

// Rejection sampling keeps the target's distribution: one-step speculative samples of the
// first emitted token, over many seeds, against p exactly.
void test_rejection_sampling_distribution() {
  const int64_t V = 4;
  std::vector<float> logits = {1.0f, 0.2f, -0.5f, 0.7f, 0.3f, 0.3f, 0.3f, 0.3f};
  std::vector<std::vector<double>> q = {{0.1, 0.6, 0.2, 0.1}};
  std::vector<int> counts(V);
  const int n = 40000;
  mtp::Sampler sampler({1.0, 0, 1.0, 3});
  auto p = sampler.probs(logits.data(), V);
  for (int i = 0; i < n; ++i) {
    const int64_t drafted = sampler.sample(q[0]);
    auto a = mtp::accept_sampling(logits.data(), V, {drafted}, q, sampler);
    ++counts[a.n == 1 ? drafted : a.next_token];
  }
  double chi2 = 0;
  for (int64_t v = 0; v < V; ++v) chi2 += std::pow(counts[v] - n * p[v], 2) / (n * p[v]);
  CHECK(chi2 < 16.3);  // chi-square, 3 degrees of freedom, p = 0.001
}

void test_loop_lossless() {
  int64_t drafted = 0, accepted = 0;
  for (int64_t max_seq : {40, 64}) {
    for (int64_t k : {1, 3, 5}) {
      for (bool adaptive : {false, true}) {
        mtp::GenerationConfig cfg;
        cfg.max_new_tokens = 50;
        cfg.k = k;
        cfg.adaptive_k = adaptive;
        cfg.eos_ids = {10};
        std::vector<int64_t> prompt = {1, 2, 3, 4, 1, 2, 3};
        FakeModel a(11, max_seq, 6), b(11, max_seq, 6), c(11, max_seq, 6);  // 2 prefill chunks
        auto plain = mtp::generate(a, prompt, nullptr, cfg);
        mtp::NgramDrafter ngram;
        auto spec = mtp::generate(b, prompt, &ngram, cfg);
        NoisyDrafter noisy;
        auto spec2 = mtp::generate(c, prompt, &noisy, cfg);
        FakeModel d(11, max_seq, 6);
        mtp::HybridDrafter hybrid(std::make_unique<NoisyDrafter>(), 3, 1);
        auto spec3 = mtp::generate(d, prompt, &hybrid, cfg);
        CHECK(plain.token_ids == spec.token_ids && plain.stop_reason == spec.stop_reason);
        CHECK(plain.token_ids == spec2.token_ids && plain.stop_reason == spec2.stop_reason);
        CHECK(plain.token_ids == spec3.token_ids && plain.stop_reason == spec3.stop_reason);
        CHECK(k == 0 || hybrid.from_lookup() > 0);
        drafted += spec2.stats.drafted_tokens;
        accepted += spec2.stats.accepted_tokens;
        CHECK(plain.stats.verify_steps == plain.stats.generated_tokens - 1 ||
              plain.stop_reason != "max_tokens");
        CHECK(plain.top2_gaps.size() == plain.token_ids.size());
      }
    }
  }
  CHECK(accepted > 0 && accepted < drafted);  // drafts were kept and rejected
  // A full context stops generation.
  FakeModel m(11, 12, 4);
  mtp::GenerationConfig cfg;
  cfg.max_new_tokens = 100;
  auto r = mtp::generate(m, {1, 2, 3, 4, 5, 6, 7, 8, 9}, nullptr, cfg);
  CHECK(r.stop_reason == "context_full" && r.token_ids.size() == 4);
  bool refused = false;
  try {
    mtp::generate(m, {}, nullptr, cfg);
  } catch (const mtp::UserError&) {
    refused = true;
  }
  CHECK(refused);
}

// Stop strings: plain and speculative decoding stop at the same token, the one completing the
// text; a stop string that never occurs changes nothing.
// A second turn that starts from a cache holding the first (a conversation): only the rest is
// prefilled, the drafter sees its rows, and the tokens equal those of a fresh prefill of the
// whole, plain and speculative. A token callback that says no stops generation.
void test_loop_cached_prefix() {
  mtp::GenerationConfig cfg;
  cfg.max_new_tokens = 12;
  cfg.k = 3;
  cfg.eos_ids = {10};
  const std::vector<int64_t> first = {1, 2, 3, 4, 1, 2, 3};
  for (const std::string kind : {"plain", "ngram", "noisy"}) {
    FakeModel kept(11, 64, 6), fresh(11, 64, 6);
    mtp::NgramDrafter ngram;
    NoisyDrafter noisy[3];
    auto drafter = [&](int i) -> mtp::Drafter* {
      return kind == "plain" ? nullptr : kind == "ngram" ? static_cast<mtp::Drafter*>(&ngram)
                                                         : &noisy[i];
    };
    const auto turn1 = mtp::generate(kept, first, drafter(0), cfg);
    std::vector<int64_t> second = first;
    second.insert(second.end(), turn1.token_ids.begin(), turn1.token_ids.end());
    second.insert(second.end(), {4, 1, 2, 3});
    const auto& cached = turn1.cached_tokens;
    CHECK(cached.size() + 1 >= first.size() + turn1.token_ids.size());
    CHECK(std::equal(cached.begin(), cached.end(), kept.cache.begin()));
    size_t shared = 0;
    while (shared < cached.size() && cached[shared] == second[shared]) ++shared;
    CHECK(shared + 1 >= first.size() + turn1.token_ids.size());
    noisy[1].prefilled = int64_t(second.size() - shared);
    const size_t calls = kept.starts.size();
    const auto turn2 = mtp::generate(kept, second, drafter(1), cfg, nullptr, nullptr,
                                     int64_t(shared));
    const auto whole = mtp::generate(fresh, second, drafter(2), cfg);
    CHECK(turn2.reused_tokens == int64_t(shared) && kept.starts[calls] == int64_t(shared));
    CHECK(turn2.token_ids == whole.token_ids && turn2.stop_reason == whole.stop_reason);
    CHECK(turn2.cached_tokens == whole.cached_tokens);
    CHECK(kind == "plain" || turn2.stats.accepted_tokens > 0);
  }
  // At least the last token is prefilled, whatever the cache holds: its logits start the answer.
  FakeModel m(11, 64, 6), n(11, 64, 6);
  const auto again = mtp::generate(m, first, nullptr, cfg);
  CHECK(mtp::generate(m, first, nullptr, cfg, nullptr, nullptr, 100).token_ids == again.token_ids);
  CHECK(m.starts.back() >= int64_t(first.size()) - 1);
  int seen = 0;
  mtp::NgramDrafter ngram;
  const auto stopped =
      mtp::generate(n, first, &ngram, cfg, nullptr, [&](int64_t) { return ++seen < 3; });
  CHECK(stopped.stop_reason == "stopped" && stopped.token_ids.size() == 3 && seen == 3);
  CHECK(std::equal(stopped.token_ids.begin(), stopped.token_ids.end(), again.token_ids.begin()));
}

void test_loop_stop_strings() {
  auto detokenize = [](const std::vector<int64_t>& ids) {
    std::string text;
    for (int64_t id : ids) text += char('a' + id);
    return text;
  };
  mtp::GenerationConfig cfg;
  cfg.max_new_tokens = 40;
  cfg.k = 4;
  const std::vector<int64_t> prompt = {1, 2, 3, 4, 1, 2, 3};
  FakeModel m0(11, 64, 6);
  const auto full = mtp::generate(m0, prompt, nullptr, cfg);
  const std::string text = detokenize(full.token_ids);
  CHECK(text.size() == 40);
  // One character per token: the stop string's first occurrence ends at token `end`, late
  // enough that the n-gram drafter hits before it (the fake model's output repeats).
  const std::string stop = text.substr(13, 14);
  const size_t end = text.find(stop) + stop.size();
  cfg.stop_strings = {"zzz", stop};
  for (int64_t k : {0, 2, 4}) {
    cfg.k = k;
    FakeModel a(11, 64, 6), b(11, 64, 6);
    mtp::NgramDrafter ngram;
    const auto plain = mtp::generate(a, prompt, nullptr, cfg, detokenize);
    const auto spec = mtp::generate(b, prompt, &ngram, cfg, detokenize);
    CHECK(plain.stop_reason == "stop_string" && spec.stop_reason == "stop_string");
    CHECK(plain.token_ids.size() == end && plain.token_ids == spec.token_ids);
    CHECK(std::equal(plain.token_ids.begin(), plain.token_ids.end(), full.token_ids.begin()));
    CHECK(k == 0 || spec.stats.verify_steps < plain.stats.verify_steps);  // drafts were kept
  }
  cfg.stop_strings = {"zzz"};
  FakeModel c(11, 64, 6);
  CHECK(mtp::generate(c, prompt, nullptr, cfg, detokenize).token_ids == full.token_ids);
  bool refused = false;
  try {
    FakeModel d(11, 64, 6);
    mtp::generate(d, prompt, nullptr, cfg);  // stop strings without detokenize
  } catch (const std::invalid_argument&) {
    refused = true;
  }
  CHECK(refused);
}

// Engine::drafter(options) on a real bundle: drafters by name, built once and kept (the
// engine's own under its options too); names the bundle cannot serve are refused with the
// names it takes.
void check_drafters_by_name(const char* bundle) {
  mtp::Engine engine(bundle, mtp::EngineOptions{});
  auto named = [](const std::string& name) {
    mtp::DrafterOptions options;
    options.drafter = name;
    return options;
  };
  CHECK(engine.drafter(mtp::DrafterOptions{}) == engine.drafter());
  CHECK(engine.drafter(named("none")) == nullptr);
  mtp::Drafter* ngram = engine.drafter(named("ngram"));
  CHECK(ngram != nullptr && ngram->name() == "ngram" && engine.drafter(named("ngram")) == ngram);
  mtp::DrafterOptions sizes = named("ngram");
  sizes.ngram_min = 2, sizes.ngram_sizes_given = true;
  CHECK(engine.drafter(sizes) != ngram && engine.drafter(sizes) == engine.drafter(sizes));
  const std::string own = engine.manifest().drafter_kind();
  auto refused = [&](const std::string& name, const std::string& why) {
    try {
      engine.drafter(named(name));
    } catch (const mtp::UserError& e) {
      const std::string message = e.what();
      return message.find(why) != std::string::npos &&
             message.find("takes none, ngram") != std::string::npos &&
             message.find('\n') == std::string::npos;
    }
    return false;
  };
  CHECK(refused("warp", "unknown drafter 'warp'"));
  CHECK(refused("ngram-3", "unknown drafter 'ngram-3'"));
  if (own != "mtp" && own != "draft-lm") return;
  mtp::Drafter* model = engine.drafter(named(own));
  CHECK(model != nullptr && model->name() == own &&
        engine.drafter(named(own + "+ngram")) == engine.drafter(named(own + "+ngram")));
  // Exactly the names mtp-run takes: no "bundle" (leaving the drafter unnamed means that).
  CHECK(refused("bundle", "unknown drafter 'bundle'"));
  CHECK(refused("bundle+ngram", "unknown drafter 'bundle'"));
  CHECK(engine.drafter(named(own + "+ngram"))->name() == own + "+ngram");
  CHECK(refused(own == "mtp" ? "draft-lm" : "mtp", "this bundle carries a '" + own + "'"));
  CHECK(refused("none+ngram", "name a model drafter before +ngram"));
}

// The C API on a real bundle: streamed pieces add up to the final text; errors come back as
// messages. Prints the result JSON for tests/test_native.py to compare with the Python runtime.
using Nexts = std::vector<std::pair<int64_t, int64_t>>;

// The store of past requests (runtime/answer_store.py's rules): counts, the confidence rule,
// the longest known context deciding, ties by insertion order, and eviction.
void test_answer_store_rules() {
  mtp::AnswerStore store;
  store.add({1, 2, 3, 4, 5}, 1);
  CHECK((store.nexts({1, 2, 3, 4}) == Nexts{{5, 1}}) && (store.nexts({4, 5}) == Nexts{}));
  CHECK(!store.next({1, 2, 3, 4}));  // seen once: below min_count 2
  store.add({1, 2, 3, 4, 5}, 1);
  CHECK(store.next({1, 2, 3, 4}) == 5 && store.next({9, 3, 4}) == 5);
  CHECK(store.next({4}) == std::nullopt);
  CHECK((store.draft({0, 1, 2}, 4) == std::vector<int64_t>{3, 4, 5}) && store.drafts() == 1);
  CHECK(store.draft({7, 7}, 4).empty() && store.draft({1, 2}, 0).empty() && store.drafts() == 1);
  CHECK(store.tokens() == 10 && store.requests() == 2);
  // (7, 8) followed by 9 twice and 10 twice: a tie at share 0.5, confident, the first seen.
  mtp::AnswerStore ties;
  for (int64_t next : {9, 10, 10, 9}) ties.add({7, 8, next}, 1);
  CHECK((ties.nexts({7, 8}) == Nexts{{9, 2}, {10, 2}}) && ties.next({7, 8}) == 9);
  ties.add({7, 8, 10}, 1);  // 3 of 5
  CHECK(ties.next({7, 8}) == 10);
  for (int i = 0; i < 3; ++i) ties.add({7, 8, 11}, 1);  // 2, 3, 3 of 8: the best below half
  CHECK(!ties.next({7, 8}));
  // The longest known context decides even when it is not confident: (1, 7, 8) is known (once
  // followed by 12), so the confident (7, 8) -> ... is not asked.
  ties.add({1, 7, 8, 12}, 1);
  for (int i = 0; i < 6; ++i) ties.add({7, 8, 10}, 1);
  CHECK(ties.next({5, 7, 8}) == 10 && !ties.next({1, 7, 8}));

  // A next token whose count falls to 0 is deleted; re-added, it goes last (Python dict order).
  mtp::AnswerStore small(6);
  small.add({5, 6, 1}, 1);
  small.add({5, 6, 2}, 1);
  CHECK((small.nexts({5, 6}) == Nexts{{1, 1}, {2, 1}}));
  small.add({5, 6, 2}, 1);  // 9 tokens: the first request goes, and 1 with it
  CHECK((small.nexts({5, 6}) == Nexts{{2, 2}}) && small.requests() == 2 && small.tokens() == 6);
  small.add({5, 6, 1}, 1);
  CHECK((small.nexts({5, 6}) == Nexts{{2, 1}, {1, 1}}));
  // So eviction keeps the order of a token's first arrival among what is kept: 1 came first
  // (in a request since evicted) and stays ahead of 2 in a tie, where a store rebuilt from the
  // kept requests has 2 first. Counts are the rebuilt store's.
  mtp::AnswerStore evicted(15), rebuilt(15);
  const std::vector<std::vector<int64_t>> requests = {
      {5, 6, 1}, {5, 6, 2}, {5, 6, 2}, {5, 6, 1}, {5, 6, 1}, {7, 7, 7}};
  for (const auto& r : requests) evicted.add(r, 1);
  for (size_t i = 1; i < requests.size(); ++i) rebuilt.add(requests[i], 1);
  CHECK(evicted.requests() == 5 && evicted.tokens() == 15);
  CHECK((evicted.nexts({5, 6}) == Nexts{{1, 2}, {2, 2}}) && evicted.next({5, 6}) == 1);
  CHECK((rebuilt.nexts({5, 6}) == Nexts{{2, 2}, {1, 2}}) && rebuilt.next({5, 6}) == 2);
  // A request longer than the bound keeps its last max_tokens tokens, alone.
  mtp::AnswerStore bounded(4);
  bounded.add({1, 2}, 1);
  bounded.add({9, 8, 7, 6, 5, 4}, 1);
  CHECK(bounded.requests() == 1 && bounded.tokens() == 4);
  CHECK((bounded.nexts({7, 6}) == Nexts{{5, 1}}));
  bool refused = false;
  try {
    mtp::AnswerStore bad(0);
  } catch (const mtp::UserError&) {
    refused = true;
  }
  CHECK(refused);
}

// Eviction takes back exactly what a request added: after many random requests (few distinct
// tokens, so contexts repeat), the kept counts equal those of a store fed only the kept ones.
void test_answer_store_eviction_is_exact() {
  std::mt19937_64 rng(7);
  mtp::AnswerStore store(300);
  std::vector<std::vector<int64_t>> all;
  for (int r = 0; r < 200; ++r) {
    std::vector<int64_t> tokens(5 + rng() % 40);
    for (auto& t : tokens) t = int64_t(rng() % 6);
    store.add(tokens, 1);
    all.push_back(tokens);
  }
  mtp::AnswerStore kept(300);
  for (size_t i = all.size() - size_t(store.requests()); i < all.size(); ++i) kept.add(all[i], 1);
  CHECK(store.tokens() == kept.tokens() && store.tokens() <= 300 && store.requests() < 200);
  CHECK(store.contexts() == kept.contexts());
  auto sorted = [](Nexts n) {
    std::sort(n.begin(), n.end());
    return n;
  };
  for (int64_t a = 0; a < 6; ++a)
    for (int64_t b = 0; b < 6; ++b)
      for (int64_t c = 0; c < 6; ++c) {
        CHECK(sorted(store.nexts({a, b})) == sorted(kept.nexts({a, b})));
        for (int64_t d = 0; d < 6; ++d)
          CHECK(sorted(store.nexts({a, b, c, d})) == sorted(kept.nexts({a, b, c, d})));
      }
}

// A drafter proposing fixed tokens (with a distribution per token when `probs`).
class FixedDrafter : public mtp::Drafter {
 public:
  FixedDrafter(std::vector<int64_t> tokens, bool probs, size_t vocab = 16)
      : tokens_(std::move(tokens)), probs_(probs), vocab_(vocab) {}
  std::string name() const override { return "fixed"; }
  mtp::Draft propose(const std::vector<int64_t>&, const mtp::Hidden*, int64_t k,
                     mtp::Sampler&) override {
    mtp::Draft d;
    for (int64_t i = 0; i < std::min<int64_t>(k, int64_t(tokens_.size())); ++i) {
      d.tokens.push_back(tokens_[i]);
      if (probs_) d.probs.push_back(std::vector<double>(vocab_, 1.0 / double(vocab_)));
    }
    return d;
  }

 private:
  std::vector<int64_t> tokens_;
  bool probs_;
  size_t vocab_;
};

// A chat's next request (a prompt that is the last prompt and more) counts only the positions
// past what it shares with the last request; separate requests, alike or not, count whole.
void test_answer_store_counts_a_conversation_once() {
  const std::vector<int64_t> turn = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};  // 6 prompt tokens
  const std::vector<int64_t> next = {1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 15};
  mtp::AnswerStore chat;
  chat.add(turn, 6);
  chat.add(next, 12);  // shares 9 tokens: kept from 5 (4 tokens of context), counted from 9
  CHECK(chat.tokens() == 10 + 14 - 5 && chat.requests() == 2);
  CHECK(chat.sequences().back().first == 4);
  CHECK((chat.nexts({1, 2, 3, 4}) == Nexts{{5, 1}}));   // the first turn's, counted once
  CHECK((chat.nexts({6, 7, 8, 9}) == Nexts{{10, 1}, {11, 1}}));  // the new position
  mtp::AnswerStore twice;
  twice.add(turn, 6);
  twice.add(turn, 6);  // the same request again is another request
  CHECK((twice.nexts({1, 2, 3, 4}) == Nexts{{5, 2}}));
  mtp::AnswerStore other;
  other.add(turn, 6);
  other.add({1, 2, 3, 4, 5, 99, 7, 8, 9, 10, 11}, 7);  // another prompt: counted whole
  CHECK((other.nexts({1, 2, 3, 4}) == Nexts{{5, 2}}));
}

// The store extends a draft only where the inner drafter stopped short of k, from the context
// and the inner draft; under sampling its tokens get one-hot rows beside the inner rows.
void test_store_drafter() {
  mtp::Sampler s({});
  mtp::AnswerStore store;
  for (int i = 0; i < 2; ++i) store.add({1, 2, 3, 4, 5, 6, 7}, 1);
  FixedDrafter head({3, 9}, false);
  mtp::StoreDrafter drafter(&head, &store);
  CHECK(drafter.name() == "fixed");
  CHECK((drafter.propose({0, 1, 2}, nullptr, 1, s).tokens == std::vector<int64_t>{3}));
  CHECK((drafter.propose({0, 1, 2}, nullptr, 2, s).tokens == std::vector<int64_t>{3, 9}));
  CHECK(drafter.extended() == 0);
  FixedDrafter short_head({3}, true);
  mtp::StoreDrafter sampled(&short_head, &store);
  const mtp::Draft d = sampled.propose({0, 1, 2}, nullptr, 4, s);
  CHECK((d.tokens == std::vector<int64_t>{3, 4, 5, 6}) && d.probs.size() == 4);
  for (size_t i = 1; i < d.probs.size(); ++i)
    CHECK(d.probs[i].size() == 16 && d.probs[i][d.tokens[i]] == 1.0 &&
          std::accumulate(d.probs[i].begin(), d.probs[i].end(), 0.0) == 1.0);
  CHECK(sampled.extended() == 1 && store.drafts() == 1);
  FixedDrafter none({}, true);  // nothing from the head: the store's tokens alone, all one-hot
  mtp::StoreDrafter alone(&none, &store);
  const mtp::Draft e = alone.propose({9, 4, 5}, nullptr, 3, s);
  CHECK((e.tokens == std::vector<int64_t>{6, 7}) && e.probs.empty());
  // Lossless on the fake target: greedy with the store (fed the plain answers) is plain.
  mtp::GenerationConfig cfg;
  cfg.max_new_tokens = 30;
  cfg.k = 4;
  const std::vector<int64_t> prompt = {1, 2, 3, 4, 1, 2, 3};
  FakeModel a(11, 64, 6);
  const auto plain = mtp::generate(a, prompt, nullptr, cfg);
  mtp::AnswerStore learnt;
  int64_t accepted = 0;
  for (int turn = 0; turn < 3; ++turn) {
    FakeModel b(11, 64, 6);
    NoisyDrafter noisy;
    FixedDrafter stops({}, false);
    mtp::StoreDrafter with_store(turn % 2 ? static_cast<mtp::Drafter*>(&noisy) : &stops, &learnt);
    const auto spec = mtp::generate(b, prompt, &with_store, cfg);
    CHECK(spec.token_ids == plain.token_ids && spec.stop_reason == plain.stop_reason);
    if (turn == 2) accepted = spec.stats.accepted_tokens;
    std::vector<int64_t> request = prompt;
    request.insert(request.end(), spec.token_ids.begin(), spec.token_ids.end());
    learnt.add(request, int64_t(prompt.size()));
  }
  CHECK(accepted > 0);  // the third run drafted the answer the first two gave
  // Sampling: a head drafting one token with its distribution, the store going on with one-hot
  // rows, through rejection sampling (rows missing would read past the draft's probs).
  mtp::GenerationConfig sampling = cfg;
  sampling.sampling.temperature = 0.5;
  sampling.sampling.seed = 11;
  FixedDrafter one({4}, true, 11);
  mtp::StoreDrafter sampled_store(&one, &learnt);
  FakeModel c(11, 64, 6);
  const auto sampled_run = mtp::generate(c, prompt, &sampled_store, sampling);
  CHECK(sampled_run.stats.generated_tokens == 30 && sampled_store.extended() > 0);
  CHECK(sampled_run.stats.drafted_tokens > sampled_run.stats.drafted_steps);
}

// `store FILE`: an AnswerStore driven by FILE's JSON lines, for tests/test_native.py to compare
// with runtime/answer_store.py: {"max_tokens": N} first, then {"add": [ids], "prompt": n} (a
// request's tokens, the first n its prompt) or {"draft": [context ids], "k": K}, which prints the drafted ids as a JSON list; at
// the end one line with the store's report.
int run_store(const char* path) {
  std::ifstream in(path);
  std::string line;
  if (!std::getline(in, line)) return 2;
  mtp::AnswerStore store(nlohmann::json::parse(line).at("max_tokens").get<int64_t>());
  while (std::getline(in, line)) {
    const nlohmann::json row = nlohmann::json::parse(line);
    if (row.contains("add"))
      store.add(row["add"].get<std::vector<int64_t>>(), row.at("prompt").get<int64_t>());
    else
      std::printf("%s\n", nlohmann::json(store.draft(row.at("draft").get<std::vector<int64_t>>(),
                                                     row.at("k").get<int64_t>()))
                              .dump()
                              .c_str());
  }
  std::printf("%s\n", mtp::store_json(store).dump().c_str());
  return 0;
}

int run_c_api(const char* bundle, const char* prompt, const char* options) {
  char err[512] = "";
  CHECK(mtp_open("/nonexistent", err, sizeof err) == nullptr && std::strlen(err) > 0);
  mtp_engine* engine = mtp_open(bundle, err, sizeof err);
  if (engine == nullptr) {
    std::fprintf(stderr, "mtp_open: %s\n", err);
    return 1;
  }
  std::string streamed;
  auto on_text = [](const char* piece, void* user) { *static_cast<std::string*>(user) += piece; };
  std::vector<char> result(1 << 20);
  int rc = mtp_generate(engine, prompt, options, on_text, &streamed, result.data(), result.size(),
                        err, sizeof err);
  if (rc != 0) {
    std::fprintf(stderr, "mtp_generate: %s\n", err);
    mtp_close(engine);
    return 1;
  }
  const std::string json = result.data();
  CHECK(mtp_generate(engine, prompt, "{not json", nullptr, nullptr, result.data(), result.size(),
                     err, sizeof err) != 0);
  CHECK(mtp_generate(engine, prompt, R"({"stop_strings": [""]})", nullptr, nullptr,
                     result.data(), result.size(), err, sizeof err) != 0 &&
        std::strstr(err, "stop_strings") != nullptr);
  // A drafter by a name no bundle serves: one line that lists the names this one takes.
  CHECK(mtp_generate(engine, prompt, R"({"drafter": "warp"})", nullptr, nullptr, result.data(),
                     result.size(), err, sizeof err) != 0 &&
        std::strstr(err, "unknown drafter 'warp'") != nullptr &&
        std::strstr(err, "none, ngram") != nullptr && std::strchr(err, '\n') == nullptr);
  for (const char* bad : {R"({"drafter": 3})", R"({"ngram_sizes": "3-x"})",
                          R"({"draft_confidence": 1.5})"}) {
    err[0] = '\0';
    CHECK(mtp_generate(engine, prompt, bad, nullptr, nullptr, result.data(), result.size(), err,
                       sizeof err) != 0 &&
          std::strlen(err) > 0);
  }
  mtp_close(engine);
  check_drafters_by_name(bundle);
  std::printf("%s\n%s\n", json.c_str(), streamed.c_str());
  return failures ? 1 : 0;
}

// One answer of a chat through the C API: its result JSON (empty with the reason in `err` on
// failure). `stop_after` > 0: the token callback says stop after that many tokens.
nlohmann::json chat_answer(mtp_chat* chat, const std::string& options, int stop_after,
                           std::string* err = nullptr) {
  struct Seen {
    int tokens = 0, stop_after = 0;
    std::string text;
  } seen{0, stop_after, {}};
  auto on_token = [](int32_t, const char* piece, void* user) {
    auto& s = *static_cast<Seen*>(user);
    s.text += piece;
    return ++s.tokens == s.stop_after ? MTP_STOP : MTP_CONTINUE;
  };
  std::vector<char> result(1 << 20);
  char message[512] = "";
  if (mtp_chat_generate(chat, options.c_str(), on_token, &seen, result.data(), result.size(),
                        message, sizeof message) != MTP_OK) {
    if (err != nullptr) *err = message;
    return {};
  }
  nlohmann::json out = nlohmann::json::parse(result.data());
  CHECK(int(out["token_ids"].size()) == seen.tokens);
  out["streamed"] = seen.text;
  return out;
}

// The chat C API on a real bundle: two engines hold the same conversation, one reusing the
// cache between turns, the other prefilling the whole conversation every turn; their answers
// must be the same tokens, plain and speculative. Then the stop callback, reset, a system
// prompt and a full context. Prints one JSON line per answer for tests/test_android_demo.py.
int run_chat(const char* bundle) {
  char err[512] = "";
  mtp_engine* reusing = mtp_open(bundle, err, sizeof err);
  mtp_engine* fresh = mtp_open(bundle, err, sizeof err);
  if (reusing == nullptr || fresh == nullptr) {
    std::fprintf(stderr, "mtp_open: %s\n", err);
    return 1;
  }
  mtp_chat* chat = mtp_chat_create(reusing, nullptr, err, sizeof err);
  mtp_chat* whole = mtp_chat_create(fresh, "", err, sizeof err);
  const std::vector<std::string> turns = {"the cat sat on the mat", "and then? the cat",
                                          "hi, hi, hi, hi"};
  auto print = [](const std::string& what, const nlohmann::json& result) {
    std::printf("%s\n", nlohmann::json{{"what", what}, {"result", result}}.dump().c_str());
  };
  std::vector<int64_t> first_plain;
  for (const bool speculative : {false, true}) {
    mtp_chat_reset(chat);
    mtp_chat_reset(whole);
    const std::string options = std::string(R"({"max_new_tokens": 16, "temperature": 0, )") +
                                R"("speculative": )" + (speculative ? "true" : "false");
    for (const std::string& text : turns) {
      CHECK(mtp_chat_add_user(chat, text.c_str(), err, sizeof err) == MTP_OK);
      CHECK(mtp_chat_add_user(whole, text.c_str(), err, sizeof err) == MTP_OK);
      const nlohmann::json kept = chat_answer(chat, options + "}", 0);
      const nlohmann::json prefilled =
          chat_answer(whole, options + R"(, "reuse_cache": false})", 0);
      CHECK(!kept.empty() && !prefilled.empty());
      CHECK(kept["token_ids"] == prefilled["token_ids"]);
      CHECK(kept["prompt_tokens"] == prefilled["prompt_tokens"]);
      CHECK(prefilled["reused_tokens"] == 0);
      CHECK(kept["streamed"] == kept["text"]);
      if (first_plain.empty()) first_plain = kept["token_ids"].get<std::vector<int64_t>>();
      print(speculative ? "speculative" : "plain", kept);
    }
  }
  // The stop callback ends an answer after two tokens; the conversation goes on from there.
  mtp_chat_reset(chat);
  CHECK(mtp_chat_add_user(chat, turns[0].c_str(), err, sizeof err) == MTP_OK);
  print("stopped", chat_answer(chat, R"({"max_new_tokens": 16})", 2));
  CHECK(mtp_chat_add_user(chat, turns[1].c_str(), err, sizeof err) == MTP_OK);
  print("after stop", chat_answer(chat, R"({"max_new_tokens": 16})", 0));
  // Reset: the first turn again gives the first answer again.
  mtp_chat_reset(chat);
  CHECK(mtp_chat_add_user(chat, turns[0].c_str(), err, sizeof err) == MTP_OK);
  const nlohmann::json again =
      chat_answer(chat, R"({"max_new_tokens": 16, "speculative": false})", 0);
  CHECK(again["token_ids"].get<std::vector<int64_t>>() == first_plain);
  print("after reset", again);
  std::vector<char> last(1 << 20);
  CHECK(mtp_chat_last_stats(chat, last.data(), last.size(), err, sizeof err) == MTP_OK);
  CHECK(nlohmann::json::parse(last.data())["token_ids"] == again["token_ids"]);
  // A user turn twice, an answer to no turn: errors, the conversation unchanged.
  CHECK(mtp_chat_add_user(chat, "one", err, sizeof err) == MTP_OK);
  CHECK(mtp_chat_add_user(chat, "two", err, sizeof err) == MTP_ERROR &&
        std::strstr(err, "no answer yet") != nullptr);
  std::string why;
  CHECK(!chat_answer(chat, R"({"max_new_tokens": 2})", 0).empty());
  CHECK(chat_answer(chat, "{}", 0, &why).empty() && why.find("add one first") != std::string::npos);
  // Turns until the context is full: a clear code and message, and the conversation still
  // usable after a reset.
  const std::string long_turn(60, 'a');
  int added = 0, status;
  while ((status = mtp_chat_add_user(chat, (long_turn + " " + std::to_string(added)).c_str(), err,
                                     sizeof err)) == MTP_OK) {
    ++added;
    CHECK(!chat_answer(chat, R"({"max_new_tokens": 4})", 0).empty());
  }
  CHECK(status == MTP_CONTEXT_FULL);
  print("context full", {{"message", err}, {"turns", added}});
  CHECK(chat_answer(chat, "{}", 0, &why).empty());
  mtp_chat_reset(chat);
  CHECK(mtp_chat_add_user(chat, turns[0].c_str(), err, sizeof err) == MTP_OK);
  CHECK(chat_answer(chat, R"({"speculative": false, "max_new_tokens": 16})", 0)["token_ids"]
            .get<std::vector<int64_t>>() == first_plain);
  // A system prompt of the user's own replaces the template's default.
  mtp_chat* system = mtp_chat_create(reusing, "You answer briefly.", err, sizeof err);
  CHECK(system != nullptr);
  if (system != nullptr) {
    CHECK(mtp_chat_add_user(system, turns[0].c_str(), err, sizeof err) == MTP_OK);
    print("system", chat_answer(system, R"({"max_new_tokens": 4})", 0));
  }
  mtp_chat_free(system);
  mtp_chat_free(chat);
  mtp_chat_free(whole);
  mtp_close(reusing);
  mtp_close(fresh);
  return failures ? 1 : 0;
}

// `store-api BUNDLE PROMPT`: the C API's "store" option on a real bundle. Greedy generations of
// one prompt, plain and then three times drafting also from the engine's store (the MTP head
// stopping below confidence 0.5, where the store goes on): the same tokens every time, the
// store holding each request (prompt and answer) once it ended, and the third drafting from
// the first two; then a sampled one, a chat answer (the conversation and its answer go in),
// and a bad value refused. Prints each result JSON on a line, for tests/test_native.py.
int run_store_api(const char* bundle, const char* prompt) {
  char err[512] = "";
  mtp_engine* engine = mtp_open(bundle, err, sizeof err);
  if (engine == nullptr) {
    std::fprintf(stderr, "mtp_open: %s\n", err);
    return 1;
  }
  std::vector<char> buffer(1 << 20);
  auto generate = [&](const std::string& options) -> nlohmann::json {
    if (mtp_generate(engine, prompt, options.c_str(), nullptr, nullptr, buffer.data(),
                     buffer.size(), err, sizeof err) != MTP_OK) {
      std::fprintf(stderr, "mtp_generate: %s\n", err);
      return {};
    }
    nlohmann::json out = nlohmann::json::parse(buffer.data());
    std::printf("%s\n", out.dump().c_str());
    return out;
  };
  const std::string base = R"("max_new_tokens": 24, "k": 4, "draft_confidence": 0.5)";
  const nlohmann::json plain = generate("{" + base + R"(, "speculative": false})");
  CHECK(!plain.empty() && !plain.contains("store_tokens"));
  const int64_t request =
      plain["prompt_tokens"].get<int64_t>() + int64_t(plain["token_ids"].size());
  for (int64_t i = 1; i <= 3; ++i) {
    const nlohmann::json stored = generate("{" + base + R"(, "store": true})");
    CHECK(!stored.empty() && stored["token_ids"] == plain["token_ids"]);
    CHECK(stored["store_requests"] == i && stored["store_tokens"] == i * request);
    if (i == 1) CHECK(stored["store_extended"] == 0 && stored["store_drafts"] == 0);
    if (i == 3) CHECK(stored["store_extended"] > 0);
  }
  const nlohmann::json sampled =
      generate("{" + base + R"(, "store": true, "temperature": 0.3, "seed": 3})");
  CHECK(!sampled.empty() && sampled["store_requests"] == 4);
  mtp_chat* chat = mtp_chat_create(engine, nullptr, err, sizeof err);
  CHECK(chat != nullptr && mtp_chat_add_user(chat, prompt, err, sizeof err) == MTP_OK);
  if (chat != nullptr) {
    const std::string options = "{" + base + R"(, "store": true})";
    CHECK(mtp_chat_generate(chat, options.c_str(), nullptr, nullptr, buffer.data(), buffer.size(),
                            err, sizeof err) == MTP_OK);
    const nlohmann::json answer = nlohmann::json::parse(buffer.data());
    std::printf("%s\n", answer.dump().c_str());
    CHECK(answer["store_requests"] == 5);
    CHECK(answer["store_tokens"].get<int64_t>() ==
          sampled["store_tokens"].get<int64_t>() + answer["context_tokens"].get<int64_t>());
  }
  mtp_chat_free(chat);
  CHECK(mtp_generate(engine, prompt, R"({"store": 1})", nullptr, nullptr, buffer.data(),
                     buffer.size(), err, sizeof err) == MTP_ERROR &&
        std::string(err) == "store must be true or false");
  mtp_close(engine);
  return failures ? 1 : 0;
}

// `store-log BUNDLE LOG`: the requests Engine::seed_store takes from a request log, as JSON: the
// records added and each kept request's [ids, first counted index], oldest first (tests/test_native.py compares them
// with what mtp_edge/api.py _seed_store gives the Python store).
int run_store_log(const char* bundle, const char* log) {
  try {
    mtp::Engine engine(bundle, mtp::EngineOptions{});
    const int64_t added = engine.seed_store(log);
    nlohmann::json sequences = nlohmann::json::array();
    for (const auto& s : engine.store().sequences()) sequences.push_back({s.tokens, s.first});
    std::printf("%s\n", nlohmann::json{{"added", added}, {"sequences", sequences}}.dump().c_str());
    return 0;
  } catch (const mtp::UserError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}

// `request-log BUNDLE DIR`: the C API's request log on a real bundle. One generation before
// any log (nothing may appear in DIR), then a log with small bounds (1 KiB files, one kept):
// prompts with and without the chat format and a two-turn chat with a system prompt, each
// result on a line as {"what", "result"}; bad options refused; then a second engine on the same
// folder, whose store is seeded from it. Lines for tests/test_native.py to compare with what
// Python reads in DIR.
int run_request_log(const char* bundle, const char* dir) {
  char err[512] = "";
  std::vector<char> buffer(1 << 20);
  auto print = [](const char* what, const nlohmann::json& result) {
    std::printf("%s\n", nlohmann::json{{"what", what}, {"result", result}}.dump().c_str());
  };
  auto open = [&]() {
    mtp_engine* engine = mtp_open(bundle, err, sizeof err);
    if (engine == nullptr) std::fprintf(stderr, "mtp_open: %s\n", err);
    return engine;
  };
  auto generate = [&](mtp_engine* engine, const char* what, const char* prompt,
                      const std::string& options) {
    if (mtp_generate(engine, prompt, options.c_str(), nullptr, nullptr, buffer.data(),
                     buffer.size(), err, sizeof err) != MTP_OK) {
      std::fprintf(stderr, "mtp_generate: %s\n", err);
      ++failures;
      return;
    }
    print(what, nlohmann::json::parse(buffer.data()));
  };
  auto request_log = [&](mtp_engine* engine, const char* where, const char* options) {
    const int code = mtp_request_log(engine, where, options, buffer.data(), buffer.size(), err,
                                     sizeof err);
    return code == MTP_OK ? nlohmann::json::parse(buffer.data()) : nlohmann::json(err);
  };
  mtp_engine* engine = open();
  if (engine == nullptr) return 1;
  generate(engine, "before", "the cat sat", R"({"max_new_tokens": 8})");
  CHECK(!std::filesystem::exists(dir));
  print("bad keep", request_log(engine, dir, R"({"keep": "one"})"));
  print("bad option", request_log(engine, dir, R"({"files": 3})"));
  const std::string file = std::string(dir) + ".file";
  { std::ofstream(file) << "x"; }
  print("not a folder", request_log(engine, file.c_str(), nullptr));
  CHECK(!std::filesystem::exists(dir));
  print("opened", request_log(engine, dir, R"({"file_bytes": 1024, "keep": 1})"));
  const std::string options = R"({"max_new_tokens": 12, "store": true})";
  generate(engine, "chat", "the cat sat on the mat", options);
  generate(engine, "raw", "hi, hi, hi, hi", R"({"max_new_tokens": 12, "chat": false})");
  mtp_chat* chat = mtp_chat_create(engine, "You answer briefly.", err, sizeof err);
  CHECK(chat != nullptr);
  for (const char* turn : {"the cat sat on the mat", "and then? é 🤗"}) {
    if (chat == nullptr || mtp_chat_add_user(chat, turn, err, sizeof err) != MTP_OK ||
        mtp_chat_generate(chat, options.c_str(), nullptr, nullptr, buffer.data(), buffer.size(),
                          err, sizeof err) != MTP_OK) {
      std::fprintf(stderr, "chat: %s\n", err);
      ++failures;
      continue;
    }
    print("turn", nlohmann::json::parse(buffer.data()));
  }
  mtp_chat_free(chat);
  for (int i = 0; i < 6; ++i)  // past 1 KiB: the log rotates, the oldest file goes
    generate(engine, "more", "one two three four five", options);
  print("stopped", request_log(engine, "", nullptr));
  generate(engine, "after", "the cat sat", R"({"max_new_tokens": 8})");
  mtp_close(engine);
  mtp_engine* second = open();
  if (second == nullptr) return 1;
  print("seeded", request_log(second, dir, nullptr));
  mtp_close(second);
  return failures ? 1 : 0;
}

}  // namespace

// No arguments: the unit tests. BUNDLE PROMPT OPTIONS_JSON: the C API on that bundle.
// chat BUNDLE: the chat C API on that bundle. store FILE: an AnswerStore driven by FILE.
// store-api BUNDLE PROMPT: the C API's store on that bundle. store-log BUNDLE LOG: the requests
// a request log seeds the store with. request-log BUNDLE DIR: the C API's request log.
int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "store-api") return run_store_api(argv[2], argv[3]);
  if (argc == 4 && std::string(argv[1]) == "store-log") return run_store_log(argv[2], argv[3]);
  if (argc == 4 && std::string(argv[1]) == "request-log")
    return run_request_log(argv[2], argv[3]);
  if (argc == 4) return run_c_api(argv[1], argv[2], argv[3]);
  if (argc == 3 && std::string(argv[1]) == "chat") return run_chat(argv[2]);
  if (argc == 3 && std::string(argv[1]) == "store") return run_store(argv[2]);
  test_sha256();
  test_ngram();
  test_mtp_positions_and_cache_end();
  test_mtp_self_head_feeds_the_verified_rows();
  test_hybrid_drafter();
  test_accept_rules();
  test_rejection_sampling_distribution();
  test_loop_lossless();
  test_loop_stop_strings();
  test_loop_cached_prefix();
  test_fallback_decisions();
  test_loop_fallback_and_observe();
  test_token_id_check();
  test_answer_store_rules();
  test_answer_store_eviction_is_exact();
  test_answer_store_counts_a_conversation_once();
  test_store_drafter();
  if (failures) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("all native core tests passed\n");
  return 0;
}
