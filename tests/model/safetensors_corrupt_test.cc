// A corpus of broken safetensors files, built here byte by byte: each must be refused
// with a message that names the file (and the tensor where there is one), never a crash.
#include <random>

#include "model/safetensors.h"
#include "tests/model/test_util.h"

namespace m3 {
namespace {

using ::testing::HasSubstr;
using test::error_of;

struct Corrupt {
  const char* what;
  std::string bytes;
  std::vector<std::string> message_has;
};

std::string st(const std::string& header, const std::string& data) { return test::safetensors_bytes(header, data); }

TEST(SafetensorsCorrupt, Corpus) {
  const std::string d16(16, 'x');  // 16 data bytes: four F32 values
  const std::vector<Corrupt> cases = {
      {"empty file", "", {"file is 0 bytes", "too short"}},
      {"seven bytes", std::string(7, '\0'), {"file is 7 bytes"}},
      {"header length past the end", test::safetensors_bytes("{}", "", 100), {"header length 100 runs past the end"}},
      {"absurd header length", test::safetensors_bytes("{}", "", 1ull << 60), {"implausibly large"}},
      {"header not JSON", st("{\"w\": {\"dtype\": ", d16), {"header is not valid JSON"}},
      {"header with NUL", st(std::string("{}\0", 3), ""), {"header is not valid JSON"}},
      {"header is a list", st("[1, 2]", ""), {"header is not a JSON object but array"}},
      // Printing a shape a million levels deep in the error overflowed the stack.
      {"deeply nested shape",
       st(R"({"w": {"dtype": "F32", "shape": )" + std::string(1000000, '[') + std::string(1000000, ']') +
              R"(, "data_offsets": [0, 16]}})",
          d16),
       {"header nests JSON deeper than 64 levels"}},
      {"entry not an object", st(R"({"w": 5})", d16), {"tensor w: header entry is not an object"}},
      {"missing dtype", st(R"({"w": {"shape": [4], "data_offsets": [0, 16]}})", d16), {"tensor w: missing dtype"}},
      {"dtype not a string", st(R"({"w": {"dtype": 4, "shape": [4], "data_offsets": [0, 16]}})", d16),
       {"tensor w: dtype is not a string"}},
      {"unknown dtype", st(R"({"w": {"dtype": "F8_E5M2", "shape": [4], "data_offsets": [0, 4]}})", d16),
       {"tensor w: unknown dtype \"F8_E5M2\""}},
      {"missing shape", st(R"({"w": {"dtype": "F32", "data_offsets": [0, 16]}})", d16), {"tensor w: missing shape"}},
      {"shape not a list", st(R"({"w": {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}})", d16),
       {"tensor w: shape is not a list"}},
      {"negative dimension", st(R"({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}})", d16),
       {"tensor w: negative dimension in shape [-4]"}},
      {"fractional dimension", st(R"({"w": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 16]}})", d16),
       {"tensor w: shape holds a non-integer"}},
      {"huge shape", st(R"({"w": {"dtype": "F32", "shape": [4611686018427387904, 4611686018427387904], "data_offsets": [0, 16]}})", d16),
       {"tensor w: shape", "needs more bytes than the data section holds (16)"}},
      {"missing data_offsets", st(R"({"w": {"dtype": "F32", "shape": [4]}})", d16), {"tensor w: missing data_offsets"}},
      {"one offset", st(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0]}})", d16),
       {"tensor w: data_offsets must be [begin, end]"}},
      {"negative offset", st(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [-4, 12]}})", d16),
       {"tensor w: data_offsets must be [begin, end]"}},
      {"begin after end", st(R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})", d16),
       {"tensor w: data_offsets [8,4] has begin > end"}},
      {"offsets past the data", st(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [4, 20]}})", d16),
       {"tensor w: data_offsets [4,20] run past the data section (16 bytes)"}},
      {"shape does not match the bytes", st(R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}})", d16),
       {"tensor w: shape [3] of F32 needs 12 bytes, data_offsets [0,16] hold 16"}},
      {"dtype size does not match", st(R"({"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 16]}})", d16),
       {"tensor w: shape [4] of BF16 needs 8 bytes"}},
      {"overlapping tensors",
       st(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", d16),
       {"tensor b: data range overlaps tensor a"}},
      {"same range twice",
       st(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}, "b": {"dtype": "I32", "shape": [2], "data_offsets": [8, 16]}})", d16),
       {"data range overlaps tensor"}},
      {"duplicate tensor name",
       st(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})", d16),
       {"tensor a: appears twice in the header"}},
      {"metadata not an object", st(R"({"__metadata__": [1]})", ""), {"__metadata__ is not an object"}},
      {"metadata value not a string", st(R"({"__metadata__": {"format": 1}})", ""),
       {"__metadata__ value for format is not a string"}},
  };
  test::ScratchDir dir;
  int i = 0;
  for (const Corrupt& c : cases) {
    SCOPED_TRACE(c.what);
    const auto path = dir / ("case" + std::to_string(i++) + ".safetensors");
    test::write_file(path, c.bytes);
    std::string msg = error_of([&] { SafetensorsFile::open(path); });
    EXPECT_THAT(msg, HasSubstr(path.string() + ": "));
    for (const std::string& part : c.message_has) EXPECT_THAT(msg, HasSubstr(part));
  }
}

// Sanity of the corpus' own construction: the same bytes with a correct header load.
TEST(SafetensorsCorrupt, CorpusBaselineLoads) {
  test::ScratchDir dir;
  test::write_file(dir / "ok.safetensors",
                   st(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                      std::string(16, 'x')));
  auto f = SafetensorsFile::open(dir / "ok.safetensors");
  EXPECT_EQ(f->tensors().size(), 2u);
}

TensorToWrite tensor(const std::string& name, DType dt, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<std::byte> data(static_cast<size_t>(n) * dtype_size(dt));
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>(i * 7 + 3);
  return {name, dt, shape, data};
}

// Every prefix of a valid file is refused; where the cut falls in a tensor's bytes the
// message names that tensor.
TEST(SafetensorsCorrupt, EveryTruncationIsRefused) {
  test::ScratchDir dir;
  write_safetensors(dir / "full.safetensors",
                    {tensor("first", DType::F32, {3}), tensor("second", DType::BF16, {2, 2}),
                     tensor("third", DType::I64, {1})});
  const std::string full = test::read_file(dir / "full.safetensors");
  for (size_t len = 0; len < full.size(); ++len) {
    SCOPED_TRACE("length " + std::to_string(len));
    // A new name each time: rewriting one file in place is slow on ext4 (flush on truncate).
    const auto path = dir / ("cut" + std::to_string(len) + ".safetensors");
    test::write_file(path, full.substr(0, len));
    std::string msg = error_of([&] { SafetensorsFile::open(path); });
    EXPECT_THAT(msg, HasSubstr(path.string()));
    if (len == full.size() - 1) {
      EXPECT_THAT(msg, HasSubstr("tensor third: data_offsets"));
    }
  }
}

// Random damage to a valid file: it either still parses or is refused with a
// runtime_error naming the file. (AddressSanitizer / the fuzzer check the bounds.)
TEST(SafetensorsCorrupt, RandomByteDamageNeverCrashes) {
  test::ScratchDir dir;
  write_safetensors(dir / "full.safetensors",
                    {tensor("alpha", DType::F32, {4, 3}), tensor("beta", DType::F16, {5}),
                     tensor("gamma", DType::U8, {9})},
                    {{"format", "pt"}});
  const std::string full = test::read_file(dir / "full.safetensors");
  std::mt19937 gen(7);
  int refused = 0;
  for (int round = 0; round < 3000; ++round) {
    const auto path = dir / ("damaged" + std::to_string(round) + ".safetensors");
    std::string bytes = full;
    int edits = 1 + static_cast<int>(gen() % 4);
    for (int e = 0; e < edits; ++e) {
      size_t at = gen() % bytes.size();
      // Mostly the header (where the structure is), sometimes the length prefix.
      if (gen() % 4 == 0) at = gen() % 8;
      bytes[at] = static_cast<char>(gen() & 0xff);
    }
    test::write_file(path, bytes);
    try {
      auto f = SafetensorsFile::open(path);
      for (const auto& [name, v] : f->tensors()) {
        // A parsed file's views lie within the mapping: every byte is read (a sum the
        // optimiser could drop was not) and is a run of the file's own bytes.
        ASSERT_EQ(v.nbytes, static_cast<size_t>(v.numel()) * dtype_size(v.dtype));
        const std::string viewed(reinterpret_cast<const char*>(v.data), v.nbytes);
        ASSERT_NE(bytes.find(viewed, 8), std::string::npos) << name << " in round " << round;
      }
    } catch (const std::runtime_error& e) {
      ++refused;
      ASSERT_THAT(std::string(e.what()), HasSubstr(path.string()));
    }
    std::filesystem::remove(path);
  }
  EXPECT_GT(refused, 100);
}

}  // namespace
}  // namespace m3
