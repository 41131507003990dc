// Snapshots end to end over gRPC (CPU backend, the tiny random model): a Generate from a
// stored prefix equals the whole prompt read from scratch (greedy and seeded sampling),
// also after a restart with dir: and between two servers sharing one Redis; a Converse
// session saved after turn 2 and resumed in a new session answers turn 3 as the
// uninterrupted one; and each error's status and message.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "server/snapshot_service.h"
#include "server_test_support.h"
#include "snapshot_test_support.h"

namespace m3::test {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

const std::vector<int32_t> kPrefix = {5, 17, 99, 3, 42, 7, 250, 1, 64, 8};
const std::vector<int32_t> kRest = {11, 12, 13};

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct Created {
  grpc::Status status;
  v1::SnapshotInfo info;
};

Created create_snapshot(v1::M3Serve::Stub& stub, const std::vector<int32_t>& prompt, const std::string& base = "") {
  v1::CreateSnapshotRequest request;
  request.mutable_prompt_ids();
  for (int32_t id : prompt) request.mutable_prompt_ids()->add_ids(id);
  request.set_base_snapshot_id(base);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  Created c;
  c.status = stub.CreateSnapshot(&ctx, request, &c.info);
  return c;
}

Created get_snapshot(v1::M3Serve::Stub& stub, const std::string& id, bool remove = false) {
  v1::SnapshotRef ref;
  ref.set_snapshot_id(id);
  grpc::ClientContext ctx;
  Created c;
  c.status = remove ? stub.DeleteSnapshot(&ctx, ref, &c.info) : stub.GetSnapshot(&ctx, ref, &c.info);
  return c;
}

v1::GenerateRequest from_prefix(const std::string& id, const std::vector<int32_t>& rest, uint32_t max_new,
                                float temperature = 0, uint64_t seed = 0) {
  v1::GenerateRequest r = generate_request(rest, max_new);
  r.set_prefix_snapshot_id(id);
  r.mutable_sampling()->set_temperature(temperature);
  r.mutable_sampling()->set_seed(seed);
  return r;
}

ServerConfig config_with_store(const std::string& store) {
  ServerConfig c = test_config();
  c.snapshot_store = store;
  return c;
}

TEST(SnapshotServing, GenerateFromAPrefixEqualsTheWholePromptGreedy) {
  TestServer server;
  const Created c = create_snapshot(*server.stub, kPrefix);
  ASSERT_TRUE(c.status.ok()) << c.status.error_message();
  EXPECT_THAT(c.info.snapshot_id(), StartsWith("snap-"));
  EXPECT_EQ(c.info.tokens(), kPrefix.size());
  const GenerateResult r = generate(*server.stub, from_prefix(c.info.snapshot_id(), kRest, 20));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, engine_generate(concat(kPrefix, kRest), 20));
  EXPECT_EQ(r.finish.timings().prompt_tokens(), kRest.size());  // only the rest was read
  // The snapshot is still there for the next request, and says what it holds.
  const Created info = get_snapshot(*server.stub, c.info.snapshot_id());
  ASSERT_TRUE(info.status.ok()) << info.status.error_message();
  EXPECT_EQ(info.info.tokens(), kPrefix.size());
  EXPECT_EQ(info.info.bytes(), c.info.bytes());
  EXPECT_EQ(generate(*server.stub, from_prefix(c.info.snapshot_id(), kRest, 20)).tokens, r.tokens);
}

TEST(SnapshotServing, GenerateFromAPrefixEqualsTheWholePromptSampledWithTheSameSeed) {
  TestServer server;
  const Created c = create_snapshot(*server.stub, kPrefix);
  ASSERT_TRUE(c.status.ok()) << c.status.error_message();
  SamplingParams sampling;
  sampling.temperature = 1.1f;
  sampling.seed = 4242;
  const GenerateResult r = generate(*server.stub, from_prefix(c.info.snapshot_id(), kRest, 30, 1.1f, 4242));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, engine_generate(concat(kPrefix, kRest), 30, sampling));
  // Not the greedy answer: the draws came from the seed and the counter the state carries.
  EXPECT_NE(r.tokens, engine_generate(concat(kPrefix, kRest), 30));
}

TEST(SnapshotServing, ASnapshotOnABaseEqualsBothPromptsRead) {
  TestServer server;
  const Created base = create_snapshot(*server.stub, {kPrefix.begin(), kPrefix.begin() + 4});
  ASSERT_TRUE(base.status.ok());
  const Created top = create_snapshot(*server.stub, {kPrefix.begin() + 4, kPrefix.end()}, base.info.snapshot_id());
  ASSERT_TRUE(top.status.ok()) << top.status.error_message();
  EXPECT_EQ(top.info.tokens(), kPrefix.size());
  EXPECT_EQ(generate(*server.stub, from_prefix(top.info.snapshot_id(), kRest, 16)).tokens,
            engine_generate(concat(kPrefix, kRest), 16));
}

TEST(SnapshotServing, ADirectoryStoreSurvivesARestart) {
  TempDir dir("snapdir");
  std::string id;
  {
    TestServer first(config_with_store("dir:" + dir.path()));
    const Created c = create_snapshot(*first.stub, kPrefix);
    ASSERT_TRUE(c.status.ok()) << c.status.error_message();
    id = c.info.snapshot_id();
  }
  TestServer second(config_with_store("dir:" + dir.path()));
  const GenerateResult r = generate(*second.stub, from_prefix(id, kRest, 20));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, engine_generate(concat(kPrefix, kRest), 20));
}

TEST(SnapshotServing, TwoServersShareOneRedis) {
  RedisServer redis;
  if (!redis.running()) GTEST_SKIP() << redis.why_not();
  TestServer a(config_with_store(redis.url())), b(config_with_store(redis.url()));
  const Created c = create_snapshot(*a.stub, kPrefix);
  ASSERT_TRUE(c.status.ok()) << c.status.error_message();
  SamplingParams sampling;
  sampling.temperature = 0.8f;
  sampling.seed = 7;
  const GenerateResult r = generate(*b.stub, from_prefix(c.info.snapshot_id(), kRest, 20, 0.8f, 7));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, engine_generate(concat(kPrefix, kRest), 20, sampling));
  ASSERT_TRUE(get_snapshot(*b.stub, c.info.snapshot_id(), /*remove=*/true).status.ok());
  EXPECT_EQ(get_snapshot(*a.stub, c.info.snapshot_id()).status.error_code(), grpc::StatusCode::NOT_FOUND);
}

// A Converse client that sends turns and reads replies (and SnapshotSaved) in order.
class Session {
 public:
  Session(v1::M3Serve::Stub& stub, const std::string& resume = "", float temperature = 0.7f) {
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    stream_ = stub.Converse(&ctx_);
    v1::ConverseRequest config;
    config.mutable_config()->set_max_new_tokens(10);
    config.mutable_config()->mutable_sampling()->set_temperature(temperature);
    config.mutable_config()->mutable_sampling()->set_seed(31);
    config.mutable_config()->set_resume_snapshot_id(resume);
    stream_->Write(config);
  }
  std::vector<int32_t> turn(const std::vector<int32_t>& input) {
    v1::ConverseRequest in, end;
    for (int32_t id : input) in.mutable_input()->add_ids(id);
    end.mutable_end_turn();
    stream_->Write(in);
    stream_->Write(end);
    std::vector<int32_t> reply;
    v1::ConverseResponse response;
    while (stream_->Read(&response)) {
      if (response.has_turn_finished()) break;
      for (int32_t id : response.tokens().ids()) reply.push_back(id);
    }
    return reply;
  }
  std::string save() {
    v1::ConverseRequest save;
    save.mutable_save_snapshot();
    stream_->Write(save);
    v1::ConverseResponse response;
    if (!stream_->Read(&response)) return "";
    return response.snapshot_saved().snapshot_id();
  }
  grpc::Status finish() {
    stream_->WritesDone();
    v1::ConverseResponse response;
    while (stream_->Read(&response)) {
    }
    return stream_->Finish();
  }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ConverseRequest, v1::ConverseResponse>> stream_;
};

TEST(SnapshotServing, AConverseSessionSavedAfterTurnTwoResumesTurnThreeExactly) {
  TestServer server;
  const std::vector<std::vector<int32_t>> turns = {{5, 6, 7}, {100, 200}, {30, 31, 32, 33}};
  std::vector<std::vector<int32_t>> uninterrupted;
  {
    Session s(*server.stub);
    for (const auto& t : turns) uninterrupted.push_back(s.turn(t));
    ASSERT_TRUE(s.finish().ok());
  }
  std::string id;
  {
    Session s(*server.stub);
    EXPECT_EQ(s.turn(turns[0]), uninterrupted[0]);
    EXPECT_EQ(s.turn(turns[1]), uninterrupted[1]);
    id = s.save();
    ASSERT_THAT(id, StartsWith("snap-"));
    ASSERT_TRUE(s.finish().ok());
  }
  Session resumed(*server.stub, id);
  EXPECT_EQ(resumed.turn(turns[2]), uninterrupted[2]);
  ASSERT_TRUE(resumed.finish().ok());
}

TEST(SnapshotServing, SnapshotSavedComesBeforeTheRepliesToInputSentAfterIt) {
  TestServer server;
  grpc::ClientContext ctx;
  auto stream = server.stub->Converse(&ctx);
  v1::ConverseRequest config, in, end, save, in2;
  config.mutable_config()->set_max_new_tokens(4);
  for (int32_t t : {5, 6, 7}) in.mutable_input()->add_ids(t);
  end.mutable_end_turn();
  save.mutable_save_snapshot();
  for (int32_t t : {8, 9}) in2.mutable_input()->add_ids(t);
  // Everything at once: turn 1, the save, turn 2.
  for (const auto* m : {&config, &in, &end, &save, &in2, &end}) ASSERT_TRUE(stream->Write(*m));
  stream->WritesDone();
  std::vector<std::string> events;
  v1::ConverseResponse response;
  while (stream->Read(&response)) {
    if (response.has_snapshot_saved()) events.push_back("saved");
    if (response.has_turn_finished()) events.push_back("turn" + std::to_string(response.turn_finished().turn()));
  }
  ASSERT_TRUE(stream->Finish().ok());
  EXPECT_EQ(events, (std::vector<std::string>{"turn0", "saved", "turn1"}));
}

TEST(SnapshotServing, AShutdownSavesASessionBetweenTurnsAndANewServerResumesIt) {
  TempDir dir("snapshutdown");
  const std::vector<std::vector<int32_t>> turns = {{9, 8, 7}, {60, 61}, {1, 2, 3}};
  std::vector<std::vector<int32_t>> uninterrupted;
  {
    TestServer server;
    Session s(*server.stub);
    for (const auto& t : turns) uninterrupted.push_back(s.turn(t));
    ASSERT_TRUE(s.finish().ok());
  }
  std::string id;
  {
    ServerConfig config = config_with_store("dir:" + dir.path());
    config.shutdown_grace_s = 5;
    TestServer server(config);
    grpc::ClientContext ctx;
    auto stream = server.stub->Converse(&ctx);
    v1::ConverseRequest config_message, in, end;
    config_message.mutable_config()->set_max_new_tokens(10);
    config_message.mutable_config()->mutable_sampling()->set_temperature(0.7f);
    config_message.mutable_config()->mutable_sampling()->set_seed(31);
    stream->Write(config_message);
    for (int k = 0; k < 2; ++k) {
      in.mutable_input()->clear_ids();
      for (int32_t t : turns[k]) in.mutable_input()->add_ids(t);
      end.mutable_end_turn();
      stream->Write(in);
      stream->Write(end);
      std::vector<int32_t> reply;
      v1::ConverseResponse response;
      while (stream->Read(&response) && !response.has_turn_finished())
        for (int32_t t : response.tokens().ids()) reply.push_back(t);
      EXPECT_EQ(reply, uninterrupted[k]);
    }
    std::thread stopper([&] { server.app->shutdown(std::chrono::seconds(5)); });
    v1::ConverseResponse response;
    while (stream->Read(&response)) {
    }
    const grpc::Status status = stream->Finish();
    stopper.join();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
    const auto& trailers = ctx.GetServerTrailingMetadata();
    const auto found = trailers.find("m3-snapshot-id");
    ASSERT_NE(found, trailers.end()) << status.error_message();
    id = std::string(found->second.data(), found->second.size());
    EXPECT_EQ(status.error_message(), "the server is shutting down; the session was saved as snapshot " + id +
                                          " (trailing metadata m3-snapshot-id): resume it with "
                                          "SessionConfig.resume_snapshot_id");
  }
  TestServer next(config_with_store("dir:" + dir.path()));
  Session resumed(*next.stub, id);
  EXPECT_EQ(resumed.turn(turns[2]), uninterrupted[2]);
  ASSERT_TRUE(resumed.finish().ok());
}

// --- errors --------------------------------------------------------------------------

TEST(SnapshotErrors, AnUnknownIdIsNotFound) {
  TestServer server;
  const GenerateResult r = generate(*server.stub, from_prefix("snap-nothere", kRest, 5));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(r.status.error_message(),
            "prefix_snapshot_id: snapshot snap-nothere not found in the snapshot store memory (never stored, deleted, "
            "expired or evicted)");
  const Created get = get_snapshot(*server.stub, "snap-nothere");
  EXPECT_EQ(get.status.error_code(), grpc::StatusCode::NOT_FOUND);
  const Created del = get_snapshot(*server.stub, "snap-nothere", true);
  EXPECT_EQ(del.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(del.status.error_message(), "snapshot snap-nothere not found in the snapshot store memory");
  const Created base = create_snapshot(*server.stub, kRest, "snap-nothere");
  EXPECT_EQ(base.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(base.status.error_message(), StartsWith("base_snapshot_id: snapshot snap-nothere not found"));
}

TEST(SnapshotErrors, AnotherModelsSnapshotIsAFailedPreconditionNamingBothFingerprints) {
  TempDir dir("snapother"), other_model("othermodel");
  write_random_model(demo_model_config(), 8, DType::F32, other_model.path());  // other weights
  std::string id;
  {
    ServerConfig c = config_with_store("dir:" + dir.path());
    c.model = other_model.path();
    TestServer other(c);
    const Created created = create_snapshot(*other.stub, kPrefix);
    ASSERT_TRUE(created.status.ok());
    id = created.info.snapshot_id();
  }
  TestServer server(config_with_store("dir:" + dir.path()));
  const GenerateResult r = generate(*server.stub, from_prefix(id, kRest, 5));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  const std::string mine = server.app->snapshots()->fingerprint().to_string();
  EXPECT_THAT(r.status.error_message(), HasSubstr("snapshot " + id + ": snapshot made by another model or engine: it has ["));
  EXPECT_THAT(r.status.error_message(), HasSubstr("], this server runs [" + mine + "]"));
  // Serving goes on.
  EXPECT_TRUE(generate(*server.stub, generate_request(kRest, 3)).status.ok());
}

TEST(SnapshotErrors, ADamagedSnapshotIsDataLoss) {
  TempDir dir("snapbad");
  TestServer server(config_with_store("dir:" + dir.path()));
  const Created c = create_snapshot(*server.stub, kPrefix);
  ASSERT_TRUE(c.status.ok());
  const std::string file = dir.path() + "/" + c.info.snapshot_id() + ".m3snap";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    f.put('\x5a');
  }
  const GenerateResult r = generate(*server.stub, from_prefix(c.info.snapshot_id(), kRest, 5));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_EQ(r.status.error_message(), "prefix_snapshot_id: snapshot " + c.info.snapshot_id() +
                                          ": snapshot damaged: its state does not match its checksum (corrupted)");
  std::filesystem::resize_file(file, 50);
  const GenerateResult cut = generate(*server.stub, from_prefix(c.info.snapshot_id(), kRest, 5));
  EXPECT_EQ(cut.status.error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_THAT(cut.status.error_message(), HasSubstr("truncated: 50 bytes, shorter than its 104-byte header"));
}

TEST(SnapshotErrors, AnUnreachableStoreIsUnavailableAndServingGoesOn) {
  const int port = free_loopback_port();
  TestServer server(config_with_store("redis://127.0.0.1:" + std::to_string(port)));
  const Created c = create_snapshot(*server.stub, kPrefix);
  EXPECT_EQ(c.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(c.status.error_message(),
              StartsWith("snapshot store redis://127.0.0.1:" + std::to_string(port) + " is unreachable: "));
  const GenerateResult r = generate(*server.stub, from_prefix("snap-x", kRest, 5));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  const GenerateResult plain = generate(*server.stub, generate_request(kRest, 5));
  ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
  EXPECT_EQ(plain.tokens, engine_generate(kRest, 5));
}

// A store that takes connections and never answers (a Redis hung or behind a dropped
// route): each call waits out the store's timeout.
class SilentListener {
 public:
  SilentListener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::listen(fd_, 64);  // never accepted: the kernel completes the handshakes, nobody reads
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
  }
  ~SilentListener() { ::close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST(SnapshotErrors, RequestsThatDoNotNeedAHungStoreAreServedWhileOthersWaitForIt) {
  SilentListener silent;
  TestServer server(config_with_store("redis://127.0.0.1:" + std::to_string(silent.port())));
  // Generate from a prefix, Converse resuming, CreateSnapshot on a base: two of each.
  constexpr int kWaiting = 6;
  std::vector<std::thread> waiting;
  std::vector<grpc::StatusCode> codes(kWaiting);
  for (int k = 0; k < kWaiting; ++k) {
    waiting.emplace_back([&, k] {
      if (k % 3 == 0) {
        codes[k] = generate(*server.stub, from_prefix("snap-x", kRest, 5)).status.error_code();
      } else if (k % 3 == 1) {
        Session resumed(*server.stub, "snap-y");
        codes[k] = resumed.finish().error_code();
      } else {
        codes[k] = create_snapshot(*server.stub, kRest, "snap-z").status.error_code();
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // they are all waiting on the store now
  const auto start = std::chrono::steady_clock::now();
  const GenerateResult plain = generate(*server.stub, generate_request(kRest, 5));
  const double waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
  EXPECT_EQ(plain.tokens, engine_generate(kRest, 5));
  // Well under one store timeout (2 s): nothing it needs waits behind the store.
  EXPECT_LT(waited_s, 1.0);
  for (auto& t : waiting) t.join();
  for (int k = 0; k < kWaiting; ++k) EXPECT_EQ(codes[k], grpc::StatusCode::UNAVAILABLE) << "call " << k;
}

TEST(SnapshotErrors, ASaveTheStoreCannotTakeEndsTheSessionWithTheStoresError) {
  const int port = free_loopback_port();
  TestServer server(config_with_store("redis://127.0.0.1:" + std::to_string(port)));
  Session s(*server.stub);
  s.turn({1, 2, 3});
  EXPECT_EQ(s.save(), "");  // no SnapshotSaved: the stream ends
  const grpc::Status status = s.finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(status.error_message(),
              StartsWith("save_snapshot: snapshot store redis://127.0.0.1:" + std::to_string(port) + " is unreachable"));
}

TEST(SnapshotErrors, OverCapacityIsResourceExhausted) {
  ServerConfig config = test_config();
  config.snapshot_capacity_bytes = 1000;  // less than one state of the tiny model
  TestServer server(config);
  const Created c = create_snapshot(*server.stub, kPrefix);
  EXPECT_EQ(c.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(c.status.error_message(), HasSubstr("snapshot store memory is full: a snapshot of "));
  EXPECT_THAT(c.status.error_message(), HasSubstr("bytes is over the whole snapshot_capacity_bytes (1000)"));
}

TEST(SnapshotErrors, ABadRequestIsAnInvalidArgument) {
  TestServer server;
  const Created empty = create_snapshot(*server.stub, {});
  EXPECT_EQ(empty.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(empty.status.error_message(),
            "the prompt is empty and there is no base_snapshot_id: a snapshot needs at least one token");
  const Created bad = create_snapshot(*server.stub, {1, 100000});
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  const Created bad_id = get_snapshot(*server.stub, "no spaces");
  EXPECT_EQ(bad_id.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

}  // namespace
}  // namespace m3::test
