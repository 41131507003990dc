// Safetensors files: a memory-mapped reader (single file or a sharded set with
// model.safetensors.index.json) and a writer. Every structural fault in a file is a
// std::runtime_error that names the file (and the tensor where there is one).
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/tensor.h"

namespace m3 {

class SafetensorsFile {
 public:
  // Maps `path` read-only and validates the header: length within the file, JSON
  // object, known dtypes, shape * dtype size == byte range, ranges inside the data
  // section and not overlapping.
  static std::unique_ptr<SafetensorsFile> open(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const TensorView* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::filesystem::path path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a model directory: model.safetensors, or the shards listed by
// model.safetensors.index.json ("weight_map": tensor -> shard file).
class SafetensorsSet {
 public:
  static SafetensorsSet open_dir(const std::filesystem::path& model_dir);
  const TensorView* find(const std::string& name) const;
  const std::map<std::string, const TensorView*>& tensors() const { return index_; }
  // The file that holds `name`, for error messages.
  std::string file_of(const std::string& name) const;

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> index_;
  std::map<std::string, size_t> file_index_;
};

struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> data;
};

void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace m3
