// Drafting from a deployment's own past requests: runtime/answer_store.py in C++, and the
// drafter that lets it extend another drafter's drafts (runtime/adapt.py AdaptingDrafter).
//
// Requests to one deployment resemble each other (the same kinds of questions, the same
// phrasing and code in the answers), and prompt lookup sees only the request at hand. The store
// keeps the token sequences of the last requests (prompt and answer) and, for each context of
// 4, 3 or 2 tokens in them, how often each next token followed. A draft continues the context
// with the most frequent next token of its longest known context, for as long as that token
// followed at least min_count times and in at least min_share of the cases. Drafts are
// deterministic, so verification treats them as one-hot proposals: greedy output stays that of
// plain decoding and sampling keeps the target's distribution.
//
// The same drafts as the Python store, ties included: Python's max() over a dict returns the
// first of equal counts in insertion order, and a next token whose count falls to 0 is deleted
// (re-added later, it goes to the end); here each context keeps its next tokens in a vector in
// insertion order, appended when new and erased at 0. Bounded: past max_tokens the oldest
// requests are dropped and their counts taken back, exactly. A chat's next request (its prompt
// the last request's prompt and more) counts only the positions past what it shares with the
// last request's tokens: the conversation is counted once, as in Python.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "drafters.h"

namespace mtp {

class AnswerStore {
 public:
  static constexpr int kOrders[] = {4, 3, 2};  // context lengths, longest first
  static constexpr int64_t kMaxTokens = 32768;
  static constexpr int64_t kMinCount = 2;
  static constexpr double kMinShare = 0.5;

  // Throws UserError unless max_tokens >= 1 and min_count >= 1.
  explicit AnswerStore(int64_t max_tokens = kMaxTokens, int64_t min_count = kMinCount,
                       double min_share = kMinShare);

  // One request's tokens (its prompt, the first prompt_len, and its answer; its last
  // max_tokens at most), counted past the last request where it continues that conversation;
  // then the oldest requests dropped while the store holds more than max_tokens.
  void add(const std::vector<int64_t>& tokens, int64_t prompt_len);
  // The confident next token after `context`, from its longest context the store knows (a
  // known context that is not confident ends the search: shorter ones are not asked).
  std::optional<int64_t> next(const std::vector<int64_t>& context) const;
  // Up to k tokens continuing `context`, each the confident next token of the context so far.
  std::vector<int64_t> draft(const std::vector<int64_t>& context, int64_t k);

  int64_t tokens() const { return tokens_; }  // in the kept requests
  int64_t requests() const { return int64_t(sequences_.size()); }
  int64_t drafts() const { return drafts_; }  // drafts of at least one token made
  // The kept requests, oldest first: tokens, and the index from which their next tokens were
  // counted (past the part a continued conversation shared with the request before).
  struct Sequence {
    std::vector<int64_t> tokens;
    int64_t first = 0;
  };
  const std::deque<Sequence>& sequences() const { return sequences_; }
  // The contexts known, per order (kOrders' order): what eviction must leave as a store
  // rebuilt from the kept requests would have them.
  std::vector<size_t> contexts() const;
  // (next token, count) in insertion order for a context of 2..4 tokens; empty if unknown.
  std::vector<std::pair<int64_t, int64_t>> nexts(const std::vector<int64_t>& context) const;

 private:
  using Key = std::array<int64_t, 4>;  // the context's tokens, unused slots 0
  struct KeyHash {
    size_t operator()(const Key& key) const;
  };
  using Nexts = std::vector<std::pair<int64_t, int64_t>>;  // (token, count), insertion order
  using Table = std::unordered_map<Key, Nexts, KeyHash>;

  void count(const Sequence& sequence, int64_t sign);
  static Key key_of(const int64_t* context, int n);
  const Nexts* find(const std::vector<int64_t>& context, size_t order_index) const;

  int64_t max_tokens_, min_count_;
  double min_share_;
  std::array<Table, 3> tables_;  // per order of kOrders
  std::deque<Sequence> sequences_;
  int64_t tokens_ = 0, drafts_ = 0;
  std::vector<int64_t> last_;  // the last request's tokens, whole
  int64_t last_prompt_ = 0;    // how many of them were its prompt
};

// Drafts with `inner`, then where its draft is shorter than k lets the store go on from the
// context and the inner draft (runtime/adapt.py AdaptingDrafter.propose): the inner drafter
// keeps the positions it is confident of, the store fills those it stopped short of. Under
// sampling the store's tokens get one-hot rows when the inner draft has a distribution per
// token, so that rejection sampling stays exact. Takes the inner drafter's name, hidden states
// and sources; owns neither the drafter nor the store. The engine puts it around the model
// drafter, inside a hybrid's lookup (DrafterOptions::store).
class StoreDrafter : public ForwardingDrafter {
 public:
  StoreDrafter(Drafter* inner, AnswerStore* store) : ForwardingDrafter(inner), store_(store) {}
  Draft propose(const std::vector<int64_t>& context, const Hidden* hidden, int64_t k,
                Sampler& sampler) override;
  int64_t extended() const { return extended_; }  // drafts the store added tokens to

 private:
  AnswerStore* store_;
  int64_t extended_ = 0;
};

}  // namespace mtp
