// Helpers for the model-core tests: scratch directories, raw files, error capture.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/safetensors.h"
#include "tests/error_of.h"

namespace m3::test {

// A fresh directory under the system temp dir, removed with everything in it.
class ScratchDir {
 public:
  ScratchDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "m3model_test_XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

inline void write_file(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + p.string());
}

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The raw safetensors layout: little-endian u64 header length, header, data.
inline std::string safetensors_bytes(const std::string& header, const std::string& data,
                                     uint64_t header_len_override = UINT64_MAX) {
  uint64_t n = header_len_override == UINT64_MAX ? header.size() : header_len_override;
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

// Copies of every tensor in a file, to rewrite a model with a change.
inline std::vector<TensorToWrite> copy_tensors(const SafetensorsFile& f) {
  std::vector<TensorToWrite> out;
  for (const auto& [name, v] : f.tensors())
    out.push_back({name, v.dtype, v.shape, std::vector<std::byte>(v.data, v.data + v.nbytes)});
  return out;
}

}  // namespace m3::test
