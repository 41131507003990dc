// Safetensors layout: 8-byte little-endian header length n, n bytes of JSON header
// ({name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}),
// then the data section; offsets are relative to the data section's start.
#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "model/json_input.h"

namespace m3 {

namespace {

using json = nlohmann::json;

// The Hugging Face reader refuses headers above 100 MB; so do we.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

[[noreturn]] void fail(const std::string& file, const std::string& what) {
  throw std::runtime_error(file + ": " + what);
}

[[noreturn]] void fail_tensor(const std::string& file, const std::string& tensor, const std::string& what) {
  throw std::runtime_error(file + ": tensor " + tensor + ": " + what);
}

// Closes the descriptor on every path out of open().
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

bool as_u64(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer()) {
    int64_t i = v.get<int64_t>();
    if (i < 0) return false;
    *out = static_cast<uint64_t>(i);
    return true;
  }
  return false;
}

// Parses the header, refusing a tensor name that appears twice (plain parsing would keep
// the last one silently).
json parse_header(const char* begin, const char* end, const std::string& file) {
  std::set<std::string> seen;
  std::string duplicate;
  auto on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    check_json_depth(depth, file, "header");
    if (event == json::parse_event_t::key && depth == 1 && duplicate.empty()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second) duplicate = key;
    }
    return true;
  };
  json header;
  try {
    header = json::parse(begin, end, on_event);
  } catch (const json::exception& e) {
    fail(file, std::string("header is not valid JSON: ") + e.what());
  }
  if (!duplicate.empty()) fail_tensor(file, duplicate, "appears twice in the header");
  return header;
}

TensorView parse_entry(const std::string& file, const std::string& name, const json& entry,
                       const std::byte* data, uint64_t data_size, uint64_t* begin_out) {
  if (!entry.is_object()) fail_tensor(file, name, "header entry is not an object");
  TensorView t;
  t.name = name;

  auto dt = entry.find("dtype");
  if (dt == entry.end()) fail_tensor(file, name, "missing dtype");
  if (!dt->is_string()) fail_tensor(file, name, "dtype is not a string: " + json_brief(*dt));
  if (!parse_dtype(dt->get_ref<const std::string&>(), &t.dtype))
    fail_tensor(file, name, "unknown dtype " + json_brief(*dt));

  auto sh = entry.find("shape");
  if (sh == entry.end()) fail_tensor(file, name, "missing shape");
  if (!sh->is_array()) fail_tensor(file, name, "shape is not a list: " + json_brief(*sh));
  // Element count, checked against the data section as it grows, so it cannot overflow.
  uint64_t numel = 1;
  bool empty = false;
  for (const json& d : *sh) {
    if (d.is_number_integer() && !d.is_number_unsigned() && d.get<int64_t>() < 0)
      fail_tensor(file, name, "negative dimension in shape " + json_brief(*sh));
    uint64_t v;
    if (!as_u64(d, &v)) fail_tensor(file, name, "shape holds a non-integer: " + json_brief(*sh));
    if (v > static_cast<uint64_t>(INT64_MAX)) fail_tensor(file, name, "dimension too large in shape " + json_brief(*sh));
    t.shape.push_back(static_cast<int64_t>(v));
    if (v == 0) empty = true;
    if (!empty) {
      if (v > data_size || numel > data_size / v)
        fail_tensor(file, name, "shape " + json_brief(*sh) + " needs more bytes than the data section holds (" +
                                    std::to_string(data_size) + ")");
      numel *= v;
    }
  }
  if (empty) numel = 0;

  auto off = entry.find("data_offsets");
  if (off == entry.end()) fail_tensor(file, name, "missing data_offsets");
  uint64_t begin = 0, end = 0;
  if (!off->is_array() || off->size() != 2 || !as_u64((*off)[0], &begin) || !as_u64((*off)[1], &end))
    fail_tensor(file, name, "data_offsets must be [begin, end] with non-negative integers, got " + json_brief(*off));
  if (begin > end) fail_tensor(file, name, "data_offsets " + json_brief(*off) + " has begin > end");
  if (end > data_size)
    fail_tensor(file, name, "data_offsets " + json_brief(*off) + " run past the data section (" +
                                std::to_string(data_size) + " bytes)");
  const uint64_t nbytes = end - begin;
  const uint64_t want = numel * dtype_size(t.dtype);  // numel <= data_size, no overflow
  if (numel > data_size || want != nbytes)
    fail_tensor(file, name, "shape " + t.shape_str() + " of " + std::string(dtype_name(t.dtype)) + " needs " +
                                std::to_string(want) + " bytes, data_offsets " + json_brief(*off) + " hold " +
                                std::to_string(nbytes));
  t.data = data + begin;
  t.nbytes = static_cast<size_t>(nbytes);
  *begin_out = begin;
  return t;
}

}  // namespace

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::filesystem::path& path) {
  const std::string file = path.string();
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;

  FdGuard fd{::open(file.c_str(), O_RDONLY | O_CLOEXEC)};
  if (fd.fd < 0) fail(file, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) fail(file, std::string("cannot stat: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) fail(file, "not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8)
    fail(file, "file is " + std::to_string(size) + " bytes, too short for the 8-byte header length (truncated?)");

  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.fd, 0);
  if (map == MAP_FAILED) fail(file, std::string("cannot map: ") + std::strerror(errno));
  // From here the destructor unmaps, also when validation below throws.
  f->map_ = map;
  f->map_size_ = size;
  const auto* bytes = static_cast<const std::byte*>(map);

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  if (header_len > kMaxHeaderBytes)
    fail(file, "header length " + std::to_string(header_len) + " is implausibly large (limit " +
                   std::to_string(kMaxHeaderBytes) + "); not a safetensors file?");
  if (header_len > size - 8)
    fail(file, "header length " + std::to_string(header_len) + " runs past the end of the file (" +
                   std::to_string(size) + " bytes; truncated?)");

  const char* header_begin = reinterpret_cast<const char*>(bytes + 8);
  // The JSON parser stops at a NUL byte; anything after one would be ignored silently.
  if (const void* nul = std::memchr(header_begin, 0, header_len))
    fail(file, "header is not valid JSON: NUL byte at header offset " +
                   std::to_string(static_cast<const char*>(nul) - header_begin));
  json header = parse_header(header_begin, header_begin + header_len, file);
  if (!header.is_object()) fail(file, "header is not a JSON object but " + std::string(header.type_name()));

  const std::byte* data = bytes + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;
  std::vector<std::pair<uint64_t, std::string>> ranges;  // (begin, name) of non-empty tensors
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) fail(file, "__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) fail(file, "__metadata__ value for " + m.key() + " is not a string");
        f->metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    uint64_t begin = 0;
    TensorView t = parse_entry(file, it.key(), *it, data, data_size, &begin);
    if (t.nbytes > 0) ranges.emplace_back(begin, it.key());
    f->tensors_.emplace(it.key(), std::move(t));
  }

  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    const TensorView& prev = f->tensors_.at(ranges[i - 1].second);
    const uint64_t prev_end = ranges[i - 1].first + prev.nbytes;
    if (ranges[i].first < prev_end)
      fail_tensor(file, ranges[i].second, "data range overlaps tensor " + ranges[i - 1].second);
  }
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_size_);
}

const TensorView* SafetensorsFile::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

SafetensorsSet SafetensorsSet::open_dir(const std::filesystem::path& model_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(model_dir, ec)) fail(model_dir.string(), "not a directory");

  SafetensorsSet set;
  const fs::path index_path = model_dir / "model.safetensors.index.json";
  const fs::path single_path = model_dir / "model.safetensors";

  if (!fs::exists(index_path, ec)) {
    if (!fs::exists(single_path, ec))
      fail(model_dir.string(), "no model.safetensors or model.safetensors.index.json");
    set.files_.push_back(SafetensorsFile::open(single_path));
    for (const auto& [name, view] : set.files_[0]->tensors()) {
      set.index_[name] = &view;
      set.file_index_[name] = 0;
    }
    return set;
  }

  const std::string index_file = index_path.string();
  const json index = parse_json_bounded(read_text_file(index_path, kMaxHeaderBytes), index_file, "");
  if (!index.is_object()) fail(index_file, "not a JSON object");
  auto wm = index.find("weight_map");
  if (wm == index.end()) fail(index_file, "missing weight_map");
  if (!wm->is_object()) fail(index_file, "weight_map is not an object");

  std::map<std::string, size_t> shard_of_file;  // shard file name -> files_ index
  std::map<std::string, std::string> listed;     // tensor -> shard file name
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it->is_string()) fail(index_file, "weight_map entry for tensor " + it.key() + " is not a string");
    const std::string shard = it->get<std::string>();
    const fs::path rel(shard);
    // Shards live beside the index; refuse paths that would leave the model directory.
    if (shard.empty() || rel.is_absolute() || rel.has_parent_path())
      fail(index_file, "tensor " + it.key() + " names shard \"" + shard + "\", which is not a file name");
    listed[it.key()] = shard;
    if (shard_of_file.count(shard)) continue;
    const fs::path shard_path = model_dir / rel;
    if (!fs::is_regular_file(shard_path, ec))
      fail(index_file, "shard " + shard + " (listed for tensor " + it.key() + ") does not exist");
    shard_of_file[shard] = set.files_.size();
    set.files_.push_back(SafetensorsFile::open(shard_path));
  }

  for (size_t fi = 0; fi < set.files_.size(); ++fi) {
    const SafetensorsFile& f = *set.files_[fi];
    for (const auto& [name, view] : f.tensors()) {
      auto prev = set.file_index_.find(name);
      if (prev != set.file_index_.end())
        fail(f.path().string(), "tensor " + name + " is also stored in " + set.files_[prev->second]->path().string());
      auto l = listed.find(name);
      if (l == listed.end())
        fail(f.path().string(), "tensor " + name + " is not listed in " + index_file);
      if (shard_of_file.at(l->second) != fi)
        fail(f.path().string(), "tensor " + name + " is listed in " + index_file + " under shard " + l->second);
      set.index_[name] = &view;
      set.file_index_[name] = fi;
    }
  }
  for (const auto& [name, shard] : listed) {
    if (!set.index_.count(name))
      fail(index_file, "tensor " + name + " is listed in shard " + shard + " but not found there");
  }
  return set;
}

const TensorView* SafetensorsSet::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

std::string SafetensorsSet::file_of(const std::string& name) const {
  auto it = file_index_.find(name);
  if (it != file_index_.end()) return files_[it->second]->path().string();
  return files_.size() == 1 ? files_[0]->path().string() : std::string();
}

}  // namespace m3
