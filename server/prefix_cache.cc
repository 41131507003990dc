#include "server/prefix_cache.h"

#include <xxhash.h>

#include <algorithm>

namespace m3 {

PrefixStateCache::PrefixStateCache(uint64_t capacity_bytes, int interval)
    : capacity_(capacity_bytes), interval_(std::max(1, interval)) {}

uint64_t PrefixStateCache::hash(std::span<const int32_t> tokens) {
  return XXH3_64bits(tokens.data(), tokens.size_bytes());
}

PrefixStateCache::List::iterator PrefixStateCache::find(std::span<const int32_t> tokens, uint64_t h) const {
  const auto [begin, end] = by_hash_.equal_range(h);
  for (auto it = begin; it != end; ++it) {
    const Entry& e = *it->second;
    if (std::equal(e.tokens.begin(), e.tokens.end(), tokens.begin(), tokens.end())) return it->second;
  }
  return const_cast<List&>(entries_).end();
}

bool PrefixStateCache::contains(std::span<const int32_t> prefix) const {
  return find(prefix, hash(prefix)) != entries_.end();
}

const PrefixStateCache::Entry* PrefixStateCache::longest_prefix(std::span<const int32_t> tokens) {
  if (entries_.empty() || tokens.size() < 2) return nullptr;
  // The lengths kept, longest first; each hashed from the start (prefixes are few).
  for (auto l = lengths_.rbegin(); l != lengths_.rend(); ++l) {
    if (l->first >= tokens.size()) continue;
    const std::span<const int32_t> prefix = tokens.first(l->first);
    const auto it = find(prefix, hash(prefix));
    if (it == entries_.end()) continue;
    entries_.splice(entries_.begin(), entries_, it);
    ++hits_;
    tokens_skipped_ += prefix.size();
    return &*it;
  }
  return nullptr;
}

void PrefixStateCache::erase(List::iterator it) {
  const uint64_t h = hash(it->tokens);
  const auto [begin, end] = by_hash_.equal_range(h);
  for (auto b = begin; b != end; ++b) {
    if (b->second == it) {
      by_hash_.erase(b);
      break;
    }
  }
  const auto l = lengths_.find(it->tokens.size());
  if (l != lengths_.end() && --l->second == 0) lengths_.erase(l);
  bytes_ -= it->state.size() + it->tokens.size() * sizeof(int32_t);
  entries_.erase(it);
}

void PrefixStateCache::insert(std::span<const int32_t> prefix, std::vector<std::byte> state) {
  const uint64_t size = state.size() + prefix.size_bytes();
  if (capacity_ == 0 || size > capacity_ || prefix.empty()) return;
  const uint64_t h = hash(prefix);
  if (const auto old = find(prefix, h); old != entries_.end()) erase(old);
  while (!entries_.empty() && bytes_ + size > capacity_) erase(std::prev(entries_.end()));
  entries_.push_front(Entry{{prefix.begin(), prefix.end()}, std::move(state)});
  by_hash_.emplace(h, entries_.begin());
  ++lengths_[prefix.size()];
  bytes_ += size;
}

}  // namespace m3
