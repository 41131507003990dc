// API keys (api_keys, --api-keys): the file's rules, and over gRPC: no key, a wrong key and
// a right key give UNAUTHENTICATED, UNAUTHENTICATED and OK for every M3Serve RPC; health
// needs none; refusals are logged (without the key) and counted; reload (SIGHUP) applies a
// new file and keeps the old keys when the new file is bad.
#include <gtest/gtest.h>

#include <grpcpp/generic/generic_stub.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <future>
#include <optional>

#include "server/api_keys.h"
#include "server/metrics.h"
#include "tests/error_of.h"
#include "tests/server/security_test_support.h"
#include "tests/server/server_test_support.h"

namespace m3::test {
namespace {

using namespace std::chrono_literals;

const std::vector<int32_t> kPrompt = {17, 3, 250, 99, 4, 411};

std::string error_of_keys(const std::string& path) {
  return m3::test::error_of<std::invalid_argument>([&] { ApiKeys keys(path); });
}

TEST(ApiKeysTest, ReadsOneKeyALineAndComparesWholeKeys) {
  TempDir dir("m3-keys");
  write_text(dir / "keys", "# the team's keys\n\n  key-one  \nkey-two\r\n");
  ApiKeys keys(dir / "keys");
  EXPECT_EQ(keys.size(), 2u);
  EXPECT_EQ(keys.check(std::nullopt), "missing API key: send the metadata 'authorization: Bearer <key>'");
  EXPECT_EQ(keys.check("Bearer key-one"), "");
  EXPECT_EQ(keys.check("Bearer key-two"), "");
  EXPECT_EQ(keys.check("Bearer key-on"), "invalid API key");
  EXPECT_EQ(keys.check("Bearer key-one2"), "invalid API key");
  EXPECT_EQ(keys.check("Bearer # the team's keys"), "invalid API key");
  EXPECT_EQ(keys.check("Bearer "), "the 'authorization' metadata is not of the form 'Bearer <key>'");
  EXPECT_EQ(keys.check("Basic a2V5LW9uZQ=="), "the 'authorization' metadata is not of the form 'Bearer <key>'");
  EXPECT_TRUE(keys.accepts("key-two"));
  EXPECT_FALSE(keys.accepts(""));
}

TEST(ApiKeysTest, BadFilesAreRefusedWithTheirReason) {
  TempDir dir("m3-keys");
  EXPECT_EQ(error_of_keys(dir / "absent"), "api_keys: cannot read '" + (dir / "absent") + "'");
  write_text(dir / "empty", "# nothing yet\n\n");
  EXPECT_EQ(error_of_keys(dir / "empty"),
            "api_keys: '" + (dir / "empty") + "' holds no key (one key a line; '#' starts a comment)");
  write_text(dir / "spaced", "good-key\nkey with spaces\n");
  EXPECT_EQ(error_of_keys(dir / "spaced"),
            "api_keys: '" + (dir / "spaced") + "' line 2: a key may not contain spaces or control characters");
}

TEST(ApiKeysTest, ReloadReplacesTheKeysAndKeepsThemWhenTheFileIsBad) {
  TempDir dir("m3-keys");
  write_text(dir / "keys", "first\n");
  ApiKeys keys(dir / "keys");
  write_text(dir / "keys", "second\nthird\n");
  EXPECT_EQ(keys.reload(), 2u);
  EXPECT_EQ(keys.check("Bearer first"), "invalid API key");
  EXPECT_EQ(keys.check("Bearer third"), "");
  write_text(dir / "keys", "\n");
  EXPECT_THROW(keys.reload(), std::invalid_argument);
  EXPECT_EQ(keys.check("Bearer second"), "") << "a bad file replaced the keys in force";
}

// ---- over gRPC --------------------------------------------------------------------------

struct KeyedServer {
  TempDir dir{"m3-keyed"};
  std::unique_ptr<TestServer> server;
  explicit KeyedServer(const std::string& keys) {
    write_text(dir / "keys", keys);
    ServerConfig config = test_config();
    config.api_keys = dir / "keys";
    server = std::make_unique<TestServer>(config);
  }
  double requests(const std::string& status) {
    return prometheus_value(server->app->metrics().serialize(), requests_series(status));
  }
};

GenerateResult generate_with_key(TestServer& server, const std::optional<std::string>& authorization) {
  GenerateResult r;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 60s);
  if (authorization) ctx.AddMetadata("authorization", *authorization);
  auto reader = server.stub->Generate(&ctx, generate_request(kPrompt, 5));
  v1::GenerateResponse response;
  while (reader->Read(&response))
    for (int32_t id : response.tokens().ids()) r.tokens.push_back(id);
  r.status = reader->Finish();
  return r;
}

grpc::Status model_info_with_key(TestServer& server, const std::optional<std::string>& authorization) {
  grpc::ClientContext ctx;
  if (authorization) ctx.AddMetadata("authorization", *authorization);
  v1::ModelInfo info;
  return server.stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
}

grpc::Status converse_with_key(TestServer& server, const std::optional<std::string>& authorization) {
  grpc::ClientContext ctx;
  if (authorization) ctx.AddMetadata("authorization", *authorization);
  auto stream = server.stub->Converse(&ctx);
  v1::ConverseRequest input, end;
  input.mutable_input()->add_ids(5);
  end.mutable_end_turn()->set_max_new_tokens(2);
  stream->Write(input);
  stream->Write(end);
  stream->WritesDone();
  v1::ConverseResponse response;
  while (stream->Read(&response)) {
  }
  return stream->Finish();
}

// A unary call of `method` with empty request bytes: its status (health, reflection).
grpc::Status raw_unary(TestServer& server, const std::string& method, std::string* response_bytes = nullptr) {
  grpc::GenericStub stub(server.channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  grpc::ByteBuffer request, response;
  grpc::Slice empty("", 0);
  request = grpc::ByteBuffer(&empty, 1);
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status status) { done.set_value(std::move(status)); });
  grpc::Status status = done.get_future().get();
  if (response_bytes != nullptr && status.ok()) {
    std::vector<grpc::Slice> slices;
    response_bytes->clear();
    if (response.Dump(&slices).ok())
      for (const auto& s : slices) response_bytes->append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return status;
}

TEST(ApiKeyServerTest, NoKeyAndAWrongKeyAreUnauthenticatedAndTheRightKeyServes) {
  KeyedServer keyed("right-key-123\n");
  TestServer& server = *keyed.server;

  const GenerateResult none = generate_with_key(server, std::nullopt);
  EXPECT_EQ(none.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(none.status.error_message(), "missing API key: send the metadata 'authorization: Bearer <key>'");
  EXPECT_TRUE(none.tokens.empty());
  const GenerateResult wrong = generate_with_key(server, "Bearer wrong-key-456");
  EXPECT_EQ(wrong.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(wrong.status.error_message(), "invalid API key");
  const GenerateResult right = generate_with_key(server, "Bearer right-key-123");
  EXPECT_TRUE(right.status.ok()) << right.status.error_message();
  EXPECT_EQ(right.tokens, engine_generate(kPrompt, 5));

  EXPECT_EQ(converse_with_key(server, std::nullopt).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(converse_with_key(server, "Bearer wrong-key-456").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  const grpc::Status session = converse_with_key(server, "Bearer right-key-123");
  EXPECT_TRUE(session.ok()) << session.error_message();
  EXPECT_EQ(model_info_with_key(server, std::nullopt).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(model_info_with_key(server, "Bearer wrong-key-456").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(model_info_with_key(server, "Bearer right-key-123").ok());

  // Health needs no key (load balancers and the kubelet probe it); reflection is not
  // offered (it would need none).
  std::string health;
  ASSERT_TRUE(raw_unary(server, "/grpc.health.v1.Health/Check", &health).ok());
  EXPECT_EQ(health, std::string("\x08\x01", 2)) << "not SERVING";
  EXPECT_EQ(raw_unary(server, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo").error_code(),
            grpc::StatusCode::UNIMPLEMENTED);

  // Counted, and logged with the peer but never with what the client sent.
  EXPECT_TRUE(eventually_true([&] { return keyed.requests("unauthenticated") == 6; })) << keyed.requests("unauthenticated");
  // (GetModelInfo's successes are not requests; a call is recorded just after its client
  // has its status, so the count is waited for.)
  EXPECT_TRUE(eventually_true([&] { return keyed.requests("ok") == 2; })) << keyed.requests("ok");
  size_t refusal_lines = 0, warnings = 0;
  for (const std::string& line : server.sink->lines()) {
    EXPECT_EQ(line.find("wrong-key-456"), std::string::npos) << line;
    EXPECT_EQ(line.find("right-key-123"), std::string::npos) << line;
    if (line.find("status=unauthenticated") != std::string::npos) {
      ++refusal_lines;
      EXPECT_NE(line.find("peer=ipv4:127.0.0.1:"), std::string::npos) << line;
    }
    if (line.find(" refused: ") != std::string::npos) {
      ++warnings;
      EXPECT_NE(line.find(" from ipv4:127.0.0.1:"), std::string::npos) << line;
    }
  }
  EXPECT_EQ(refusal_lines, 6u);
  EXPECT_EQ(warnings, 5u);  // (rate-limited: 5 a kind in 10 s)
}

// The snapshot RPCs hold a session's whole context: they need the key as every other does.
TEST(ApiKeyServerTest, SnapshotCallsNeedTheKey) {
  KeyedServer keyed("right-key-123\n");
  TestServer& server = *keyed.server;
  auto create = [&](const std::optional<std::string>& authorization, v1::SnapshotInfo* info) {
    grpc::ClientContext ctx;
    if (authorization) ctx.AddMetadata("authorization", *authorization);
    v1::CreateSnapshotRequest request;
    for (int32_t id : kPrompt) request.mutable_prompt_ids()->add_ids(id);
    return server.stub->CreateSnapshot(&ctx, request, info);
  };
  auto by_ref = [&](bool get, const std::optional<std::string>& authorization, const std::string& id) {
    grpc::ClientContext ctx;
    if (authorization) ctx.AddMetadata("authorization", *authorization);
    v1::SnapshotRef ref;
    ref.set_snapshot_id(id);
    v1::SnapshotInfo info;
    return get ? server.stub->GetSnapshot(&ctx, ref, &info) : server.stub->DeleteSnapshot(&ctx, ref, &info);
  };
  v1::SnapshotInfo info;
  EXPECT_EQ(create(std::nullopt, &info).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(create("Bearer wrong-key-456", &info).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  const grpc::Status made = create("Bearer right-key-123", &info);
  ASSERT_TRUE(made.ok()) << made.error_message();
  ASSERT_FALSE(info.snapshot_id().empty());
  for (bool get : {true, false}) {
    SCOPED_TRACE(get ? "GetSnapshot" : "DeleteSnapshot");
    EXPECT_EQ(by_ref(get, std::nullopt, info.snapshot_id()).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(by_ref(get, "Bearer wrong-key-456", info.snapshot_id()).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    const grpc::Status keyed_call = by_ref(get, "Bearer right-key-123", info.snapshot_id());
    EXPECT_TRUE(keyed_call.ok()) << keyed_call.error_message();
  }
  EXPECT_TRUE(eventually_true([&] { return keyed.requests("unauthenticated") == 6; })) << keyed.requests("unauthenticated");
}

// A plain server offers reflection; only a keyed one drops it.
TEST(ApiKeyServerTest, AServerWithoutKeysStillOffersReflection) {
  TestServer server;
  grpc::GenericStub stub(server.channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  call->StartCall(reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  // ServerReflectionRequest{list_services: ""}
  const std::string list_services("\x3a\x00", 2);
  grpc::Slice slice(list_services);
  grpc::ByteBuffer request(&slice, 1);
  call->Write(request, reinterpret_cast<void*>(2));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  grpc::ByteBuffer response;
  call->Read(&response, reinterpret_cast<void*>(3));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  EXPECT_TRUE(ok) << "no reflection response";
  ctx.TryCancel();
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(4));
  while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(4)) {
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

TEST(ApiKeyServerTest, ReloadAppliesANewKeyFileAndKeepsTheKeysWhenItIsBad) {
  KeyedServer keyed("old-key\n");
  TestServer& server = *keyed.server;
  ASSERT_TRUE(generate_with_key(server, "Bearer old-key").status.ok());
  write_text(keyed.dir / "keys", "new-key\n");
  EXPECT_TRUE(server.app->reload());
  EXPECT_EQ(generate_with_key(server, "Bearer old-key").status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(generate_with_key(server, "Bearer new-key").status.ok());

  write_text(keyed.dir / "keys", "# emptied by mistake\n");
  EXPECT_FALSE(server.app->reload());
  EXPECT_TRUE(generate_with_key(server, "Bearer new-key").status.ok()) << "a bad file replaced the keys";
  const auto lines = server.sink->lines();
  EXPECT_TRUE(std::any_of(lines.begin(), lines.end(), [](const std::string& l) {
    return l.find("SIGHUP: API keys not reloaded, the old ones stay in force: api_keys: '") != std::string::npos &&
           l.find("holds no key") != std::string::npos;
  }));
}

// m3cli and m3bench send the first key of --api-key-file with every call.
TEST(ApiKeyServerTest, M3cliAndM3benchSendTheirKeyFile) {
  KeyedServer keyed("# ops\nclient-key-789\n");
  TestServer& server = *keyed.server;
  write_text(keyed.dir / "client.key", "# mine\n\nclient-key-789\n");
  write_text(keyed.dir / "wrong.key", "not-the-key\n");
  const std::string at = " --server " + server.app->address() + " ";
  const CommandRun with = run_command(std::string(M3_TEST_M3CLI) + at + "--api-key-file " + (keyed.dir / "client.key") +
                                      " generate --ids 1,2,3 --max-new-tokens 4");
  EXPECT_EQ(with.status, 0) << with.out;
  EXPECT_NE(with.out.find("finished: length"), std::string::npos) << with.out;
  const CommandRun wrong = run_command(std::string(M3_TEST_M3CLI) + at + "--api-key-file " + (keyed.dir / "wrong.key") + " info");
  EXPECT_NE(wrong.status, 0) << wrong.out;
  EXPECT_NE(wrong.out.find("UNAUTHENTICATED: invalid API key"), std::string::npos) << wrong.out;
  const CommandRun none = run_command(std::string(M3_TEST_M3CLI) + at + "info");
  EXPECT_NE(none.out.find("UNAUTHENTICATED: missing API key"), std::string::npos) << none.out;
  const CommandRun bench = run_command(std::string(M3_TEST_M3BENCH) + " serve" + at + "--api-key-file " +
                                       (keyed.dir / "client.key") + " --requests 4 --concurrency 2 --max-new-tokens 4");
  EXPECT_EQ(bench.status, 0) << bench.out;
  EXPECT_EQ(keyed.requests("ok"), 5) << bench.out;  // m3cli's Generate and m3bench's 4
  const CommandRun missing = run_command(std::string(M3_TEST_M3CLI) + at + "--api-key-file " + (keyed.dir / "absent") + " info");
  EXPECT_EQ(missing.status, 2) << missing.out;
  EXPECT_NE(missing.out.find("--api-key-file: cannot read '" + (keyed.dir / "absent") + "'"), std::string::npos) << missing.out;
}

// ---- /metrics with basic auth (metrics_auth) ------------------------------------------------

// The status line and body of GET /metrics, with an Authorization header when given.
std::string get_metrics(int port, const std::string& authorization = "") {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) {
    std::string request = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
    if (!authorization.empty()) request += "Authorization: " + authorization + "\r\n";
    request += "\r\n";
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) response.append(buffer, n);
    }
  }
  close(fd);
  return response;
}

TEST(MetricsAuthTest, MetricsNeedBasicAuthWithAConfiguredUserAndReloadChangesThem) {
  TempDir dir("m3-metrics-auth");
  write_text(dir / "users", "prom:secret\n");
  ServerConfig config = test_config();
  config.metrics_listen = "127.0.0.1:0";
  config.metrics_auth = dir / "users";
  TestServer server(config);
  const int port = server.app->metrics().exposer_port();
  ASSERT_GT(port, 0);
  EXPECT_EQ(get_metrics(port).substr(0, 12), "HTTP/1.1 401");
  EXPECT_EQ(get_metrics(port, "Basic cHJvbTp3cm9uZw==").substr(0, 12), "HTTP/1.1 401");  // prom:wrong
  const std::string ok = get_metrics(port, "Basic cHJvbTpzZWNyZXQ=");                    // prom:secret
  EXPECT_EQ(ok.substr(0, 12), "HTTP/1.1 200") << ok.substr(0, 200);
  EXPECT_NE(ok.find("m3serve_requests_total"), std::string::npos);
  write_text(dir / "users", "prom:rotated\n");
  EXPECT_TRUE(server.app->reload());
  EXPECT_EQ(get_metrics(port, "Basic cHJvbTpzZWNyZXQ=").substr(0, 12), "HTTP/1.1 401");
  EXPECT_EQ(get_metrics(port, "Basic cHJvbTpyb3RhdGVk").substr(0, 12), "HTTP/1.1 200");  // prom:rotated
}

}  // namespace
}  // namespace m3::test
