// What the client receives, what the log line says and what m3serve_requests_total counts
// agree, on every path a call can end by: served, refused, over capacity, out of time,
// cancelled by the client, cut by the server because its client read nothing (the client
// got CANCELLED, whatever the stream had ended with before), and requests whose bytes
// protobuf cannot parse, whose message says what is wrong with them: bytes that are no
// protobuf encoding, or the text field that is not UTF-8.
#include <gtest/gtest.h>

#include <map>

#include "server/metrics.h"
#include "server/unparsable_message.h"
#include "tests/server/security_test_support.h"
#include "tests/server/server_test_support.h"
#include "tests/server/status_labels.h"

namespace m3::test {
namespace {

using namespace std::chrono_literals;

const std::vector<int32_t> kPrompt = {17, 3, 250, 99, 4, 411};

using test::status_label;

// Counters and log lines by status, to compare before and after one call.
struct Tally {
  std::map<std::string, double> counted;
  std::map<std::string, size_t> logged;
};

Tally tally(TestServer& server) {
  Tally t;
  const std::string text = server.app->metrics().serialize();
  const auto lines = server.sink->lines();
  for (std::string_view status : ServerMetrics::kRequestStatuses) {
    const std::string name(status);
    t.counted[name] = prometheus_value(text, requests_series(name));
    t.logged[name] = std::count_if(lines.begin(), lines.end(), [&](const std::string& l) {
      return (l.rfind("Generate id=", 0) == 0 || l.rfind("Converse id=", 0) == 0) &&
             l.find(" status=" + name + " ") != std::string::npos;
    });
  }
  return t;
}

// After one call that ended with `code` at the client: exactly one call more is counted
// and logged, under that status.
void expect_recorded_as(TestServer& server, const Tally& before, grpc::StatusCode code, const std::string& what) {
  const std::string name = status_label(code);
  Tally after;
  const bool recorded = eventually_true([&] {
    after = tally(server);
    return after.counted[name] >= before.counted.at(name) + 1 && after.logged[name] >= before.logged.at(name) + 1;
  });
  EXPECT_TRUE(recorded) << what << ": the client got " << name << " but the server did not record it so";
  std::this_thread::sleep_for(50ms);  // (a second record would come at once)
  after = tally(server);
  for (const auto& [status, count] : after.counted) {
    const double expected = before.counted.at(status) + (status == name ? 1 : 0);
    EXPECT_EQ(count, expected) << what << ": counted as " << status << " (the client got " << name << ")";
    EXPECT_EQ(after.logged[status], before.logged.at(status) + (status == name ? 1 : 0))
        << what << ": logged as " << status << " (the client got " << name << ")";
  }
}

TEST(StatusConsistencyTest, TheClientTheLogAndTheCounterAgreeOnEveryEnd) {
  ServerConfig config = one_slot_config();
  config.max_new_tokens_limit = 10'000'000;
  TestServer server(config);

  Tally before = tally(server);
  const GenerateResult ok = generate(*server.stub, generate_request(kPrompt, 5));
  expect_recorded_as(server, before, ok.status.error_code(), "a served request");
  EXPECT_TRUE(ok.status.ok());

  before = tally(server);
  const GenerateResult invalid = generate(*server.stub, generate_request(kPrompt, 0));
  EXPECT_EQ(invalid.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  expect_recorded_as(server, before, invalid.status.error_code(), "a refused request");

  before = tally(server);
  const GenerateResult late = generate(*server.stub, generate_request(kPrompt, 10'000'000), 100ms);
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  expect_recorded_as(server, before, late.status.error_code(), "a request out of time");

  // One slot, no queue: a second request while one runs is over capacity.
  before = tally(server);
  grpc::ClientContext running_ctx;
  auto running = server.stub->Generate(&running_ctx, generate_request(kPrompt, 10'000'000));
  v1::GenerateResponse response;
  ASSERT_TRUE(running->Read(&response));
  const GenerateResult full = generate(*server.stub, generate_request(kPrompt, 5));
  EXPECT_EQ(full.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  expect_recorded_as(server, before, full.status.error_code(), "a request over capacity");

  before = tally(server);
  running_ctx.TryCancel();
  while (running->Read(&response)) {
  }
  const grpc::Status cancelled = running->Finish();
  EXPECT_EQ(cancelled.error_code(), grpc::StatusCode::CANCELLED);
  expect_recorded_as(server, before, cancelled.error_code(), "a request its client cancelled");
}

// A client that stops reading: its stream is ended (RESOURCE_EXHAUSTED behind the unread
// messages), then its call is cut (stalled_stream_timeout_s). The client gets CANCELLED,
// and so say the log and the counter (they said resource_exhausted). The buffer is larger
// than the client's flow-control window holds, so the window is full when it overflows.
TEST(StatusConsistencyTest, AStalledReaderCutByTheServerIsRecordedAsTheCancelledItGot) {
  ServerConfig config = test_config();
  config.stream_buffer_tokens = 16384;
  config.max_new_tokens_limit = 10'000'000;
  config.stalled_stream_timeout_s = 0.3;
  TestServer server(config);
  auto stub = small_window_stub(server);
  for (int attempt = 0; attempt < 3; ++attempt) {
    const Tally before = tally(server);
    grpc::ClientContext ctx;
    auto reader = stub->Generate(&ctx, generate_request(kPrompt, 10'000'000));
    // Reads nothing until the server has recorded the stream's end.
    ASSERT_TRUE(eventually_true(
        [&] {
          const Tally now = tally(server);
          double ended = 0;
          for (const auto& [status, count] : now.counted) ended += count - before.counted.at(status);
          return ended >= 1;
        },
        30s));
    v1::GenerateResponse response;
    while (reader->Read(&response)) {
    }
    const grpc::Status status = reader->Finish();
    expect_recorded_as(server, before, status.error_code(), "a stalled reader");
    if (status.error_code() != grpc::StatusCode::CANCELLED) continue;  // (its status fitted in the window)
    const auto lines = server.sink->lines();
    EXPECT_TRUE(std::any_of(lines.begin(), lines.end(), [](const std::string& l) {
      return l.find("status=cancelled") != std::string::npos &&
             l.find("cancelled by the server: the client read nothing") != std::string::npos &&
             l.find("(the stream had ended with resource_exhausted: the client reads too slowly") != std::string::npos;
    }));
    return;
  }
  ADD_FAILURE() << "the server never cut a stalled reader";
}

// ---- requests protobuf cannot parse -------------------------------------------------------

grpc::Status raw_generate(TestServer& server, const std::string& bytes) {
  grpc::GenericStub stub(server.channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1), response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/m3serve.v1.M3Serve/Generate", grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status status) { done.set_value(std::move(status)); });
  return done.get_future().get();
}

TEST(StatusConsistencyTest, AnUnparsableRequestIsToldWhatIsWrongWithIt) {
  TestServer server;
  struct Case {
    std::string bytes;
    std::string message;
  };
  const std::vector<Case> cases = {
      // prompt_text "a\xff", max_new_tokens 2
      {std::string("\x1a\x02" "a\xff" "\x20\x02", 6),
       "the request could not be parsed as this method's request: its field prompt_text is not valid UTF-8 "
       "(protobuf requires text fields to be)"},
      // Field 15 with wire type 7 (none exists), then nothing.
      {std::string("\x7f\x01\x02", 3),
       "the request could not be parsed as this method's request: its bytes are not a valid protobuf encoding of "
       "m3serve.v1.GenerateRequest"},
      // prompt_text said to be 5 bytes long with 2 left.
      {std::string("\x1a\x05" "ab", 4),
       "the request could not be parsed as this method's request: its bytes are not a valid protobuf encoding of "
       "m3serve.v1.GenerateRequest"},
  };
  for (const Case& c : cases) {
    const Tally before = tally(server);
    const grpc::Status status = raw_generate(server, c.bytes);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(status.error_message(), c.message);
    expect_recorded_as(server, before, status.error_code(), c.message);
  }
  // A nested text field, in a session's first message (the client's protobuf sends it,
  // saying so in its log).
  grpc::ClientContext ctx;
  auto session = server.stub->Converse(&ctx);
  v1::ConverseRequest config;
  config.mutable_config()->set_session_id("s\xff");
  session->Write(config);
  session->WritesDone();
  v1::ConverseResponse response;
  while (session->Read(&response)) {
  }
  const grpc::Status status = session->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(),
            "message 1 could not be parsed as this method's request: its field config.session_id is not valid UTF-8 "
            "(protobuf requires text fields to be)");
}

TEST(UnparsableMessageTest, NamesTheFieldOrSaysTheBytesAreBroken) {
  const auto& generate = *v1::GenerateRequest::descriptor();
  EXPECT_EQ(why_unparsable(std::string("\x1a\x02" "a\xff", 4), generate),
            "its field prompt_text is not valid UTF-8 (protobuf requires text fields to be)");
  EXPECT_EQ(why_unparsable("\x0a\x01\xc0", generate),  // request_id
            "its field request_id is not valid UTF-8 (protobuf requires text fields to be)");
  EXPECT_EQ(why_unparsable("\xff\xff\xff", generate),
            "its bytes are not a valid protobuf encoding of m3serve.v1.GenerateRequest");
  // A nested message whose bytes are broken (prompt_ids holding a truncated varint).
  EXPECT_EQ(why_unparsable(std::string("\x12\x02\x08\xff", 4), generate),
            "its bytes are not a valid protobuf encoding of m3serve.v1.GenerateRequest");
  EXPECT_EQ(why_unparsable(std::string("\x0a\x03\x0a\x01\xfe", 5), *v1::ConverseRequest::descriptor()),
            "its field config.session_id is not valid UTF-8 (protobuf requires text fields to be)");
}

TEST(UnparsableMessageTest, Utf8IsCheckedAsProtobufDoes) {
  for (const std::string ok : {"", "abc", "caf\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80", "\xf4\x8f\xbf\xbf"})
    EXPECT_TRUE(is_valid_utf8(ok)) << ok;
  for (const std::string bad : {"\xc3", "\xc0\xaf", "\xe0\x80\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xff",
                                "a\x80", "\xe2\x82"})
    EXPECT_FALSE(is_valid_utf8(bad)) << bad;
}

}  // namespace
}  // namespace m3::test
