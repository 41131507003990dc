// One slot driven a step at a time, for the engine tests: a token in, its sample out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "model/engine.h"

namespace m3::testing {

// Steps `slot` alone on `token` (kContinueToken: its previous sample); returns the sample.
int32_t step1(Engine& e, int slot, int32_t token);
// Feeds `prompt` to `slot`, a step a token.
void feed(Engine& e, int slot, const std::vector<int32_t>& prompt);
// `n` continuation steps of `slot`; their samples.
std::vector<int32_t> decode(Engine& e, int slot, int n);
// The slot's state as Engine::save_slot writes it.
std::vector<std::byte> saved(Engine& e, int slot);

}  // namespace m3::testing
