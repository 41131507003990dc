// The drain load balancers see: on SIGTERM the health service reports NOT_SERVING for
// drain_delay_s while calls are still accepted and served, and only then does the server
// stop accepting and drain as before (streams get shutdown_grace_s; one cut then ends
// with Finished{CANCELLED} and is logged finish=cancelled). A second SIGTERM ends the
// delay early; SIGHUP re-reads the API keys in a running m3serve.
#include <gtest/gtest.h>

#include "tests/server/m3serve_child.h"
#include "tests/server/security_test_support.h"
#include "tests/server/server_test_support.h"

namespace m3::test {
namespace {

using namespace std::chrono_literals;

const std::vector<int32_t> kPrompt = {17, 3, 250, 99, 4, 411};

TEST(DrainTest, HealthIsNotServingDuringTheDelayWhileCallsAreServedThenTheShutdownDrains) {
  TestServer server;
  ASSERT_EQ(health_status(server.channel), "SERVING");
  ASSERT_EQ(health_status(server.channel, "m3serve.v1.M3Serve"), "SERVING");
  // A stream that will still be running when the shutdown's grace runs out.
  grpc::ClientContext ctx;
  auto running = server.stub->Generate(&ctx, generate_request(kPrompt, 100000));
  v1::GenerateResponse response;
  ASSERT_TRUE(running->Read(&response));

  server.app->begin_drain();
  EXPECT_EQ(health_status(server.channel), "NOT_SERVING");
  EXPECT_EQ(health_status(server.channel, "m3serve.v1.M3Serve"), "NOT_SERVING");
  // Still accepting and serving, on the open connection and on a new one.
  const GenerateResult during = generate(*server.stub, generate_request(kPrompt, 5));
  EXPECT_TRUE(during.status.ok()) << during.status.error_message();
  EXPECT_EQ(during.tokens, engine_generate(kPrompt, 5));
  auto fresh = v1::M3Serve::NewStub(grpc::CreateChannel(server.app->address(), grpc::InsecureChannelCredentials()));
  EXPECT_TRUE(generate(*fresh, generate_request(kPrompt, 5)).status.ok());
  server.app->begin_drain();  // (idempotent)
  EXPECT_EQ(health_status(server.channel), "NOT_SERVING");

  // Then the shutdown as before: the stream is cut after the grace with its reason.
  std::thread stopper([&] { server.app->shutdown(200ms); });
  std::optional<v1::Finished> finished;
  while (running->Read(&response))
    if (response.has_finished()) finished = response.finished();
  EXPECT_TRUE(running->Finish().ok());
  stopper.join();
  ASSERT_TRUE(finished.has_value());
  EXPECT_EQ(finished->reason(), v1::FINISH_REASON_CANCELLED);
  EXPECT_FALSE(generate(*server.stub, generate_request(kPrompt, 3), 2s).status.ok()) << "accepting after the drain";
  // Logged with its finish reason, not as an ordinary "ok".
  size_t cut = 0, whole = 0;
  for (const std::string& line : server.sink->lines()) {
    if (line.rfind("Generate ", 0) != 0) continue;
    if (line.find(" status=ok ") != std::string::npos && line.find(" finish=cancelled ") != std::string::npos) ++cut;
    if (line.find(" status=ok ") != std::string::npos && line.find(" finish=length ") != std::string::npos) ++whole;
  }
  EXPECT_EQ(cut, 1u);
  EXPECT_EQ(whole, 2u);
}

// health_listen: the kubelet's gRPC probes speak no TLS, so a TLS server offers health
// alone on a plaintext port, with the same statuses through the drain.
TEST(DrainTest, ThePlaintextHealthPortFollowsTheDrainOfATlsServer) {
  TestPki pki;
  pki.make_ca("ca");
  pki.make_leaf("server", "ca");
  ServerConfig config = test_config();
  config.tls_cert = pki.cert("server");
  config.tls_key = pki.key("server");
  config.health_listen = "127.0.0.1:0";
  TestServer server(config);
  ASSERT_GT(server.app->health_port(), 0);
  auto probe = grpc::CreateChannel("127.0.0.1:" + std::to_string(server.app->health_port()),
                                   grpc::InsecureChannelCredentials());
  EXPECT_EQ(health_status(probe), "SERVING");
  EXPECT_EQ(health_status(probe, "m3serve.v1.M3Serve"), "SERVING");
  // Nothing else is served there.
  EXPECT_EQ(generate(*v1::M3Serve::NewStub(probe), generate_request(kPrompt, 3)).status.error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  server.app->begin_drain();
  EXPECT_EQ(health_status(probe), "NOT_SERVING");
  EXPECT_EQ(health_status(probe, "m3serve.v1.M3Serve"), "NOT_SERVING");
  server.app->shutdown(0s);
  EXPECT_EQ(health_status(probe).substr(0, 9), "error 14 ") << "the health port outlived the server";
}

// The real executable and its signals.
struct Child {
  TempDir dir{"m3-drain"};
  std::unique_ptr<M3serveChild> child;
  Child(std::vector<std::string> args) {
    const std::vector<std::string> base = {"--backend", "cpu", "--cpu-threads", "1", "--listen", "127.0.0.1:0",
                                           "--metrics-listen", "", "--model", tiny_model_dir().string()};
    args.insert(args.begin(), base.begin(), base.end());
    child = std::make_unique<M3serveChild>(M3_TEST_M3SERVE, args, dir / "m3serve.log");
  }
  std::shared_ptr<grpc::Channel> channel() const {
    return grpc::CreateChannel(child->address(), grpc::InsecureChannelCredentials());
  }
};

TEST(DrainTest, SigtermGivesLoadBalancersDrainDelayOfNotServingBeforeTheServerStops) {
  Child server({"--drain-delay-s", "1.5", "--shutdown-grace-s", "1"});
  ASSERT_TRUE(server.child->ok()) << server.child->log();
  auto channel = server.channel();
  auto stub = v1::M3Serve::NewStub(channel);
  ASSERT_EQ(health_status(channel), "SERVING");

  const auto sent = std::chrono::steady_clock::now();
  server.child->signal(SIGTERM);
  EXPECT_TRUE(eventually_true([&] { return health_status(channel) == "NOT_SERVING"; }, 1s)) << server.child->log();
  const GenerateResult during = generate(*stub, generate_request(kPrompt, 5));
  EXPECT_TRUE(during.status.ok()) << during.status.error_message();
  EXPECT_EQ(during.tokens, engine_generate(kPrompt, 5));
  EXPECT_FALSE(server.child->exited()) << "stopped before drain_delay_s";

  EXPECT_EQ(server.child->wait_exit(20s), 0) << server.child->log();
  EXPECT_GE(std::chrono::steady_clock::now() - sent, 1500ms);
  const std::string log = server.child->log();
  EXPECT_NE(log.find("received SIGTERM: shutting down (drain 1.5s, then grace 1.0s)"), std::string::npos) << log;
  EXPECT_NE(log.find("draining: health reports NOT_SERVING for 1.5s (drain_delay_s)"), std::string::npos) << log;
  EXPECT_NE(log.find("server stopped"), std::string::npos) << log;
}

TEST(DrainTest, ASecondSigtermEndsTheDelayEarly) {
  Child server({"--drain-delay-s", "300", "--shutdown-grace-s", "1"});
  ASSERT_TRUE(server.child->ok()) << server.child->log();
  auto channel = server.channel();
  server.child->signal(SIGTERM);
  ASSERT_TRUE(eventually_true([&] { return health_status(channel) == "NOT_SERVING"; }, 5s));
  server.child->signal(SIGTERM);
  EXPECT_EQ(server.child->wait_exit(30s), 0) << server.child->log();
  EXPECT_NE(server.child->log().find("received SIGTERM again: the drain delay ends now"), std::string::npos);
}

TEST(DrainTest, SighupReReadsTheApiKeysOfARunningServer) {
  TempDir keys("m3-hup");
  write_text(keys / "keys", "before-hup\n");
  Child server({"--api-keys", keys / "keys", "--drain-delay-s", "0"});
  ASSERT_TRUE(server.child->ok()) << server.child->log();
  auto stub = v1::M3Serve::NewStub(server.channel());
  const auto info_with = [&](const std::string& key) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + key);
    v1::ModelInfo info;
    return stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).error_code();
  };
  ASSERT_EQ(info_with("before-hup"), grpc::StatusCode::OK);
  write_text(keys / "keys", "after-hup\n");
  server.child->signal(SIGHUP);
  EXPECT_TRUE(eventually_true([&] { return info_with("after-hup") == grpc::StatusCode::OK; }, 5s))
      << server.child->log();
  EXPECT_EQ(info_with("before-hup"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_NE(server.child->log().find("SIGHUP: 1 API keys from"), std::string::npos);
  server.child->signal(SIGTERM);
  EXPECT_EQ(server.child->wait_exit(20s), 0) << server.child->log();
}

}  // namespace
}  // namespace m3::test
