// libm3_spm.so: the only code in m3serve that links SentencePiece (see spm_shim.h for
// why). Built with hidden visibility; only the extern "C" functions below are exported.
#include "model/spm_shim.h"

#include <sentencepiece_processor.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <vector>

#define M3_SPM_EXPORT extern "C" __attribute__((visibility("default")))

struct m3_spm {
  sentencepiece::SentencePieceProcessor processor;
};

namespace {

void write_error(char* error, size_t capacity, const std::string& message) {
  if (error == nullptr || capacity == 0) return;
  std::snprintf(error, capacity, "%s", message.c_str());
}

int64_t copy_out(const std::string& bytes, char* out, size_t capacity) {
  if (bytes.size() <= capacity && !bytes.empty()) std::memcpy(out, bytes.data(), bytes.size());
  return static_cast<int64_t>(bytes.size());
}

bool check_id(const m3_spm* spm, int32_t id, char* error, size_t error_capacity) {
  const int n = spm->processor.GetPieceSize();
  if (id >= 0 && id < n) return true;
  write_error(error, error_capacity,
              "token id " + std::to_string(id) + " is outside the SentencePiece vocabulary [0, " +
                  std::to_string(n) + ")");
  return false;
}

// "<0xE3>" -> 0xE3.
bool parse_byte_piece(const std::string& piece, unsigned char* byte) {
  unsigned value = 0;
  if (piece.size() != 6 || std::sscanf(piece.c_str(), "<0x%2X>", &value) != 1) return false;
  *byte = static_cast<unsigned char>(value);
  return true;
}

}  // namespace

M3_SPM_EXPORT int m3_spm_abi_version(void) { return M3_SPM_ABI_VERSION; }

M3_SPM_EXPORT m3_spm* m3_spm_load(const char* model_path, char* error, size_t error_capacity) {
  try {
    auto spm = std::make_unique<m3_spm>();  // (freed if Load throws)
    const auto status = spm->processor.Load(model_path);
    if (!status.ok()) {
      write_error(error, error_capacity, status.ToString());
      return nullptr;
    }
    return spm.release();
  } catch (const std::exception& e) {
    write_error(error, error_capacity, e.what());
    return nullptr;
  } catch (...) {  // nothing may cross the C boundary
    write_error(error, error_capacity, "unknown exception");
    return nullptr;
  }
}

M3_SPM_EXPORT void m3_spm_free(m3_spm* spm) { delete spm; }

M3_SPM_EXPORT int32_t m3_spm_piece_count(const m3_spm* spm) {
  return spm->processor.GetPieceSize();
}

M3_SPM_EXPORT int64_t m3_spm_encode(const m3_spm* spm, const char* text, size_t length,
                                    int32_t* ids, size_t capacity, char* error,
                                    size_t error_capacity) {
  try {
    std::vector<int> encoded;
    const auto status = spm->processor.Encode(std::string(text, length), &encoded);
    if (!status.ok()) {
      write_error(error, error_capacity, status.ToString());
      return -1;
    }
    if (encoded.size() <= capacity) {
      for (size_t i = 0; i < encoded.size(); ++i) ids[i] = encoded[i];
    }
    return static_cast<int64_t>(encoded.size());
  } catch (const std::exception& e) {
    write_error(error, error_capacity, e.what());
    return -1;
  } catch (...) {
    write_error(error, error_capacity, "unknown exception");
    return -1;
  }
}

M3_SPM_EXPORT int64_t m3_spm_decode(const m3_spm* spm, const int32_t* ids, size_t count,
                                    char* text, size_t capacity, char* error,
                                    size_t error_capacity) {
  try {
    std::vector<int> input(ids, ids + count);
    for (int id : input) {
      if (!check_id(spm, id, error, error_capacity)) return -1;
    }
    std::string decoded;
    const auto status = spm->processor.Decode(input, &decoded);
    if (!status.ok()) {
      write_error(error, error_capacity, status.ToString());
      return -1;
    }
    return copy_out(decoded, text, capacity);
  } catch (const std::exception& e) {
    write_error(error, error_capacity, e.what());
    return -1;
  } catch (...) {
    write_error(error, error_capacity, "unknown exception");
    return -1;
  }
}

M3_SPM_EXPORT int64_t m3_spm_id_surface(const m3_spm* spm, int32_t id, char* bytes,
                                        size_t capacity, char* error, size_t error_capacity) {
  try {
    if (!check_id(spm, id, error, error_capacity)) return -1;
    const auto& processor = spm->processor;
    if (processor.IsControl(id) || processor.IsUnused(id)) return 0;
    const std::string piece = processor.IdToPiece(id);
    unsigned char byte = 0;
    if (processor.IsByte(id) && parse_byte_piece(piece, &byte)) {
      return copy_out(std::string(1, static_cast<char>(byte)), bytes, capacity);
    }
    if (processor.IsUnknown(id)) {
      // The model's own unknown surface (" \u2047 " unless trained otherwise).
      std::string surface;
      const auto status = processor.Decode(std::vector<int>{id}, &surface);
      if (!status.ok()) {
        write_error(error, error_capacity, status.ToString());
        return -1;
      }
      return copy_out(surface, bytes, capacity);
    }
    static const std::string kWordBoundary = "\xE2\x96\x81";  // U+2581, SentencePiece's space
    std::string surface;
    surface.reserve(piece.size());
    for (size_t i = 0; i < piece.size();) {
      if (piece.compare(i, kWordBoundary.size(), kWordBoundary) == 0) {
        surface += ' ';
        i += kWordBoundary.size();
      } else {
        surface += piece[i++];
      }
    }
    return copy_out(surface, bytes, capacity);
  } catch (const std::exception& e) {
    write_error(error, error_capacity, e.what());
    return -1;
  } catch (...) {
    write_error(error, error_capacity, "unknown exception");
    return -1;
  }
}
