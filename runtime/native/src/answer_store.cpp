#include "answer_store.h"

#include <algorithm>

#include "errors.h"

namespace mtp {

AnswerStore::AnswerStore(int64_t max_tokens, int64_t min_count, double min_share)
    : max_tokens_(max_tokens), min_count_(min_count), min_share_(min_share) {
  if (max_tokens < 1) throw UserError("the store of past requests needs max_tokens >= 1");
  if (min_count < 1) throw UserError("the store of past requests needs min_count >= 1");
}

size_t AnswerStore::KeyHash::operator()(const Key& key) const {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the four ids, mixed per id
  for (int64_t t : key) {
    h ^= uint64_t(t) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h *= 1099511628211ull;
  }
  return size_t(h);
}

AnswerStore::Key AnswerStore::key_of(const int64_t* context, int n) {
  Key key{0, 0, 0, 0};
  std::copy(context, context + n, key.begin());
  return key;
}

void AnswerStore::add(const std::vector<int64_t>& tokens, int64_t prompt_len) {
  // A continued conversation: this prompt is the last one and more.
  const size_t last_prompt = std::min<size_t>(size_t(last_prompt_), last_.size());
  const bool continued = prompt_len > last_prompt_ && tokens.size() >= last_prompt &&
                         std::equal(last_.begin(), last_.begin() + last_prompt, tokens.begin());
  size_t shared = 0;
  if (continued)
    while (shared < last_.size() && shared < tokens.size() && last_[shared] == tokens[shared])
      ++shared;
  last_ = tokens;
  last_prompt_ = prompt_len;
  const size_t cut = tokens.size() - std::min<size_t>(tokens.size(), size_t(max_tokens_));
  shared = shared > cut ? shared - cut : 0;
  // Kept from the shared part's last kOrders[0] tokens: the contexts of the new positions.
  const size_t start = cut + (shared > size_t(kOrders[0]) ? shared - size_t(kOrders[0]) : 0);
  Sequence kept{{tokens.begin() + start, tokens.end()}, int64_t(cut + shared - start)};
  count(kept, +1);
  tokens_ += int64_t(kept.tokens.size());
  sequences_.push_back(std::move(kept));
  while (tokens_ > max_tokens_) {
    count(sequences_.front(), -1);
    tokens_ -= int64_t(sequences_.front().tokens.size());
    sequences_.pop_front();
  }
}

void AnswerStore::count(const Sequence& sequence, int64_t sign) {
  const std::vector<int64_t>& tokens = sequence.tokens;
  for (size_t o = 0; o < tables_.size(); ++o) {
    const int n = kOrders[o];
    Table& table = tables_[o];
    for (size_t j = std::max<size_t>(n, size_t(sequence.first)); j < tokens.size(); ++j) {
      const Key key = key_of(tokens.data() + j - n, n);
      Nexts& nexts = table[key];
      const int64_t token = tokens[j];
      auto it = std::find_if(nexts.begin(), nexts.end(),
                             [token](const auto& entry) { return entry.first == token; });
      if (it == nexts.end()) {
        nexts.emplace_back(token, 0);
        it = nexts.end() - 1;
      }
      it->second += sign;
      if (it->second == 0) {  // gone: re-added later, it goes last (as a Python dict key)
        nexts.erase(it);
        if (nexts.empty()) table.erase(key);
      }
    }
  }
}

const AnswerStore::Nexts* AnswerStore::find(const std::vector<int64_t>& context,
                                            size_t order_index) const {
  const int n = kOrders[order_index];
  if (int64_t(context.size()) < n) return nullptr;
  const Table& table = tables_[order_index];
  const auto found = table.find(key_of(context.data() + context.size() - n, n));
  return found == table.end() ? nullptr : &found->second;
}

std::optional<int64_t> AnswerStore::next(const std::vector<int64_t>& context) const {
  for (size_t o = 0; o < tables_.size(); ++o) {
    const Nexts* nexts = find(context, o);
    if (nexts == nullptr) continue;
    // The first of the largest counts in insertion order, as Python's max() over the dict.
    const auto* best = &nexts->front();
    int64_t total = 0;
    for (const auto& entry : *nexts) {
      total += entry.second;
      if (entry.second > best->second) best = &entry;
    }
    const bool confident =
        best->second >= min_count_ && double(best->second) >= min_share_ * double(total);
    if (confident) return best->first;
    return std::nullopt;
  }
  return std::nullopt;
}

std::vector<int64_t> AnswerStore::draft(const std::vector<int64_t>& context, int64_t k) {
  const size_t tail = std::min<size_t>(context.size(), size_t(kOrders[0]));
  std::vector<int64_t> so_far(context.end() - tail, context.end());
  std::vector<int64_t> out;
  while (int64_t(out.size()) < k) {
    const std::optional<int64_t> token = next(so_far);
    if (!token) break;
    out.push_back(*token);
    so_far.push_back(*token);
  }
  drafts_ += !out.empty();
  return out;
}

std::vector<size_t> AnswerStore::contexts() const {
  std::vector<size_t> sizes;
  for (const Table& table : tables_) sizes.push_back(table.size());
  return sizes;
}

std::vector<std::pair<int64_t, int64_t>> AnswerStore::nexts(
    const std::vector<int64_t>& context) const {
  for (size_t o = 0; o < tables_.size(); ++o)
    if (int64_t(context.size()) == kOrders[o]) {
      const Nexts* found = find(context, o);
      return found ? *found : Nexts{};
    }
  return {};
}

Draft StoreDrafter::propose(const std::vector<int64_t>& context, const Hidden* hidden, int64_t k,
                            Sampler& sampler) {
  Draft draft = ForwardingDrafter::propose(context, hidden, k, sampler);
  if (int64_t(draft.tokens.size()) >= k) return draft;
  // The store reads only the last kOrders[0] tokens: no copy of the whole context.
  const size_t tail = std::min<size_t>(context.size(), size_t(AnswerStore::kOrders[0]));
  std::vector<int64_t> so_far(context.end() - tail, context.end());
  so_far.insert(so_far.end(), draft.tokens.begin(), draft.tokens.end());
  const std::vector<int64_t> more = store_->draft(so_far, k - int64_t(draft.tokens.size()));
  if (more.empty()) return draft;
  // Empty probs mean one-hot rows for every token (loop.cpp); a distribution per inner token
  // needs a one-hot row per store token beside it.
  if (!draft.probs.empty()) {
    const size_t vocab = draft.probs.front().size();
    for (int64_t token : more) {
      std::vector<double> row(vocab, 0.0);
      row[size_t(token)] = 1.0;
      draft.probs.push_back(std::move(row));
    }
  }
  draft.tokens.insert(draft.tokens.end(), more.begin(), more.end());
  ++extended_;
  return draft;
}

}  // namespace mtp
