// m3cli and m3bench serve against a scripted in-process M3Serve: what they print, how
// they stream, and how they fail. The real server is covered by the integration tests.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "m3serve.grpc.pb.h"
#include "server/tools/bench_serve.h"
#include "server/tools/client_support.h"

namespace m3 {
namespace {

constexpr uint32_t kVocab = 100;

// Generate: token i of the reply is (sum of prompt ids + i) % kVocab, one per message
// with the text "t<id> " (or text_of_id's),
// ending early after a stop id; request ids ending in refused_id_suffix are refused as
// over capacity.
// Converse: each turn replies with (turn*10 + number of
// input ids) repeated max_new_tokens times. Text prompts are refused (no tokenizer).
class ScriptedService final : public m3serve::v1::M3Serve::Service {
 public:
  char refused_id_suffix = 0;
  std::map<int32_t, std::string> text_of_id;

  grpc::Status Generate(grpc::ServerContext*, const m3serve::v1::GenerateRequest* request,
                        grpc::ServerWriter<m3serve::v1::GenerateResponse>* writer) override {
    if (request->has_prompt_text()) {
      return {grpc::StatusCode::INVALID_ARGUMENT, "prompt_text needs a tokenizer; none is loaded"};
    }
    if (refused_id_suffix != 0 && !request->request_id().empty() &&
        request->request_id().back() == refused_id_suffix) {
      return {grpc::StatusCode::RESOURCE_EXHAUSTED, "queue full"};
    }
    const auto& prompt = request->prompt_ids().ids();
    const int64_t base = std::accumulate(prompt.begin(), prompt.end(), int64_t{0});
    m3serve::v1::FinishReason reason = m3serve::v1::FINISH_REASON_LENGTH;
    uint32_t made = 0;
    while (made < request->max_new_tokens()) {
      const int32_t id = static_cast<int32_t>((base + made) % kVocab);
      m3serve::v1::GenerateResponse response;
      response.mutable_tokens()->add_ids(id);
      const auto text = text_of_id.find(id);
      response.mutable_tokens()->set_text(text != text_of_id.end() ? text->second : "t" + std::to_string(id) + " ");
      writer->Write(response);
      ++made;
      const auto& stops = request->stop_token_ids();
      if (std::find(stops.begin(), stops.end(), id) != stops.end()) {
        reason = m3serve::v1::FINISH_REASON_STOP;
        break;
      }
    }
    m3serve::v1::GenerateResponse last;
    auto* finished = last.mutable_finished();
    finished->set_request_id(request->request_id().empty() ? "made-up" : request->request_id());
    finished->set_reason(reason);
    finished->set_seed(request->sampling().has_seed() ? request->sampling().seed() : 4242);
    finished->mutable_timings()->set_prompt_tokens(prompt.size());
    finished->mutable_timings()->set_generated_tokens(made);
    writer->Write(last);
    return grpc::Status::OK;
  }

  grpc::Status Converse(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<m3serve::v1::ConverseResponse, m3serve::v1::ConverseRequest>* stream)
      override {
    uint32_t max_new_tokens = 2;
    uint64_t seed = 0;
    uint32_t turn = 0;
    int inputs = 0;
    m3serve::v1::ConverseRequest request;
    while (stream->Read(&request)) {
      if (request.has_config()) {
        max_new_tokens = request.config().max_new_tokens();
        seed = request.config().sampling().has_seed() ? request.config().sampling().seed() : 4343;
      } else if (request.has_input()) {
        inputs += request.input().ids_size();
      } else if (request.has_input_text()) {
        return {grpc::StatusCode::INVALID_ARGUMENT, "input_text needs a tokenizer; none is loaded"};
      } else if (request.has_end_turn()) {
        for (uint32_t i = 0; i < max_new_tokens; ++i) {
          m3serve::v1::ConverseResponse response;
          response.mutable_tokens()->add_ids(static_cast<int32_t>(turn * 10 + inputs));
          stream->Write(response);
        }
        m3serve::v1::ConverseResponse done;
        done.mutable_turn_finished()->set_turn(turn);
        done.mutable_turn_finished()->set_reason(m3serve::v1::FINISH_REASON_LENGTH);
        done.mutable_turn_finished()->set_seed(seed);
        stream->Write(done);
        ++turn;
        inputs = 0;
      }
    }
    return grpc::Status::OK;
  }

  grpc::Status GetModelInfo(grpc::ServerContext*, const m3serve::v1::GetModelInfoRequest*,
                            m3serve::v1::ModelInfo* info) override {
    info->set_model_name("scripted");
    info->set_backend("cpu");
    info->set_vocab_size(kVocab);
    info->set_padded_vocab_size(128);
    info->set_n_layer(2);
    info->set_max_batch(4);
    auto* units = info->mutable_vocab()->mutable_speech_units();
    units->set_first_id(60);
    units->set_codebooks(2);
    units->set_units_per_codebook(16);
    units->add_frame_order(1);
    units->add_frame_order(0);
    auto* control = info->mutable_vocab()->add_controls();
    control->set_name("end_of_turn");
    control->set_id(99);
    return grpc::Status::OK;
  }
};

class ScriptedServer {
 public:
  ScriptedServer() {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~ScriptedServer() { server_->Shutdown(); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  grpc::Server& server() { return *server_; }
  ScriptedService& service() { return service_; }

 private:
  ScriptedService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// What a tool run as a program left: its exit status, stdout and stderr.
struct ToolRun {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// A new directory under the temp dir (empty string, and a test failure, if it cannot be
// made); the caller removes it. Files of a run go there: ctest runs tests in parallel, each
// in its own process, so shared names in the temp dir would mix their outputs, and a file
// an earlier run left would pass for one this run never wrote.
std::string make_own_dir(const std::string& prefix) {
  std::string dir = ::testing::TempDir() + "/" + prefix + "-XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) {
    ADD_FAILURE() << "mkdtemp " << dir << ": " << std::strerror(errno);
    return {};
  }
  return dir;
}

// Runs the program `exe` with `args` (shell words), stdin from `input`.
ToolRun run_tool(const char* exe, const std::string& args, const std::string& input = "") {
  const std::string dir = make_own_dir("tool");
  if (dir.empty()) return {};
  const std::string in = dir + "/in", out = dir + "/out", err = dir + "/err";
  std::ofstream(in) << input;
  const int status = std::system((std::string(exe) + " " + args + " <" + in + " >" + out + " 2>" + err).c_str());
  auto slurp = [](const std::string& path) {
    std::ifstream file(path);
    return std::string(std::istreambuf_iterator<char>(file), {});
  };
  ToolRun run{WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
  std::filesystem::remove_all(dir);
  return run;
}

ToolRun m3cli(const std::string& args, const std::string& input = "") { return run_tool(M3_TEST_M3CLI, args, input); }

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(M3cli, GenerateStreamsTheTokensAndPrintsTimings) {
  ScriptedServer server;
  const ToolRun run = m3cli("--server " + server.address() + " generate --ids 1,2,3 --max-new-tokens 4 --seed 9");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.out, "6 7 8 9\n");
  EXPECT_TRUE(contains(run.err, "finished: length, request made-up, seed 9")) << run.err;
  EXPECT_TRUE(contains(run.err, "prompt 3 tokens, generated 4 tokens")) << run.err;
  EXPECT_TRUE(contains(run.err, "client: time to first token")) << run.err;
}

TEST(M3cli, PrintChoosesTextOrIds) {
  ScriptedServer server;
  ToolRun run = m3cli("--server " + server.address() + " generate --ids 1 --max-new-tokens 3 --print text");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.out, "t1 t2 t3 \n");
  run = m3cli("--server " + server.address() + " generate --ids 1 --max-new-tokens 3 --print words");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_TRUE(contains(run.err, "--print: 'words' is not auto, ids or text")) << run.err;
}

TEST(M3cli, GenerateStopsAtAStopToken) {
  ScriptedServer server;
  const ToolRun run = m3cli("generate --server=" + server.address() + " --ids '5 5' --max-new-tokens 9 --stop 12,99");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.out, "10 11 12\n");
  EXPECT_TRUE(contains(run.err, "finished: stop")) << run.err;
}

TEST(M3cli, AnRpcErrorIsPrintedWithItsStatusAndFails) {
  ScriptedServer server;
  const ToolRun run = m3cli("--server " + server.address() + " generate --text 'hello there'");
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_TRUE(contains(run.err, "m3cli: Generate failed: INVALID_ARGUMENT: prompt_text needs a tokenizer"))
      << run.err;
}

TEST(M3cli, ConverseRepliesToEachLineOfStdin) {
  ScriptedServer server;
  const ToolRun run = m3cli("--server " + server.address() + " converse --max-new-tokens 2",
                        "1,2,3\n\n4 5\n");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.out, "3 3\n12 12\n");  // turn 0: 3 inputs; the blank line is skipped; turn 1: 2
  // The seed the server reports (it drew one: the session sets none), as Generate's is.
  EXPECT_TRUE(contains(run.err, "turn 0 finished: length, seed 4343")) << run.err;
  EXPECT_TRUE(contains(run.err, "turn 1 finished: length, seed 4343")) << run.err;
}

TEST(M3cli, ConverseReportsAServerThatEndsTheSession) {
  ScriptedServer server;
  const ToolRun run = m3cli("--server " + server.address() + " converse", "some words\n");
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_TRUE(contains(run.err, "Converse failed: INVALID_ARGUMENT: input_text needs a tokenizer"))
      << run.err;
}

// --input says what a line is: "2024" as text reaches the server as input_text (which
// the scripted server refuses: it has no tokenizer); with --input ids a line that is not
// ids is not sent and the session goes on. Text that is not UTF-8 is never sent (protobuf
// would drop the message and the server take the stream as closed).
TEST(M3cli, ConverseInputModeAndUtf8) {
  ScriptedServer server;
  ToolRun run = m3cli("--server " + server.address() + " converse --input text", "2024\n");
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_TRUE(contains(run.err, "input_text needs a tokenizer")) << run.err;
  run = m3cli("--server " + server.address() + " converse --input ids --max-new-tokens 2", "hello\n1,2\n");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.out, "2 2\n");
  EXPECT_TRUE(contains(run.err, "m3cli: not sent: ")) << run.err;
  run = m3cli("--server " + server.address() + " converse --max-new-tokens 2", "caf\xe9\n1,2,3\n");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.out, "3 3\n");
  EXPECT_TRUE(contains(run.err, "m3cli: not sent: the line is not valid UTF-8")) << run.err;
  run = m3cli("--server " + server.address() + " generate --text \"$(printf 'caf\\351')\"");
  EXPECT_EQ(run.exit_code, 2) << run.err;
  EXPECT_TRUE(contains(run.err, "--text is not valid UTF-8")) << run.err;
  run = m3cli("--server " + server.address() + " converse --input words");
  EXPECT_EQ(run.exit_code, 2) << run.err;
  EXPECT_TRUE(contains(run.err, "--input: 'words' is not auto, ids or text")) << run.err;
  run = m3cli("--server " + server.address() + " generate --ids 1 --max-new-tokens 2 --allowed units_and_controls");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  run = m3cli("--server " + server.address() + " generate --ids 1 --allowed speech");
  EXPECT_EQ(run.exit_code, 2) << run.err;
  EXPECT_TRUE(contains(run.err, "--allowed: 'speech' is not all, text, text_and_controls, units or units_and_controls"))
      << run.err;
}

TEST(ClientSupport, Utf8IsCheckedStrictly) {
  for (const std::string good : {std::string(""), std::string("plain"), std::string("caf\xc3\xa9"),
                                 std::string("\xf0\x9f\x99\x82"), std::string("\xf4\x8f\xbf\xbf")}) {
    EXPECT_TRUE(client::valid_utf8(good)) << good;
  }
  for (const std::string bad : {std::string("caf\xe9"), std::string("\xc0\xaf"), std::string("\xed\xa0\x80"),
                                std::string("\xf4\x90\x80\x80"), std::string("\xe2\x82"), std::string("\x80"),
                                std::string("\xf8\x88\x80\x80\x80")}) {
    EXPECT_FALSE(client::valid_utf8(bad)) << bad;
  }
}

TEST(ClientSupport, TerminalTextEscapesControlCharacters) {
  using namespace std::string_literals;
  client::TerminalText terminal;
  EXPECT_EQ(terminal.feed("plain caf\xc3\xa9\tline\n"), "plain caf\xc3\xa9\tline\n");
  EXPECT_EQ(terminal.feed("\x1b[2J\r\x07\x7f\x00x"s), "\\x1b[2J\\x0d\\x07\\x7f\\x00x");
  EXPECT_EQ(terminal.feed("a\xc2\x9b" "31m\xc2\xa0"), "a\\u009b31m\xc2\xa0");  // CSI in C1 form; NBSP kept
  // A C1 character split over two pieces, and a lead byte the stream ends on.
  EXPECT_EQ(terminal.feed("x\xc2"), "x");
  EXPECT_EQ(terminal.feed("\x9dy"), "\\u009dy");
  EXPECT_EQ(terminal.feed("z\xc2"), "z");
  EXPECT_EQ(terminal.feed("\xa9"), "\xc2\xa9");
  EXPECT_EQ(terminal.feed("\xc2"), "");
  EXPECT_EQ(terminal.finish(), "\xc2");
  EXPECT_EQ(terminal.finish(), "");
}

// Model text with control characters: piped, m3cli writes it as received; on a terminal
// (a pseudo-terminal from util-linux's `script`), as visible escapes.
TEST(M3cli, TextOnATerminalShowsControlCharactersAsEscapes) {
  ScriptedServer server;
  server.service().text_of_id[6] = "\x1b]0;owned\x07";
  server.service().text_of_id[7] = "\x1b[2J";
  const std::string args = " --server " + server.address() + " generate --ids 1,2,3 --max-new-tokens 3 --print text";
  ToolRun run = m3cli(args);
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.out, "\x1b]0;owned\x07\x1b[2Jt8 \n");
  if (std::system("script -qec true /dev/null >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "util-linux's script cannot open a pseudo-terminal here";
  }
  run = run_tool("script", "-qec '" M3_TEST_M3CLI + args + " 2>/dev/null' /dev/null");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.out, "\\x1b]0;owned\\x07\\x1b[2Jt8 \r\n");
}

TEST(M3cli, InfoPrintsTheModel) {
  ScriptedServer server;
  const ToolRun run = m3cli("--server " + server.address() + " info");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_TRUE(contains(run.out, "model:         scripted\n")) << run.out;
  EXPECT_TRUE(contains(run.out, "vocab:         100 (padded 128)\n")) << run.out;
  EXPECT_TRUE(contains(run.out, "tokenizer:     no\n")) << run.out;
  EXPECT_TRUE(contains(run.out, "vocabulary:    2 codebooks x 16 units at [60, 92), frame order 1 0; controls end_of_turn=99\n"))
      << run.out;
}

TEST(M3cli, HealthFollowsTheServingStatus) {
  ScriptedServer server;
  ToolRun run = m3cli("--server " + server.address() + " health");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.out, "SERVING\n");

  server.server().GetHealthCheckService()->SetServingStatus(false);
  run = m3cli("--server " + server.address() + " health");
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_EQ(run.out, "NOT_SERVING\n");

  run = m3cli("--server " + server.address() + " health --service no.such.Service");
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_TRUE(contains(run.err, "health check failed: NOT_FOUND")) << run.err;
}

TEST(M3cli, AnUnreachableServerIsNamed) {
  // Port 1 on loopback: nothing listens there.
  const ToolRun run = m3cli("--server 127.0.0.1:1 --connect-timeout 0.5 info");
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_TRUE(contains(run.err, "m3cli: cannot reach the server at 127.0.0.1:1")) << run.err;
}

TEST(M3cli, UsageMistakesExitTwoWithTheReason) {
  EXPECT_TRUE(contains(m3cli("").err, "m3cli: no command given"));
  EXPECT_TRUE(contains(m3cli("launch").err, "m3cli: unknown command 'launch'"));
  ToolRun run = m3cli("generate --ids 1,x");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_TRUE(contains(run.err, "'x' is not a token id")) << run.err;
  run = m3cli("generate --ids 1 --text hi");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_TRUE(contains(run.err, "exactly one of --ids or --text")) << run.err;
  run = m3cli("generate --max-new-tokens 3");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_TRUE(contains(run.err, "exactly one of --ids or --text (or neither, starting from a snapshot)")) << run.err;
  run = m3cli("create-snapshot --ids 1 --text hi");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_TRUE(contains(run.err, "create-snapshot needs exactly one of --ids or --text")) << run.err;
  run = m3cli("generate --ids 1 --max-new-tokens 0");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_TRUE(contains(run.err, "--max-new-tokens: 0 is outside")) << run.err;
  run = m3cli("generate --ids 1 --temprature 0.5");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_TRUE(contains(run.err, "unknown option --temprature")) << run.err;
  run = m3cli("info --server");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_TRUE(contains(run.err, "--server needs a value")) << run.err;
}

TEST(M3cli, ReplaysAnySeedTheServerCanReport) {
  // Seeds are uint64: the server draws seeds above INT64_MAX as often as below.
  ScriptedServer server;
  ToolRun run = m3cli("--server " + server.address() +
                     " generate --ids 1 --max-new-tokens 1 --seed 18446744073709551615");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_TRUE(contains(run.err, "seed 18446744073709551615\n")) << run.err;
  run = m3cli("--server " + server.address() +
              " generate --ids 1 --max-new-tokens 1 --seed 9223372036854775808");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_TRUE(contains(run.err, "seed 9223372036854775808\n")) << run.err;

  const std::vector<std::pair<std::string, std::string>> bad = {
      {"-1", "--seed: '-1' is not a non-negative integer"},
      {"+5", "--seed: '+5' is not a non-negative integer"},
      {"5x", "--seed: '5x' is not a non-negative integer"},
      {"''", "--seed: '' is not a non-negative integer"},
      {"18446744073709551616", "--seed: 18446744073709551616 is outside [0, 18446744073709551615]"},
  };
  for (const auto& [value, message] : bad) {
    run = m3cli("--server 127.0.0.1:1 --connect-timeout 0.2 generate --ids 1 --seed " + value);
    EXPECT_EQ(run.exit_code, 2) << value;
    EXPECT_TRUE(contains(run.err, message)) << run.err;
  }
}

TEST(M3cli, TokenIdListsRefuseEmptyItems) {
  // Port 1: nothing listens there; an accepted list would show as "cannot reach" (exit 1).
  const std::string unreachable = "--server 127.0.0.1:1 --connect-timeout 0.2 ";
  for (const std::string& ids : {"1,,3", "1,3,", ",1", "'1, ,3'", "'1 , , 3'"}) {
    const ToolRun run = m3cli(unreachable + "generate --ids " + ids);
    EXPECT_EQ(run.exit_code, 2) << ids;
    EXPECT_TRUE(contains(run.err, "empty item in the token id list")) << ids << ": " << run.err;
  }
  const ToolRun run = m3cli(unreachable + "generate --ids 1 --stop 7,,8");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_TRUE(contains(run.err, "empty item in the token id list '7,,8'")) << run.err;
}

TEST(ParseIdList, SeparatorsAndEmptyItems) {
  EXPECT_EQ(client::parse_id_list("1,2,3"), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(client::parse_id_list(" 1, 2 ,3\t4 "), (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(client::parse_id_list("7"), (std::vector<int32_t>{7}));
  for (const char* text : {"1,,3", "1,3,", ",1", "1, ,3", ",", "1 ,"}) {
    try {
      client::parse_id_list(text);
      ADD_FAILURE() << "'" << text << "' was accepted";
    } catch (const client::UsageError& e) {
      EXPECT_EQ(std::string(e.what()), "empty item in the token id list '" + std::string(text) + "'");
    }
  }
  EXPECT_THROW(client::parse_id_list("  "), client::UsageError);  // no ids at all
}

TEST(M3cli, SecondsFlagsAreBounded) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"--connect-timeout 1e300 info", "--connect-timeout: 1e300 is outside (0, 1000000] seconds"},
      {"--connect-timeout 0 info", "--connect-timeout: 0 is outside (0, 1000000] seconds"},
      {"--timeout 1e300 info", "--timeout: 1e300 is outside (0, 1000000] seconds"},
      {"--timeout 0 info", "--timeout: 0 is outside (0, 1000000] seconds"},
      {"--timeout -1 generate --ids 1", "--timeout: -1 is outside (0, 1000000] seconds"},
      {"health --timeout 1000000.5", "--timeout: 1000000.5 is outside (0, 1000000] seconds"},
      {"--timeout inf info", "--timeout: 'inf' is not a number"},
  };
  for (const auto& [args, message] : bad) {
    // Port 1: a flag that got past the check would show as "cannot reach" (exit 1). The
    // later --connect-timeout wins.
    const ToolRun run = m3cli("--server 127.0.0.1:1 --connect-timeout 0.2 " + args);
    EXPECT_EQ(run.exit_code, 2) << args << ": " << run.err;
    EXPECT_TRUE(contains(run.err, message)) << args << ": " << run.err;
  }
  ScriptedServer server;
  ToolRun run = m3cli("--server " + server.address() + " --connect-timeout 1000000 --timeout 2.5 info");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  // A deadline below a millisecond is a millisecond, not none: far too short for a long reply.
  run = m3cli("--server " + server.address() + " --timeout 0.0001 generate --ids 1 --max-new-tokens 20000");
  EXPECT_EQ(run.exit_code, 1) << run.err;
  EXPECT_TRUE(contains(run.err, "Generate failed: DEADLINE_EXCEEDED")) << run.err;
}

TEST(M3cli, EveryFlagIsCheckedBeforeConnecting) {
  // Port 1: nothing listens there; a usage mistake must win over "cannot reach" (exit 1).
  const std::string unreachable = "--server 127.0.0.1:1 --connect-timeout 0.2 ";
  ToolRun run = m3cli(unreachable + "generate --ids 1 --print words");
  EXPECT_EQ(run.exit_code, 2) << run.err;
  EXPECT_TRUE(contains(run.err, "--print: 'words' is not auto, ids or text")) << run.err;
  run = m3cli(unreachable + "converse --print words");
  EXPECT_EQ(run.exit_code, 2) << run.err;
  EXPECT_TRUE(contains(run.err, "--print: 'words' is not auto, ids or text")) << run.err;
  run = m3cli(unreachable + "converse --timeout 0");
  EXPECT_EQ(run.exit_code, 2) << run.err;
  EXPECT_TRUE(contains(run.err, "--timeout: 0 is outside")) << run.err;
}

std::vector<char*> argv_of(std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (auto& arg : args) argv.push_back(arg.data());
  return argv;
}

TEST(BenchServe, RunsEveryRequestAndWritesTheJsonReport) {
  ScriptedServer server;
  const std::string dir = make_own_dir("bench-serve");
  ASSERT_FALSE(dir.empty());
  const std::string json_path = dir + "/bench_serve.json";
  std::vector<std::string> args = {"m3bench", "serve", "--server", server.address(),
                                   "--concurrency", "3", "--requests", "10",
                                   "--prompt-len", "5", "--max-new-tokens", "7",
                                   "--json", json_path};
  auto argv = argv_of(args);
  ASSERT_EQ(run_bench_serve(static_cast<int>(argv.size()), argv.data()), 0);

  std::ifstream file(json_path);
  const auto report = nlohmann::json::parse(file);
  EXPECT_EQ(report["ok"], 10);
  EXPECT_EQ(report["errors"], 0);
  EXPECT_EQ(report["tokens"], 70);
  EXPECT_EQ(report["time_to_first_token"]["samples"], 10);
  EXPECT_EQ(report["inter_token_latency"]["samples"], 60);  // 6 gaps per request
  EXPECT_LE(report["time_to_first_token"]["p50_ms"].get<double>(),
            report["time_to_first_token"]["p99_ms"].get<double>());
  EXPECT_GT(report["tokens_per_second"].get<double>(), 0);
  std::filesystem::remove_all(dir);
}

TEST(BenchServe, CountsFailedRequestsByStatus) {
  ScriptedServer server;
  server.service().refused_id_suffix = '3';
  const std::string dir = make_own_dir("bench-serve");
  ASSERT_FALSE(dir.empty());
  const std::string json_path = dir + "/bench_serve_errors.json";
  // Requests bench-3 and bench-13 are refused by the scripted server.
  std::vector<std::string> args = {"serve", "--server", server.address(), "--concurrency", "4",
                                   "--requests", "20", "--max-new-tokens", "3",
                                   "--json", json_path};
  auto argv = argv_of(args);
  EXPECT_EQ(run_bench_serve(static_cast<int>(argv.size()), argv.data()), 1);
  std::ifstream file(json_path);
  const auto report = nlohmann::json::parse(file);
  EXPECT_EQ(report["ok"], 18);
  EXPECT_EQ(report["errors"], 2);
  EXPECT_EQ(report["errors_by_status"]["RESOURCE_EXHAUSTED"], 2);
  EXPECT_EQ(report["tokens"], 18 * 3);
  std::filesystem::remove_all(dir);
}

TEST(BenchServe, UsageAndConnectionProblemsFailTheRun) {
  std::vector<std::string> zero = {"serve", "--max-new-tokens", "0"};
  auto argv = argv_of(zero);
  EXPECT_EQ(run_bench_serve(static_cast<int>(argv.size()), argv.data()), 2);

  std::vector<std::string> unreachable = {"serve", "--server", "127.0.0.1:1",
                                          "--connect-timeout", "0.3"};
  argv = argv_of(unreachable);
  EXPECT_EQ(run_bench_serve(static_cast<int>(argv.size()), argv.data()), 1);
}

TEST(BenchServe, SecondsFlagsAreBounded) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{"serve", "--timeout", "1e300"}, "--timeout: 1e300 is outside (0, 1000000] seconds"},
      {{"serve", "--timeout", "0"}, "--timeout: 0 is outside (0, 1000000] seconds"},
      {{"serve", "--connect-timeout", "-1"}, "--connect-timeout: -1 is outside (0, 1000000] seconds"},
      {{"serve", "--connect-timeout", "1e300"}, "--connect-timeout: 1e300 is outside (0, 1000000] seconds"},
  };
  for (auto [args, message] : bad) {
    // Port 1: nothing listens there; a value that got past the check fails the run (exit 1).
    args.insert(args.begin() + 1, {"--server", "127.0.0.1:1"});
    if (args[3] != "--connect-timeout") args.insert(args.end(), {"--connect-timeout", "0.2"});
    auto argv = argv_of(args);
    testing::internal::CaptureStderr();
    const int code = run_bench_serve(static_cast<int>(argv.size()), argv.data());
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_EQ(code, 2) << args[3] << " " << args[4];
    EXPECT_TRUE(contains(err, message)) << err;
  }
  // The largest timeout allowed is a deadline the requests meet.
  ScriptedServer server;
  std::vector<std::string> longest = {"serve", "--server", server.address(), "--requests", "2",
                                      "--max-new-tokens", "2", "--timeout", "1000000",
                                      "--connect-timeout", "1000000"};
  auto argv = argv_of(longest);
  EXPECT_EQ(run_bench_serve(static_cast<int>(argv.size()), argv.data()), 0);
}

// m3bench decode as a program: its flags are checked before anything else (CUDA or not).
ToolRun m3bench(const std::string& args) { return run_tool(M3_TEST_M3BENCH, args); }

TEST(BenchDecode, BadFlagsNameTheFlagAndTheValue) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"--batch 1,,4", "--batch: empty entry in \"1,,4\""},
      {"--batch 1,4,", "--batch: empty entry in \"1,4,\""},
      {"--batch ,1", "--batch: empty entry in \",1\""},
      {"--batch ''", "--batch: empty entry in \"\""},
      {"--batch abc", "--batch: 'abc' is not an integer"},
      {"--batch 4x", "--batch: '4x' is not an integer"},
      {"--batch 99999999999", "--batch: 99999999999 is outside [1, 4096]"},
      {"--batch 0", "--batch: 0 is outside [1, 4096]"},
      {"--batch 4097", "--batch: 4097 is outside [1, 4096]"},
      {"--iters 20x", "--iters: '20x' is not an integer"},
      {"--iters 0", "--iters: 0 is outside [10, 1000000]"},
      {"--iters -20", "--iters: -20 is outside [10, 1000000]"},
      {"--seed 5x", "--seed: '5x' is not a non-negative integer"},
      {"--seed -1", "--seed: '-1' is not a non-negative integer"},
      {"--seed 18446744073709551616", "--seed: 18446744073709551616 is outside [0, 18446744073709551615]"},
  };
  for (const auto& [args, message] : bad) {
    const ToolRun run = m3bench("decode --config configs/models/tiny.json " + args);
    EXPECT_EQ(run.exit_code, 2) << args;
    EXPECT_TRUE(contains(run.err, "m3bench decode: " + message + "\n")) << args << ": " << run.err;
    EXPECT_TRUE(contains(run.err, "usage: m3bench decode")) << run.err;
  }
}

TEST(BenchDecode, HelpGoesToStdoutAndExitsZero) {
  for (const std::string& args : {"--help", "-h", "decode --help"}) {
    const ToolRun run = m3bench(args);
    EXPECT_EQ(run.exit_code, 0) << args;
    EXPECT_TRUE(contains(run.out, "usage: m3bench decode")) << args << ": " << run.out;
    EXPECT_EQ(run.err, "") << args;
  }
  const ToolRun none = m3bench("");
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_TRUE(contains(none.err, "usage: m3bench")) << none.err;
}

}  // namespace
}  // namespace m3
