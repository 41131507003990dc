// The message of the exception a call throws, for the tests of error paths (model, engine,
// kernels alike: gtest is its only dependency).
#pragma once

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace m3::test {

// The message of the exception `f` throws (type E); a test failure if it throws none.
template <typename E = std::runtime_error, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception, none was thrown";
  return "";
}

}  // namespace m3::test
