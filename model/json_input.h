// JSON written by others (config.json, safetensors headers, shard indexes): nesting and
// size bounded before anything recurses over it, and values quoted briefly in errors.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace m3 {

// Deeper nesting than any file of ours needs; dump() and the error paths that print a
// value recurse once per level, so a megabyte of '[' would overflow the stack there.
constexpr int kMaxJsonDepth = 64;

// Throws std::runtime_error("<source>: <what> nests JSON deeper than 64 levels") from inside
// a parse callback; `depth` is the callback's. `what` names the part parsed ("header"), or
// is empty where the whole file is JSON.
void check_json_depth(int depth, const std::string& source, const char* what);

// Parses `text` with the depth bound; errors name `source` and `what` as above
// ("<source>: not valid JSON: ..." / "<source>: <what> is not valid JSON: ...").
nlohmann::json parse_json_bounded(std::string_view text, const std::string& source, const char* what);

// A value as it appears in an error message: its JSON, cut to about 80 characters.
std::string json_brief(const nlohmann::json& value);

// The whole of a small text file: a regular file (after symlinks) of at most `max_bytes`.
// Errors name the path: "no such file", "not a regular file", "is N bytes, over the limit".
std::string read_text_file(const std::filesystem::path& path, uint64_t max_bytes);

}  // namespace m3
