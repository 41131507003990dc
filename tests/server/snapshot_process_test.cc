// SIGTERM with a persistent store, as an operator sees it: m3serve processes on one
// snapshot directory; a session waiting between turns when the first one gets SIGTERM
// ends with UNAVAILABLE and the trailing metadata m3-snapshot-id, and a second m3serve
// process resumes it and answers its next turn as the session uninterrupted does. And
// m3cli's snapshot commands against such a process.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "m3serve.grpc.pb.h"

extern char** environ;

namespace {

namespace v1 = ::m3serve::v1;
namespace fs = std::filesystem;

// One m3serve process on the demo model (CPU) and a snapshot directory; killed at the end
// unless the test stopped it.
class ServerProcess {
 public:
  ServerProcess(const fs::path& scratch, const std::string& name) {
    log_ = scratch / (name + ".log");
    std::vector<std::string> args = {M3_TEST_M3SERVE,
                                     "--backend", "cpu", "--listen", "127.0.0.1:0", "--metrics-listen", "",
                                     "--demo-model-dir", (scratch / "demo").string(), "--shutdown-grace-s", "5",
                                     "--snapshot-store", "dir:" + (scratch / "snapshots").string()};
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    EXPECT_EQ(posix_spawn(&pid_, M3_TEST_M3SERVE, &actions, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&actions);
    const std::string marker = "serving m3serve.v1.M3Serve on 127.0.0.1:";
    for (int i = 0; i < 3000; ++i) {
      const std::string log = read_log();
      if (const size_t at = log.find(marker); at != std::string::npos) {
        port_ = std::stoi(log.substr(at + marker.size()));
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(port_), grpc::InsecureChannelCredentials());
    stub_ = v1::M3Serve::NewStub(channel_);
  }
  ~ServerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  bool serving() const { return port_ > 0; }
  int port() const { return port_; }
  v1::M3Serve::Stub& stub() { return *stub_; }
  std::string read_log() const {
    std::ifstream in(log_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  void sigterm() { kill(pid_, SIGTERM); }
  int wait_exit() {
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

 private:
  fs::path log_;
  pid_t pid_ = -1;
  int port_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::M3Serve::Stub> stub_;
};

class Session {
 public:
  explicit Session(v1::M3Serve::Stub& stub, const std::string& resume = "") {
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    stream = stub.Converse(&ctx);
    v1::ConverseRequest config;
    config.mutable_config()->set_max_new_tokens(8);
    config.mutable_config()->mutable_sampling()->set_temperature(0.9f);
    config.mutable_config()->mutable_sampling()->set_seed(77);
    config.mutable_config()->set_resume_snapshot_id(resume);
    stream->Write(config);
  }
  std::vector<int32_t> turn(const std::vector<int32_t>& input) {
    v1::ConverseRequest in, end;
    for (int32_t t : input) in.mutable_input()->add_ids(t);
    end.mutable_end_turn();
    stream->Write(in);
    stream->Write(end);
    std::vector<int32_t> reply;
    v1::ConverseResponse response;
    while (stream->Read(&response) && !response.has_turn_finished())
      for (int32_t t : response.tokens().ids()) reply.push_back(t);
    return reply;
  }
  grpc::Status finish() {
    stream->WritesDone();
    v1::ConverseResponse response;
    while (stream->Read(&response)) {
    }
    return stream->Finish();
  }

  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ConverseRequest, v1::ConverseResponse>> stream;
};

TEST(SnapshotProcess, SigtermSavesASessionBetweenTurnsAndANewProcessResumesItExactly) {
  const fs::path scratch = fs::temp_directory_path() / ("m3serve-snapshot-process-" + std::to_string(getpid()));
  fs::create_directories(scratch);
  const std::vector<std::vector<int32_t>> turns = {{4, 5, 6}, {70, 71}, {200, 201, 202}};
  std::vector<std::vector<int32_t>> uninterrupted;
  std::string id;
  {
    ServerProcess first(scratch, "first");
    ASSERT_TRUE(first.serving()) << first.read_log();
    {
      Session s(first.stub());
      for (const auto& t : turns) uninterrupted.push_back(s.turn(t));
      ASSERT_TRUE(s.finish().ok());
    }
    Session s(first.stub());
    EXPECT_EQ(s.turn(turns[0]), uninterrupted[0]);
    EXPECT_EQ(s.turn(turns[1]), uninterrupted[1]);
    first.sigterm();
    v1::ConverseResponse response;
    while (s.stream->Read(&response)) {
    }
    const grpc::Status status = s.stream->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
    const auto& trailers = s.ctx.GetServerTrailingMetadata();
    const auto found = trailers.find("m3-snapshot-id");
    ASSERT_NE(found, trailers.end()) << status.error_message() << "\n" << first.read_log();
    id = std::string(found->second.data(), found->second.size());
    EXPECT_EQ(first.wait_exit(), 0);
  }
  ServerProcess second(scratch, "second");
  ASSERT_TRUE(second.serving()) << second.read_log();
  Session resumed(second.stub(), id);
  EXPECT_EQ(resumed.turn(turns[2]), uninterrupted[2]);
  EXPECT_TRUE(resumed.finish().ok());
  std::error_code ec;
  fs::remove_all(scratch, ec);
}

// m3cli with `args` (shell words); its exit status and stdout (stderr into `err`).
int m3cli(const fs::path& scratch, const std::string& args, std::string* out, std::string* err) {
  const fs::path o = scratch / "cli.out", e = scratch / "cli.err";
  const int status = std::system((std::string(M3_TEST_M3CLI) + " " + args + " >" + o.string() + " 2>" + e.string()).c_str());
  auto slurp = [](const fs::path& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  *out = slurp(o);
  *err = slurp(e);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(SnapshotProcess, M3cliStoresAPrefixAndGeneratesFromItAsFromTheWholePrompt) {
  const fs::path scratch = fs::temp_directory_path() / ("m3serve-snapshot-cli-" + std::to_string(getpid()));
  fs::create_directories(scratch);
  ServerProcess server(scratch, "server");
  ASSERT_TRUE(server.serving()) << server.read_log();
  const std::string at = "--server 127.0.0.1:" + std::to_string(server.port()) + " ";
  std::string out, err;
  ASSERT_EQ(m3cli(scratch, at + "create-snapshot --ids 1,2,3,4,5,6,7,8,9,10", &out, &err), 0) << err;
  std::istringstream line(out);
  std::string word, id, tokens_word;
  uint64_t tokens = 0;
  line >> word >> id >> tokens_word >> tokens;
  ASSERT_EQ(word, "snapshot_id") << out;
  EXPECT_EQ(tokens, 10u) << out;

  std::string whole, from_prefix;
  ASSERT_EQ(m3cli(scratch, at + "generate --ids 1,2,3,4,5,6,7,8,9,10,11,12 --max-new-tokens 16 --print ids", &whole,
                  &err), 0) << err;
  ASSERT_EQ(m3cli(scratch, at + "generate --prefix-snapshot-id " + id + " --ids 11,12 --max-new-tokens 16 --print ids",
                  &from_prefix, &err), 0) << err;
  EXPECT_EQ(from_prefix, whole);
  EXPECT_EQ(std::count(whole.begin(), whole.end(), ' '), 15) << whole;  // 16 ids

  ASSERT_EQ(m3cli(scratch, at + "get-snapshot --id " + id, &out, &err), 0) << err;
  EXPECT_EQ(out.rfind("snapshot_id " + id + " tokens 10 bytes ", 0), 0u) << out;
  ASSERT_EQ(m3cli(scratch, at + "delete-snapshot --id " + id, &out, &err), 0) << err;
  EXPECT_EQ(m3cli(scratch, at + "get-snapshot --id " + id, &out, &err), 1);
  EXPECT_NE(err.find("GetSnapshot failed: NOT_FOUND"), std::string::npos) << err;
  EXPECT_EQ(m3cli(scratch, at + "get-snapshot", &out, &err), 2);
  EXPECT_NE(err.find("get-snapshot needs --id"), std::string::npos) << err;
  std::error_code ec;
  fs::remove_all(scratch, ec);
}

}  // namespace
