#include <cstdio>
#include <fstream>
#include <set>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "model/safetensors.h"

namespace m3 {

void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::string file = path.string();
  // Insertion order: metadata first, then tensors as given, so the same input always
  // gives the same bytes.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    if (t.name == "__metadata__" || t.name.empty())
      throw std::invalid_argument(file + ": invalid tensor name \"" + t.name + "\"");
    if (!names.insert(t.name).second)
      throw std::invalid_argument(file + ": tensor " + t.name + " is given twice");
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) throw std::invalid_argument(file + ": tensor " + t.name + " has a negative dimension");
      numel *= static_cast<uint64_t>(d);
    }
    if (numel * dtype_size(t.dtype) != t.data.size())
      throw std::invalid_argument(file + ": tensor " + t.name + " has " + std::to_string(t.data.size()) +
                                  " bytes, its shape and dtype need " +
                                  std::to_string(numel * dtype_size(t.dtype)));
    header[t.name] = {{"dtype", dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string text = header.dump();
  // The data section starts 8-byte aligned, padded with spaces as the HF writer does.
  text.append((8 - text.size() % 8) % 8, ' ');

  // Write beside the target and rename, so a reader never sees a half-written file.
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error(tmp.string() + ": cannot open for writing");
    uint64_t n = text.size();
    char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    out.write(len, 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const TensorToWrite& t : tensors)
      out.write(reinterpret_cast<const char*>(t.data.data()), static_cast<std::streamsize>(t.data.size()));
    out.flush();
    if (!out) throw std::runtime_error(tmp.string() + ": write failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    throw std::runtime_error(file + ": cannot rename temporary file into place");
  }
}

}  // namespace m3
