// Text <-> token ids through a SentencePiece model, for servers that take or return text.
// Optional: a server without a tokenizer serves token ids only.
//
// SentencePiece is reached through libm3_spm.so (model/spm_shim.h), loaded with
// dlopen(RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND) so its private protobuf never meets
// gRPC's. Nothing here links SentencePiece or protobuf. Not for sanitizer builds (the
// Address and Thread sanitizers' runtimes refuse RTLD_DEEPBIND).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace m3 {

struct SpmShimApi;  // the shim's function table (tokenizer.cc)

class Tokenizer {
 public:
  // Loads `model_path` (a SentencePiece .model). An empty shim_path means
  // default_shim_path(). Throws std::runtime_error naming the file and the cause:
  // shim missing or unloadable, shim symbol missing or of another version, model
  // file missing or not a SentencePiece model.
  static std::unique_ptr<Tokenizer> load(const std::filesystem::path& model_path,
                                         const std::filesystem::path& shim_path = {});

  // $M3_SPM_SHIM when set (only it: a wrong path fails naming it); else the first that
  // exists of libm3_spm.so beside the running executable and ../lib/libm3_spm.so from it
  // (an install tree). None: the first of them, and load() names every place it looked.
  static std::filesystem::path default_shim_path();

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  int32_t vocab_size() const { return static_cast<int32_t>(surfaces_.size()); }
  const std::filesystem::path& model_path() const { return model_path_; }

  // Thread-safe. encode throws std::runtime_error on SentencePiece failures; decode
  // throws std::invalid_argument for an id outside [0, vocab_size()).
  std::vector<int32_t> encode(std::string_view text) const;
  std::string decode(std::span<const int32_t> ids) const;

  // The bytes `id` contributes inside a text (word-boundary mark as a space; a byte
  // piece is one byte, maybe part of a UTF-8 character). Precomputed at load: no
  // allocation, no call into the shim. Throws std::invalid_argument when out of range.
  std::string_view piece_bytes(int32_t id) const;

 private:
  Tokenizer() = default;

  std::filesystem::path model_path_;
  const SpmShimApi* api_ = nullptr;
  void* handle_ = nullptr;  // m3_spm*
  std::vector<std::string> surfaces_;
};

// Streaming text for a generated continuation: feed ids as they are made, get the text
// that became complete. Holds back the bytes of a UTF-8 character split across byte
// pieces until the character is whole. The output is always valid UTF-8 (a protobuf
// string field refuses anything else): byte pieces that form no character become
// U+FFFD, one per maximal invalid part. The output continues a text (the prompt), so a
// leading word-boundary space is kept. One per stream; not thread-safe.
class StreamDetokenizer {
 public:
  explicit StreamDetokenizer(const Tokenizer& tokenizer) : tokenizer_(&tokenizer) {}

  // Appends to *out the text completed by `id`. Allocates only if *out must grow. An id
  // the tokenizer does not know (a model vocabulary wider than the tokenizer's, e.g.
  // speech units after the text pieces) adds no text and does not throw.
  void append(int32_t id, std::string* out);
  // Appends what is still held back (an incomplete character becomes U+FFFD).
  void finish(std::string* out);

 private:
  const Tokenizer* tokenizer_;
  char pending_[4] = {};
  int pending_size_ = 0;
  int pending_needed_ = 0;  // length of the character pending_ starts
};

}  // namespace m3
