#include "model/tokenizer.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <stdexcept>
#include <system_error>

#include "model/spm_shim.h"

namespace m3 {

struct SpmShimApi {
  decltype(&m3_spm_abi_version) abi_version;
  decltype(&m3_spm_load) load;
  decltype(&m3_spm_free) free;
  decltype(&m3_spm_piece_count) piece_count;
  decltype(&m3_spm_encode) encode;
  decltype(&m3_spm_decode) decode;
  decltype(&m3_spm_id_surface) id_surface;
};

namespace {

constexpr size_t kErrorCapacity = 1024;
constexpr const char* kShimFileName = "libm3_spm.so";
constexpr const char* kShimEnvironmentVariable = "M3_SPM_SHIM";

template <typename Fn>
Fn find_symbol(void* library, const std::filesystem::path& shim_path, const char* name) {
  dlerror();
  void* symbol = dlsym(library, name);
  if (symbol == nullptr) {
    const char* why = dlerror();
    throw std::runtime_error("tokenizer: SentencePiece shim " + shim_path.string() +
                             " has no symbol " + name + " (not an m3serve shim, or an old one)" +
                             (why ? std::string(": ") + why : std::string()));
  }
  return reinterpret_cast<Fn>(symbol);
}

// The shim is never dlclose()d: it carries its own protobuf, whose static destructors
// should run only at process exit. dlopen() of a loaded path just returns it again.
const SpmShimApi* open_shim(const std::filesystem::path& shim_path) {
  if (!std::filesystem::exists(shim_path)) {
    throw std::runtime_error("tokenizer: SentencePiece shim " + shim_path.string() +
                             " not found (build target m3_spm, or pass its path)");
  }
  void* library = dlopen(shim_path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
  if (library == nullptr) {
    const char* why = dlerror();
    throw std::runtime_error("tokenizer: cannot load SentencePiece shim " + shim_path.string() +
                             ": " + (why ? why : "unknown dlopen error"));
  }
  auto api = std::make_unique<SpmShimApi>();
  api->abi_version = find_symbol<decltype(api->abi_version)>(library, shim_path, "m3_spm_abi_version");
  api->load = find_symbol<decltype(api->load)>(library, shim_path, "m3_spm_load");
  api->free = find_symbol<decltype(api->free)>(library, shim_path, "m3_spm_free");
  api->piece_count = find_symbol<decltype(api->piece_count)>(library, shim_path, "m3_spm_piece_count");
  api->encode = find_symbol<decltype(api->encode)>(library, shim_path, "m3_spm_encode");
  api->decode = find_symbol<decltype(api->decode)>(library, shim_path, "m3_spm_decode");
  api->id_surface = find_symbol<decltype(api->id_surface)>(library, shim_path, "m3_spm_id_surface");
  const int version = api->abi_version();
  if (version != M3_SPM_ABI_VERSION) {
    throw std::runtime_error("tokenizer: SentencePiece shim " + shim_path.string() +
                             " has interface version " + std::to_string(version) +
                             ", this program needs " + std::to_string(M3_SPM_ABI_VERSION));
  }
  // Lives as long as the library it points into (a few pointers per load).
  return api.release();
}

std::filesystem::path executable_dir() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::filesystem::path() : exe.parent_path();
}

}  // namespace

namespace {

// Where default_shim_path() looks, in order. An operator's M3_SPM_SHIM is the only
// candidate: a wrong path must fail naming it, not quietly load another shim.
std::vector<std::filesystem::path> default_shim_candidates() {
  std::vector<std::filesystem::path> candidates;
  if (const char* env = std::getenv(kShimEnvironmentVariable); env != nullptr && *env != '\0') {
    candidates.emplace_back(env);
    return candidates;
  }
  const auto dir = executable_dir();
  candidates.push_back(dir / kShimFileName);
  candidates.push_back(dir.parent_path() / "lib" / kShimFileName);
  return candidates;
}

}  // namespace

std::filesystem::path Tokenizer::default_shim_path() {
  const auto candidates = default_shim_candidates();
  for (const auto& candidate : candidates) {
    if (std::filesystem::exists(candidate)) return candidate;
  }
  return candidates.front();
}

std::unique_ptr<Tokenizer> Tokenizer::load(const std::filesystem::path& model_path,
                                           const std::filesystem::path& shim_path) {
  if (!std::filesystem::is_regular_file(model_path)) {
    throw std::runtime_error("tokenizer: SentencePiece model " + model_path.string() +
                             " not found or not a file");
  }
  if (shim_path.empty() && !std::filesystem::exists(default_shim_path())) {
    if (const char* env = std::getenv(kShimEnvironmentVariable); env != nullptr && *env != '\0') {
      throw std::runtime_error(std::string("tokenizer: SentencePiece shim ") + env + " (from " +
                               kShimEnvironmentVariable + ") not found");
    }
    std::string looked;
    for (const auto& candidate : default_shim_candidates()) {
      looked += (looked.empty() ? "" : ", ") + candidate.string();
    }
    throw std::runtime_error(std::string("tokenizer: SentencePiece shim ") + kShimFileName +
                             " not found (looked for " + looked + "; it is built by target "
                             "m3_spm, or set " + kShimEnvironmentVariable + " to its path)");
  }
  const SpmShimApi* api = open_shim(shim_path.empty() ? default_shim_path() : shim_path);

  std::unique_ptr<Tokenizer> tokenizer(new Tokenizer);
  tokenizer->model_path_ = model_path;
  tokenizer->api_ = api;
  char error[kErrorCapacity] = {};
  tokenizer->handle_ = api->load(model_path.c_str(), error, sizeof(error));
  if (tokenizer->handle_ == nullptr) {
    throw std::runtime_error("tokenizer: cannot load SentencePiece model " + model_path.string() +
                             ": " + error);
  }
  auto* spm = static_cast<m3_spm*>(tokenizer->handle_);
  const int32_t pieces = api->piece_count(spm);
  tokenizer->surfaces_.resize(pieces);
  for (int32_t id = 0; id < pieces; ++id) {
    std::string& surface = tokenizer->surfaces_[id];
    surface.resize(16);
    int64_t length = api->id_surface(spm, id, surface.data(), surface.size(), error, sizeof(error));
    if (length > static_cast<int64_t>(surface.size())) {
      surface.resize(length);
      length = api->id_surface(spm, id, surface.data(), surface.size(), error, sizeof(error));
    }
    if (length < 0) {
      throw std::runtime_error("tokenizer: " + model_path.string() + ": piece " +
                               std::to_string(id) + ": " + error);
    }
    surface.resize(length);
  }
  return tokenizer;
}

Tokenizer::~Tokenizer() {
  if (handle_ != nullptr) api_->free(static_cast<m3_spm*>(handle_));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  auto* spm = static_cast<m3_spm*>(handle_);
  char error[kErrorCapacity] = {};
  // A piece covers at least one byte, except the word-boundary prefix and byte pieces of
  // multi-byte characters (at most one per byte): bytes + 2 always suffices.
  std::vector<int32_t> ids(text.size() + 2);
  int64_t count = api_->encode(spm, text.data(), text.size(), ids.data(), ids.size(), error,
                               sizeof(error));
  if (count > static_cast<int64_t>(ids.size())) {
    ids.resize(count);
    count = api_->encode(spm, text.data(), text.size(), ids.data(), ids.size(), error,
                         sizeof(error));
  }
  if (count < 0) throw std::runtime_error("tokenizer: cannot encode text: " + std::string(error));
  ids.resize(count);
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size()) {
      throw std::invalid_argument("tokenizer: token id " + std::to_string(ids[i]) + " at position " +
                                  std::to_string(i) + " is outside the vocabulary [0, " +
                                  std::to_string(vocab_size()) + ")");
    }
  }
  auto* spm = static_cast<m3_spm*>(handle_);
  char error[kErrorCapacity] = {};
  std::string text(ids.size() * 8, '\0');
  int64_t length =
      api_->decode(spm, ids.data(), ids.size(), text.data(), text.size(), error, sizeof(error));
  if (length > static_cast<int64_t>(text.size())) {
    text.resize(length);
    length = api_->decode(spm, ids.data(), ids.size(), text.data(), text.size(), error,
                          sizeof(error));
  }
  if (length < 0) throw std::runtime_error("tokenizer: cannot decode ids: " + std::string(error));
  text.resize(length);
  return text;
}

std::string_view Tokenizer::piece_bytes(int32_t id) const {
  if (id < 0 || id >= vocab_size()) {
    throw std::invalid_argument("tokenizer: token id " + std::to_string(id) +
                                " is outside the vocabulary [0, " + std::to_string(vocab_size()) +
                                ")");
  }
  return surfaces_[id];
}

namespace {

constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD

// Length of the UTF-8 character a lead byte starts; 0 for a byte that cannot start one.
int utf8_sequence_length(unsigned char byte) {
  if (byte < 0x80) return 1;
  if (byte >= 0xC2 && byte <= 0xDF) return 2;
  if (byte >= 0xE0 && byte <= 0xEF) return 3;
  if (byte >= 0xF0 && byte <= 0xF4) return 4;
  return 0;
}

bool is_continuation(unsigned char byte) { return (byte & 0xC0) == 0x80; }

// The byte after a lead byte is narrower for some leads: no overlong forms (E0, F0),
// no UTF-16 surrogates (ED), nothing past U+10FFFF (F4). Protobuf rejects a string
// field holding any of them, so they must never reach a Tokens.text.
bool valid_second_byte(unsigned char lead, unsigned char byte) {
  switch (lead) {
    case 0xE0: return byte >= 0xA0 && byte <= 0xBF;
    case 0xED: return byte >= 0x80 && byte <= 0x9F;
    case 0xF0: return byte >= 0x90 && byte <= 0xBF;
    case 0xF4: return byte >= 0x80 && byte <= 0x8F;
    default: return is_continuation(byte);
  }
}

}  // namespace

void StreamDetokenizer::append(int32_t id, std::string* out) {
  if (id < 0 || id >= tokenizer_->vocab_size()) return;
  for (const char c : tokenizer_->piece_bytes(id)) {
    const auto byte = static_cast<unsigned char>(c);
    if (pending_size_ > 0) {
      const bool fits =
          pending_size_ == 1 ? valid_second_byte(static_cast<unsigned char>(pending_[0]), byte)
                             : is_continuation(byte);
      if (fits) {
        pending_[pending_size_++] = c;
        if (pending_size_ == pending_needed_) {
          out->append(pending_, pending_size_);
          pending_size_ = 0;
        }
        continue;
      }
      out->append(kReplacementCharacter);  // the held character cannot complete
      pending_size_ = 0;  // and `byte` starts afresh
    }
    const int length = utf8_sequence_length(byte);
    if (length == 1) {
      out->push_back(c);
    } else if (length == 0) {
      out->append(kReplacementCharacter);
    } else {
      pending_[0] = c;
      pending_size_ = 1;
      pending_needed_ = length;
    }
  }
}

void StreamDetokenizer::finish(std::string* out) {
  if (pending_size_ > 0) out->append(kReplacementCharacter);
  pending_size_ = 0;
}

}  // namespace m3
