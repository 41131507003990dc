// Writer -> reader round trips, the golden files, and sharded sets.
#include "model/safetensors.h"

#include <cstring>
#include <random>

#include <nlohmann/json.hpp>

#include "tests/model/test_util.h"

namespace m3 {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using test::error_of;

std::vector<std::byte> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(gen() & 0xff);
  return out;
}

TensorToWrite make(const std::string& name, DType dt, std::vector<int64_t> shape, uint32_t seed) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return {name, dt, shape, random_bytes(static_cast<size_t>(n) * dtype_size(dt), seed)};
}

TEST(SafetensorsRoundTrip, EveryDType) {
  test::ScratchDir dir;
  std::vector<TensorToWrite> in;
  uint32_t seed = 1;
  for (DType dt : {DType::F32, DType::F16, DType::BF16, DType::F64, DType::I64, DType::I32, DType::I16, DType::I8,
                   DType::U8, DType::BOOL}) {
    in.push_back(make("t_" + std::string(dtype_name(dt)), dt, {3, 5}, seed++));
  }
  in.push_back(make("scalar", DType::F32, {}, 99));
  in.push_back(make("empty", DType::F32, {4, 0}, 100));
  in.push_back(make("odd_length", DType::U8, {7}, 101));  // leaves later tensors unaligned
  in.push_back(make("after_odd", DType::F32, {2, 3}, 102));
  write_safetensors(dir / "x.safetensors", in, {{"format", "pt"}, {"note", "round trip"}});

  auto f = SafetensorsFile::open(dir / "x.safetensors");
  EXPECT_EQ(f->path(), dir / "x.safetensors");
  ASSERT_EQ(f->tensors().size(), in.size());
  for (const TensorToWrite& t : in) {
    SCOPED_TRACE(t.name);
    const TensorView* v = f->find(t.name);
    ASSERT_NE(v, nullptr);
    EXPECT_EQ(v->name, t.name);
    EXPECT_EQ(v->dtype, t.dtype);
    EXPECT_EQ(v->shape, t.shape);
    ASSERT_EQ(v->nbytes, t.data.size());
    if (!t.data.empty()) {
      EXPECT_EQ(std::memcmp(v->data, t.data.data(), t.data.size()), 0);
    }
  }
  EXPECT_EQ(f->find("absent"), nullptr);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(f->metadata().at("note"), "round trip");
}

TEST(SafetensorsWriter, HeaderIsPaddedToEightBytes) {
  test::ScratchDir dir;
  for (int name_len = 1; name_len <= 9; ++name_len) {
    write_safetensors(dir / "p.safetensors", {make(std::string(name_len, 'a'), DType::F32, {2}, 1)});
    std::string bytes = test::read_file(dir / "p.safetensors");
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
    EXPECT_EQ(n % 8, 0u);
    EXPECT_EQ(bytes.size(), 8 + n + 8);
    std::string header = bytes.substr(8, n);
    EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));  // padding is spaces after the JSON
    EXPECT_TRUE(nlohmann::json::parse(header).is_object());
  }
}

TEST(SafetensorsWriter, IsDeterministic) {
  test::ScratchDir dir;
  std::vector<TensorToWrite> in = {make("b", DType::F32, {4}, 1), make("a", DType::BF16, {2, 2}, 2)};
  write_safetensors(dir / "1.safetensors", in, {{"k", "v"}});
  write_safetensors(dir / "2.safetensors", in, {{"k", "v"}});
  EXPECT_EQ(test::read_file(dir / "1.safetensors"), test::read_file(dir / "2.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(dir / "1.safetensors.tmp"));
}

TEST(SafetensorsWriter, RejectsInconsistentInput) {
  test::ScratchDir dir;
  TensorToWrite bad = make("w", DType::F32, {3}, 1);
  bad.data.pop_back();
  EXPECT_THAT(error_of<std::invalid_argument>([&] { write_safetensors(dir / "x.safetensors", {bad}); }),
              AllOf(HasSubstr("tensor w has 11 bytes"), HasSubstr("need 12")));
  TensorToWrite a = make("w", DType::F32, {3}, 1);
  EXPECT_THAT(error_of<std::invalid_argument>([&] { write_safetensors(dir / "x.safetensors", {a, a}); }),
              HasSubstr("tensor w is given twice"));
  TensorToWrite meta = make("__metadata__", DType::F32, {1}, 1);
  EXPECT_THAT(error_of<std::invalid_argument>([&] { write_safetensors(dir / "x.safetensors", {meta}); }),
              HasSubstr("invalid tensor name"));
  EXPECT_THAT(error_of([&] { write_safetensors(dir / "missing_dir" / "x.safetensors", {a}); }),
              HasSubstr("cannot open for writing"));
}

TEST(SafetensorsFile, ReadsGoldenTrajectory) {
  const std::filesystem::path golden = M3_GOLDEN_DIR;
  if (!std::filesystem::exists(golden / "tiny")) GTEST_SKIP() << "golden dir absent: " << golden;
  // Offsets in this file are not in name order; ids are I64.
  auto f = SafetensorsFile::open(golden / "tiny" / "trajectory.safetensors");
  const TensorView* ids = f->find("greedy_ids");
  const TensorView* logits = f->find("logits");
  const TensorView* prompt = f->find("prompt_ids");
  ASSERT_TRUE(ids && logits && prompt);
  EXPECT_EQ(ids->dtype, DType::I64);
  EXPECT_EQ(logits->dtype, DType::F32);
  EXPECT_EQ(ids->shape[0], 2);
  EXPECT_EQ(logits->shape[1], ids->shape[1] - 1);
  EXPECT_EQ(logits->shape[2], 512);
  // The prompt is the first part of the greedy ids.
  const int64_t lp = prompt->shape[1];
  EXPECT_EQ(std::memcmp(prompt->data, ids->data, static_cast<size_t>(lp) * 8), 0);
}

// A two-shard model directory in the Hugging Face layout.
void write_sharded(const std::filesystem::path& dir, const nlohmann::json& weight_map) {
  write_safetensors(dir / "model-00001-of-00002.safetensors",
                    {make("a.weight", DType::F32, {4, 2}, 1), make("b.weight", DType::BF16, {3}, 2)});
  write_safetensors(dir / "model-00002-of-00002.safetensors", {make("c.weight", DType::F16, {5}, 3)});
  nlohmann::json index = {{"metadata", {{"total_size", 48}}}, {"weight_map", weight_map}};
  test::write_file(dir / "model.safetensors.index.json", index.dump(1));
}

nlohmann::json good_map() {
  return {{"a.weight", "model-00001-of-00002.safetensors"},
          {"b.weight", "model-00001-of-00002.safetensors"},
          {"c.weight", "model-00002-of-00002.safetensors"}};
}

TEST(SafetensorsSet, SingleFile) {
  test::ScratchDir dir;
  write_safetensors(dir / "model.safetensors", {make("x", DType::F32, {2}, 1), make("y", DType::F32, {1}, 2)});
  SafetensorsSet set = SafetensorsSet::open_dir(dir.path());
  EXPECT_EQ(set.tensors().size(), 2u);
  ASSERT_NE(set.find("x"), nullptr);
  EXPECT_EQ(set.find("x")->shape, std::vector<int64_t>{2});
  EXPECT_EQ(set.find("z"), nullptr);
  EXPECT_EQ(set.file_of("y"), (dir / "model.safetensors").string());
}

TEST(SafetensorsSet, Sharded) {
  test::ScratchDir dir;
  write_sharded(dir.path(), good_map());
  SafetensorsSet set = SafetensorsSet::open_dir(dir.path());
  EXPECT_EQ(set.tensors().size(), 3u);
  EXPECT_EQ(set.find("c.weight")->dtype, DType::F16);
  EXPECT_EQ(set.file_of("a.weight"), (dir / "model-00001-of-00002.safetensors").string());
  EXPECT_EQ(set.file_of("c.weight"), (dir / "model-00002-of-00002.safetensors").string());
  // The views stay valid after the set is moved.
  SafetensorsSet moved = std::move(set);
  EXPECT_EQ(moved.find("b.weight")->nbytes, 6u);
}

TEST(SafetensorsSet, ShardedErrors) {
  struct Case {
    const char* what;
    std::function<void(const std::filesystem::path&)> setup;
    std::vector<std::string> message_has;
  };
  const std::string index = "model.safetensors.index.json";
  const std::vector<Case> cases = {
      {"missing shard",
       [](const auto& d) {
         auto m = good_map();
         m["c.weight"] = "model-00003-of-00002.safetensors";
         write_sharded(d, m);
       },
       {index, "shard model-00003-of-00002.safetensors", "tensor c.weight", "does not exist"}},
      {"tensor not in its shard",
       [](const auto& d) {
         auto m = good_map();
         m["d.weight"] = "model-00002-of-00002.safetensors";
         write_sharded(d, m);
       },
       {index, "tensor d.weight is listed in shard model-00002-of-00002.safetensors but not found there"}},
      {"tensor in a shard but not listed",
       [](const auto& d) {
         auto m = good_map();
         m.erase("b.weight");
         write_sharded(d, m);
       },
       {"model-00001-of-00002.safetensors: tensor b.weight is not listed in", index}},
      {"listed under the wrong shard",
       [](const auto& d) {
         auto m = good_map();
         m["b.weight"] = "model-00002-of-00002.safetensors";
         write_sharded(d, m);
       },
       {"model-00001-of-00002.safetensors: tensor b.weight is listed in", "under shard model-00002"}},
      {"duplicate across shards",
       [](const auto& d) {
         write_sharded(d, good_map());
         write_safetensors(d / "model-00002-of-00002.safetensors",
                           {make("c.weight", DType::F16, {5}, 3), make("a.weight", DType::F32, {4, 2}, 4)});
       },
       {"tensor a.weight is also stored in", "model-0000"}},
      {"index not JSON",
       [&](const auto& d) {
         write_sharded(d, good_map());
         test::write_file(d / index, "{\"weight_map\": ");
       },
       {index, "not valid JSON"}},
      {"index not a regular file",
       [&](const auto& d) {
         write_sharded(d, good_map());
         std::filesystem::remove(d / index);
         std::filesystem::create_directory(d / index);  // a FIFO or /dev/zero would hang the read
       },
       {index, "not a regular file"}},
      {"index not an object",
       [&](const auto& d) {
         write_sharded(d, good_map());
         test::write_file(d / index, "[]");
       },
       {index, "not a JSON object"}},
      {"no weight_map",
       [&](const auto& d) {
         write_sharded(d, good_map());
         test::write_file(d / index, "{\"metadata\": {}}");
       },
       {index, "missing weight_map"}},
      {"weight_map value not a string",
       [&](const auto& d) {
         auto m = good_map();
         m["a.weight"] = 3;
         write_sharded(d, m);
       },
       {index, "weight_map entry for tensor a.weight is not a string"}},
      {"shard path leaves the directory",
       [&](const auto& d) {
         auto m = good_map();
         m["a.weight"] = "../model-00001-of-00002.safetensors";
         write_sharded(d, m);
       },
       {index, "tensor a.weight names shard", "not a file name"}},
      {"corrupt shard",
       [&](const auto& d) {
         write_sharded(d, good_map());
         test::write_file(d / "model-00002-of-00002.safetensors", "abc");
       },
       {"model-00002-of-00002.safetensors: file is 3 bytes"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    test::ScratchDir dir;
    c.setup(dir.path());
    std::string msg = error_of([&] { SafetensorsSet::open_dir(dir.path()); });
    for (const std::string& part : c.message_has) EXPECT_THAT(msg, HasSubstr(part));
  }
}

TEST(SafetensorsSet, MissingFiles) {
  test::ScratchDir dir;
  EXPECT_THAT(error_of([&] { SafetensorsSet::open_dir(dir.path()); }),
              AllOf(HasSubstr(dir.path().string()), HasSubstr("no model.safetensors or model.safetensors.index.json")));
  EXPECT_THAT(error_of([&] { SafetensorsSet::open_dir(dir / "nope"); }),
              AllOf(HasSubstr("nope"), HasSubstr("not a directory")));
  EXPECT_THAT(error_of([&] { SafetensorsFile::open(dir / "nope.safetensors"); }),
              AllOf(HasSubstr("nope.safetensors"), HasSubstr("cannot open")));
  EXPECT_THAT(error_of([&] { SafetensorsFile::open(dir.path()); }), HasSubstr("not a regular file"));
}

}  // namespace
}  // namespace m3
