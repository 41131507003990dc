#include "engine_steps.h"

#include <span>

namespace m3::testing {

int32_t step1(Engine& e, int slot, int32_t token) {
  int32_t s = -1;
  const int32_t slots[] = {slot};
  const int32_t tokens[] = {token};
  e.step(slots, tokens, std::span<int32_t>(&s, 1));
  return s;
}

void feed(Engine& e, int slot, const std::vector<int32_t>& prompt) {
  for (const int32_t t : prompt) step1(e, slot, t);
}

std::vector<int32_t> decode(Engine& e, int slot, int n) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(step1(e, slot, kContinueToken));
  return out;
}

std::vector<std::byte> saved(Engine& e, int slot) {
  std::vector<std::byte> b(e.slot_state_bytes());
  e.save_slot(slot, b);
  return b;
}

}  // namespace m3::testing
