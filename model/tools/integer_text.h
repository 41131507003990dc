// An integer given as a command-line value (m3cli, m3bench): all of the text, within
// [min, max]. Header-only: m3bench decode, built on GPU hosts that have no gRPC, shares it
// with client_support's Flags.
#pragma once

#include <charconv>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>

namespace m3::client {

// Stores the value and returns "", or returns why the text is refused, naming `flag`
// ("--seed: '5x' is not a non-negative integer", "--batch: 0 is outside [1, 4096]").
template <typename Int>
std::string integer_refusal(std::string_view flag, std::string_view text, Int min, Int max, Int* value) {
  static_assert(std::is_integral_v<Int>);
  Int parsed = 0;
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, parsed);
  if (error == std::errc() && stop == end && parsed >= min && parsed <= max) {
    *value = parsed;
    return {};
  }
  if (error == std::errc::invalid_argument || stop != end) {
    return std::string(flag) + ": '" + std::string(text) + "' is not " +
           (std::is_unsigned_v<Int> ? "a non-negative integer" : "an integer");
  }
  return std::string(flag) + ": " + std::string(text) + " is outside [" + std::to_string(min) + ", " +
         std::to_string(max) + "]";
}

}  // namespace m3::client
