#include "model/json_input.h"

#include <fstream>
#include <sstream>
#include <stdexcept>
#include <system_error>

namespace m3 {

namespace {
// "<source>: <what> " or "<source>: " when `what` is empty.
std::string prefix(const std::string& source, const char* what) {
  return source + ": " + (what[0] != '\0' ? std::string(what) + " " : std::string());
}
}  // namespace

void check_json_depth(int depth, const std::string& source, const char* what) {
  if (depth > kMaxJsonDepth) {
    throw std::runtime_error(prefix(source, what) + "nests JSON deeper than " + std::to_string(kMaxJsonDepth) +
                             " levels; not a file of this kind?");
  }
}

nlohmann::json parse_json_bounded(std::string_view text, const std::string& source, const char* what) {
  auto bound = [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
    check_json_depth(depth, source, what);
    return true;
  };
  try {
    return nlohmann::json::parse(text.begin(), text.end(), bound);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(prefix(source, what) + (what[0] != '\0' ? "is not valid JSON: " : "not valid JSON: ") +
                             e.what());
  }
}

std::string json_brief(const nlohmann::json& value) {
  constexpr size_t kMax = 80;
  std::string s = value.dump();
  if (s.size() > kMax) s = s.substr(0, kMax - 3) + "...";
  return s;
}

std::string read_text_file(const std::filesystem::path& path, uint64_t max_bytes) {
  const std::string source = path.string();
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(status)) throw std::runtime_error(source + ": no such file");
  if (!std::filesystem::is_regular_file(status)) throw std::runtime_error(source + ": not a regular file");
  const uint64_t size = std::filesystem::file_size(path, ec);
  if (ec) throw std::runtime_error(source + ": cannot read its size: " + ec.message());
  if (size > max_bytes) {
    throw std::runtime_error(source + ": is " + std::to_string(size) + " bytes, over the " +
                             std::to_string(max_bytes) + "-byte limit for this file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(source + ": cannot open for reading");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw std::runtime_error(source + ": read error");
  std::string out = text.str();
  if (out.size() > max_bytes) {  // grew after the size was read
    throw std::runtime_error(source + ": is over the " + std::to_string(max_bytes) + "-byte limit for this file");
  }
  return out;
}

}  // namespace m3
