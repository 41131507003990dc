// Helpers of the configuration tests: a YAML text read and validated as m3serve reads
// configs/server.yaml, and the message of the std::invalid_argument a setting is refused
// with.
#pragma once

#include <stdexcept>
#include <string>

#include "server/server_config.h"
#include "tests/error_of.h"

namespace m3::test {

inline ServerConfig from_yaml(const std::string& text) {
  ServerConfig c = parse_server_config_yaml(text, "server.yaml");
  c.validate();
  return c;
}

// Every refusal of a setting is a std::invalid_argument.
template <typename F>
std::string config_error_of(F&& f) {
  return error_of<std::invalid_argument>(f);
}

}  // namespace m3::test
