#include "model/snapshot_format.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "model/config.h"
#include "model/weights.h"

namespace m3 {
namespace {

constexpr char kMagic[8] = {'M', '3', 'S', 'N', 'A', 'P', 'S', 'H'};
constexpr size_t kHeaderHashAt = 96;

void put_u64(std::byte* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = std::byte{static_cast<uint8_t>(v >> (8 * i))};
}
void put_u32(std::byte* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = std::byte{static_cast<uint8_t>(v >> (8 * i))};
}
uint64_t get_u64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{static_cast<uint8_t>(p[i])} << (8 * i);
  return v;
}
uint32_t get_u32(const std::byte* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<uint8_t>(p[i])} << (8 * i);
  return v;
}
void put_name(std::byte* p, std::string_view s) {
  std::memset(p, 0, 8);
  std::memcpy(p, s.data(), std::min<size_t>(s.size(), 8));
}
std::string get_name(const std::byte* p) {
  std::string s(reinterpret_cast<const char*>(p), 8);
  s.resize(std::strlen(s.c_str()));
  // Printable only: the name goes into messages.
  for (char& c : s)
    if (c < 0x20 || c > 0x7e) c = '?';
  return s;
}
std::string hex(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

SnapshotError corrupt(const std::string& why) {
  return SnapshotError(SnapshotError::Kind::kCorrupt, "snapshot damaged: " + why);
}

}  // namespace

std::string ModelFingerprint::to_string() const {
  return "config " + hex(config_hash) + " weights " + hex(weights_hash_hi) + hex(weights_hash_lo) + " " +
         weight_dtype + " " + engine + " state " + std::to_string(state_bytes) + " B";
}

ModelFingerprint fingerprint_model(const ModelWeights& weights, std::string_view weight_dtype,
                                   std::string_view engine, uint64_t state_bytes) {
  ModelFingerprint fp;
  const std::string config = weights.config().to_json();
  fp.config_hash = XXH3_64bits(config.data(), config.size());
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr) throw std::bad_alloc();
  XXH3_128bits_reset(state);
  for (const auto& [name, t] : weights.all_tensors()) {  // std::map: name order
    XXH3_128bits_update(state, name.data(), name.size() + 1);
    const std::string_view dtype = dtype_name(t->dtype);
    XXH3_128bits_update(state, dtype.data(), dtype.size());
    XXH3_128bits_update(state, t->shape.data(), sizeof(int64_t) * t->shape.size());
    XXH3_128bits_update(state, t->data, t->nbytes);
  }
  const XXH128_hash_t h = XXH3_128bits_digest(state);
  XXH3_freeState(state);
  fp.weights_hash_lo = h.low64;
  fp.weights_hash_hi = h.high64;
  fp.weight_dtype = std::string(weight_dtype.substr(0, 8));
  fp.engine = std::string(engine.substr(0, 8));
  fp.state_bytes = state_bytes;
  return fp;
}

std::vector<std::byte> encode_snapshot(const ModelFingerprint& fp, uint64_t tokens,
                                       std::span<const std::byte> payload) {
  std::vector<std::byte> out(kSnapshotHeaderBytes + payload.size());
  std::byte* h = out.data();
  std::memcpy(h, kMagic, 8);
  put_u32(h + 8, kSnapshotFormatVersion);
  put_u32(h + 12, 0);
  put_u64(h + 16, fp.config_hash);
  put_u64(h + 24, fp.weights_hash_lo);
  put_u64(h + 32, fp.weights_hash_hi);
  put_name(h + 40, fp.weight_dtype);
  put_name(h + 48, fp.engine);
  put_u64(h + 56, fp.state_bytes);
  put_u64(h + 64, tokens);
  put_u64(h + 72, payload.size());
  const XXH128_hash_t ph = XXH3_128bits(payload.data(), payload.size());
  put_u64(h + 80, ph.low64);
  put_u64(h + 88, ph.high64);
  put_u64(h + kHeaderHashAt, XXH3_64bits(h, kHeaderHashAt));
  std::memcpy(out.data() + kSnapshotHeaderBytes, payload.data(), payload.size());
  return out;
}

SnapshotHeader read_snapshot_header(std::span<const std::byte> bytes) {
  if (bytes.size() < 12 || std::memcmp(bytes.data(), kMagic, 8) != 0) {
    throw corrupt("not an m3serve snapshot (" + std::to_string(bytes.size()) +
                  " bytes, without the M3SNAPSH magic at the start)");
  }
  SnapshotHeader hdr;
  hdr.version = get_u32(bytes.data() + 8);
  if (hdr.version != kSnapshotFormatVersion) {
    throw SnapshotError(SnapshotError::Kind::kOtherModel,
                        "snapshot of format version " + std::to_string(hdr.version) + "; this server reads version " +
                            std::to_string(kSnapshotFormatVersion));
  }
  if (bytes.size() < kSnapshotHeaderBytes) {
    throw corrupt("truncated: " + std::to_string(bytes.size()) + " bytes, shorter than its " +
                  std::to_string(kSnapshotHeaderBytes) + "-byte header");
  }
  const std::byte* h = bytes.data();
  if (get_u64(h + kHeaderHashAt) != XXH3_64bits(h, kHeaderHashAt)) {
    throw corrupt("its header does not match the header's checksum");
  }
  ModelFingerprint& fp = hdr.fingerprint;
  fp.config_hash = get_u64(h + 16);
  fp.weights_hash_lo = get_u64(h + 24);
  fp.weights_hash_hi = get_u64(h + 32);
  fp.weight_dtype = get_name(h + 40);
  fp.engine = get_name(h + 48);
  fp.state_bytes = get_u64(h + 56);
  hdr.tokens = get_u64(h + 64);
  hdr.payload_bytes = get_u64(h + 72);
  return hdr;
}

SnapshotView decode_snapshot(std::span<const std::byte> bytes, const ModelFingerprint& expected) {
  const SnapshotHeader hdr = read_snapshot_header(bytes);
  if (!(hdr.fingerprint == expected)) {
    throw SnapshotError(SnapshotError::Kind::kOtherModel,
                        "snapshot made by another model or engine: it has [" + hdr.fingerprint.to_string() +
                            "], this server runs [" + expected.to_string() + "]");
  }
  const uint64_t available = bytes.size() - kSnapshotHeaderBytes;
  if (hdr.payload_bytes != available) {
    throw corrupt(std::string(hdr.payload_bytes > available ? "truncated" : "trailing bytes") + ": its header says " +
                  std::to_string(hdr.payload_bytes) + " bytes of state, " + std::to_string(available) + " follow");
  }
  if (hdr.payload_bytes != expected.state_bytes) {
    throw corrupt("its state has " + std::to_string(hdr.payload_bytes) + " bytes, the engine's slot " +
                  std::to_string(expected.state_bytes));
  }
  const std::span<const std::byte> payload = bytes.subspan(kSnapshotHeaderBytes);
  const XXH128_hash_t ph = XXH3_128bits(payload.data(), payload.size());
  if (ph.low64 != get_u64(bytes.data() + 80) || ph.high64 != get_u64(bytes.data() + 88)) {
    throw corrupt("its state does not match its checksum (corrupted)");
  }
  return {hdr.tokens, payload};
}

}  // namespace m3
