// The snapshot reader on good, foreign and damaged bytes: a corpus built here byte by byte
// (every truncation, every single-bit flip of a small snapshot, random garbage) must be
// refused with its reason, never crash nor read outside the bytes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "model/config.h"
#include "model/random_model.h"
#include "model/snapshot_format.h"
#include "model/weights.h"
#include "tests/model/test_util.h"

namespace m3 {
namespace {

using ::testing::HasSubstr;

ModelFingerprint fingerprint() {
  ModelFingerprint fp;
  fp.config_hash = 0x1122334455667788ull;
  fp.weights_hash_lo = 0xdeadbeefull;
  fp.weights_hash_hi = 0xfeedull;
  fp.weight_dtype = "bf16";
  fp.engine = "cuda";
  fp.state_bytes = 40;
  return fp;
}

std::vector<std::byte> payload(size_t n, uint8_t seed) {
  std::vector<std::byte> p(n);
  for (size_t i = 0; i < n; ++i) p[i] = std::byte{static_cast<uint8_t>(seed + 7 * i)};
  return p;
}

SnapshotError::Kind kind_of(std::span<const std::byte> bytes, const ModelFingerprint& fp, std::string* message) {
  try {
    decode_snapshot(bytes, fp);
  } catch (const SnapshotError& e) {
    *message = e.what();
    return e.kind();
  }
  ADD_FAILURE() << "decoded without complaint";
  return SnapshotError::Kind::kCorrupt;
}

TEST(SnapshotFormat, RoundTrips) {
  const auto p = payload(40, 3);
  const auto bytes = encode_snapshot(fingerprint(), 1234, p);
  ASSERT_EQ(bytes.size(), kSnapshotHeaderBytes + 40);
  const SnapshotView v = decode_snapshot(bytes, fingerprint());
  EXPECT_EQ(v.tokens, 1234u);
  EXPECT_TRUE(std::equal(v.payload.begin(), v.payload.end(), p.begin(), p.end()));
  const SnapshotHeader h = read_snapshot_header(bytes);
  EXPECT_EQ(h.fingerprint, fingerprint());
  EXPECT_EQ(h.payload_bytes, 40u);
}

TEST(SnapshotFormat, AnotherModelDtypeOrEngineIsRefusedNamingBothFingerprints) {
  const auto bytes = encode_snapshot(fingerprint(), 9, payload(40, 1));
  for (int which = 0; which < 4; ++which) {
    ModelFingerprint mine = fingerprint();
    if (which == 0) mine.weights_hash_lo ^= 1;
    if (which == 1) mine.weight_dtype = "fp32";
    if (which == 2) mine.engine = "cpu";
    if (which == 3) mine.config_hash = 7;
    std::string message;
    EXPECT_EQ(kind_of(bytes, mine, &message), SnapshotError::Kind::kOtherModel) << which;
    EXPECT_THAT(message, HasSubstr("it has [" + fingerprint().to_string() + "]"));
    EXPECT_THAT(message, HasSubstr("this server runs [" + mine.to_string() + "]"));
  }
}

TEST(SnapshotFormat, AnotherFormatVersionIsRefusedNamingBoth) {
  auto bytes = encode_snapshot(fingerprint(), 9, payload(40, 1));
  bytes[8] = std::byte{2};
  std::string message;
  EXPECT_EQ(kind_of(bytes, fingerprint(), &message), SnapshotError::Kind::kOtherModel);
  EXPECT_EQ(message, "snapshot of format version 2; this server reads version 1");
}

TEST(SnapshotFormat, EveryTruncationIsRefusedAsDamage) {
  const auto bytes = encode_snapshot(fingerprint(), 9, payload(40, 1));
  for (size_t n = 0; n < bytes.size(); ++n) {
    // A copy of exactly n bytes, so that a read past it is a sanitizer's error.
    const std::vector<std::byte> cut(bytes.begin(), bytes.begin() + static_cast<long>(n));
    std::string message;
    EXPECT_EQ(kind_of(cut, fingerprint(), &message), SnapshotError::Kind::kCorrupt) << n;
    EXPECT_THAT(message, HasSubstr("snapshot damaged: ")) << n;
  }
  std::string message;
  const std::vector<std::byte> cut(bytes.begin(), bytes.end() - 1);
  kind_of(cut, fingerprint(), &message);
  EXPECT_EQ(message, "snapshot damaged: truncated: its header says 40 bytes of state, 39 follow");
  std::vector<std::byte> longer = bytes;
  longer.push_back(std::byte{0});
  kind_of(longer, fingerprint(), &message);
  EXPECT_EQ(message, "snapshot damaged: trailing bytes: its header says 40 bytes of state, 41 follow");
}

TEST(SnapshotFormat, EverySingleBitFlipIsRefused) {
  const auto bytes = encode_snapshot(fingerprint(), 9, payload(40, 1));
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      auto flipped = bytes;
      flipped[i] ^= std::byte{static_cast<uint8_t>(1u << bit)};
      std::string message;
      const auto kind = kind_of(flipped, fingerprint(), &message);
      if (i >= 8 && i < 12) {
        EXPECT_EQ(kind, SnapshotError::Kind::kOtherModel) << i;  // the version: named as such
        EXPECT_THAT(message, HasSubstr("format version"));
      } else {
        EXPECT_EQ(kind, SnapshotError::Kind::kCorrupt) << i << ":" << bit << " " << message;
      }
    }
  }
  auto flipped = bytes;
  flipped[kSnapshotHeaderBytes + 5] ^= std::byte{1};
  std::string message;
  kind_of(flipped, fingerprint(), &message);
  EXPECT_EQ(message, "snapshot damaged: its state does not match its checksum (corrupted)");
  flipped = bytes;
  flipped[70] ^= std::byte{1};
  kind_of(flipped, fingerprint(), &message);
  EXPECT_EQ(message, "snapshot damaged: its header does not match the header's checksum");
}

TEST(SnapshotFormat, RandomGarbageIsRefused) {
  std::mt19937_64 rng(5);
  for (int i = 0; i < 2000; ++i) {
    std::vector<std::byte> junk(rng() % 300);
    for (auto& b : junk) b = std::byte{static_cast<uint8_t>(rng())};
    if (i % 2 == 0 && junk.size() >= 12) std::memcpy(junk.data(), "M3SNAPSH\1\0\0\0", 12);  // past the magic
    std::string message;
    EXPECT_EQ(kind_of(junk, fingerprint(), &message), SnapshotError::Kind::kCorrupt) << i;
  }
}

TEST(SnapshotFormat, FingerprintHashesTheWeightsAsLoaded) {
  test::ScratchDir dir;
  ModelConfig c;
  c.d_model = 64;
  c.n_layer = 1;
  c.vocab_size = 50;
  c.ssm.is_mimo = true;
  c.ssm.mimo_rank = 2;
  c.ssm.d_state = 16;
  c.ssm.headdim = 16;
  c.validate("test");
  write_random_model(c, 1, DType::F32, dir.path() / "a");
  write_random_model(c, 2, DType::F32, dir.path() / "b");
  const ModelWeights a = ModelWeights::load(dir.path() / "a"), b = ModelWeights::load(dir.path() / "b");
  const ModelWeights a_again = ModelWeights::load(dir.path() / "a");
  EXPECT_EQ(fingerprint_model(a, "fp32", "cpu", 8), fingerprint_model(a_again, "fp32", "cpu", 8));
  const ModelFingerprint fa = fingerprint_model(a, "fp32", "cpu", 8), fb = fingerprint_model(b, "fp32", "cpu", 8);
  EXPECT_EQ(fa.config_hash, fb.config_hash);
  EXPECT_NE(fa.weights_hash_lo, fb.weights_hash_lo);
}

}  // namespace
}  // namespace m3
