// A sequence's state as a self-describing file: which model and engine made it (the
// fingerprint), how many tokens it covers, and the engine's slot bytes, with checksums so
// that a truncated or corrupted snapshot is refused rather than loaded.
//
// Layout (version 1, little-endian): "M3SNAPSH", u32 version, u32 zero, u64 config hash,
// u128 weights hash (lo, hi), char[8] weight dtype, char[8] engine, u64 slot state bytes,
// u64 tokens, u64 payload bytes, u128 payload hash (lo, hi), u64 hash of the 96 bytes
// before it; then the payload. Hashes are XXH3 (xxhash): they detect damage, they do not
// authenticate (whoever can write the store can write a state).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace m3 {

class ModelWeights;
struct ModelConfig;

struct ModelFingerprint {
  uint64_t config_hash = 0;                       // XXH3-64 of ModelConfig::to_json()
  uint64_t weights_hash_lo = 0, weights_hash_hi = 0;  // XXH3-128 of every tensor (below)
  std::string weight_dtype;                       // as the engine computes: "fp32", "bf16"
  std::string engine;                             // Engine::backend()
  uint64_t state_bytes = 0;                       // Engine::slot_state_bytes()

  bool operator==(const ModelFingerprint&) const = default;
  // "config 1a2b.. weights 3c4d..:5e6f.. bf16 cuda state 13762560 B"
  std::string to_string() const;
};

// Hashes the weights as loaded: every tensor in name order, its name, dtype, shape and
// bytes (a checkpoint of several GB takes a second or so, once at start).
ModelFingerprint fingerprint_model(const ModelWeights& weights, std::string_view weight_dtype,
                                   std::string_view engine, uint64_t state_bytes);

inline constexpr uint32_t kSnapshotFormatVersion = 1;
inline constexpr size_t kSnapshotHeaderBytes = 104;

// Why a snapshot was refused: damaged (truncated, corrupted, not a snapshot) or made by
// another model, engine or format version. The message says which and names both sides.
class SnapshotError : public std::runtime_error {
 public:
  enum class Kind { kCorrupt, kOtherModel };
  SnapshotError(Kind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

std::vector<std::byte> encode_snapshot(const ModelFingerprint& fp, uint64_t tokens,
                                       std::span<const std::byte> payload);

struct SnapshotView {
  uint64_t tokens = 0;
  std::span<const std::byte> payload;  // inside the bytes given to decode_snapshot
};
// Checks everything (header, fingerprint against `expected`, length, payload hash) before
// returning; throws SnapshotError. Never reads outside `bytes`.
SnapshotView decode_snapshot(std::span<const std::byte> bytes, const ModelFingerprint& expected);

// The header's fields without checking the fingerprint or payload (GetSnapshot's size and
// token count); throws SnapshotError when the header itself is damaged.
struct SnapshotHeader {
  uint32_t version = 0;
  ModelFingerprint fingerprint;
  uint64_t tokens = 0;
  uint64_t payload_bytes = 0;
};
SnapshotHeader read_snapshot_header(std::span<const std::byte> bytes);

}  // namespace m3
