// States at token boundaries of prompts read before (`prefix_cache`), so that a prompt
// starting with a kept prefix starts from the longest one and reads only the rest. The
// scheduler keeps a state every `prefix_cache_interval` tokens of a sequence's first input
// and at the end of a prompt. Keys are the tokens themselves: entries are found by a hash
// of the tokens (XXH3-64) and then compared token by token, so a collision can never hand
// out another prompt's state. The cache belongs to one server, one model and one engine,
// so the model's fingerprint is the same for every entry and is not part of the key.
//
// Engine thread only (no locking); bounded by bytes, least recently used out first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <span>
#include <unordered_map>
#include <vector>

namespace m3 {

class PrefixStateCache {
 public:
  PrefixStateCache(uint64_t capacity_bytes, int interval);

  int interval() const { return interval_; }

  struct Entry {
    std::vector<int32_t> tokens;
    std::vector<std::byte> state;  // Engine::save_slot's bytes after `tokens`
  };
  // The kept state of the longest prefix of `tokens` shorter than all of it (the step
  // after it must feed a token); null when none. Valid until the next insert().
  const Entry* longest_prefix(std::span<const int32_t> tokens);
  bool contains(std::span<const int32_t> prefix) const;
  // Keeps `state` for `prefix` (replacing an equal one), evicting the least recently used.
  // A state larger than the whole capacity is not kept.
  void insert(std::span<const int32_t> prefix, std::vector<std::byte> state);

  size_t size() const { return entries_.size(); }
  uint64_t bytes() const { return bytes_; }
  uint64_t hits() const { return hits_; }
  uint64_t tokens_skipped() const { return tokens_skipped_; }

 private:
  using List = std::list<Entry>;
  static uint64_t hash(std::span<const int32_t> tokens);
  List::iterator find(std::span<const int32_t> tokens, uint64_t h) const;
  void erase(List::iterator it);

  const uint64_t capacity_;
  const int interval_;
  List entries_;  // front: most recently used
  std::unordered_multimap<uint64_t, List::iterator> by_hash_;
  std::map<size_t, int> lengths_;  // prefix lengths kept, with their counts
  uint64_t bytes_ = 0;
  uint64_t hits_ = 0;
  uint64_t tokens_skipped_ = 0;
};

}  // namespace m3
