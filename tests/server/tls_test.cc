// TLS and mutual TLS (tls_cert, tls_key, tls_client_ca), with certificates made by the
// openssl command at test time: a round trip with m3cli, with an independent client
// (Debian's python3-grpcio) and a handshake by `openssl s_client`; a plaintext client to
// the TLS port fails; mutual TLS refuses a client without a certificate (or with one a
// different CA signed); bad files are refused at start naming the file; reload (SIGHUP)
// serves new certificates to new connections without dropping a stream in flight.
#include <gtest/gtest.h>

#include <set>

#include "server/tls_files.h"
#include "tests/error_of.h"
#include "tests/server/security_test_support.h"
#include "tests/server/server_test_support.h"

namespace m3::test {
namespace {

using namespace std::chrono_literals;

const std::vector<int32_t> kPrompt = {17, 3, 250, 99, 4, 411};
// Debian's python3, where python3-grpcio is installed (a python3 earlier on PATH, such as
// a pyenv one, would not have it).
constexpr const char* kDebianPython = "/usr/bin/python3";

std::string error_of_tls(const std::string& cert, const std::string& key, const std::string& ca = "") {
  return m3::test::error_of<std::invalid_argument>([&] { TlsFiles files(cert, key, ca); });
}

struct ClientFiles {
  std::string ca, cert, key;
};

std::shared_ptr<grpc::Channel> tls_channel(int port, const ClientFiles& files) {
  grpc::SslCredentialsOptions tls;
  tls.pem_root_certs = read_text(files.ca);
  if (!files.cert.empty()) {
    tls.pem_cert_chain = read_text(files.cert);
    tls.pem_private_key = read_text(files.key);
  }
  return grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::SslCredentials(tls));
}

grpc::Status generate_over(const std::shared_ptr<grpc::Channel>& channel, std::vector<int32_t>* tokens = nullptr) {
  auto stub = v1::M3Serve::NewStub(channel);
  const GenerateResult r = generate(*stub, generate_request(kPrompt, 4), 20s);
  if (tokens) *tokens = r.tokens;
  return r.status;
}

std::string m3cli(int port, const std::string& args) {
  return std::string(M3_TEST_M3CLI) + " --server 127.0.0.1:" + std::to_string(port) + " --connect-timeout 5 " + args;
}

std::string python_client(int port, const std::string& args) {
  return std::string(kDebianPython) + " " M3_TEST_PYTHON_CLIENT " --server 127.0.0.1:" + std::to_string(port) + " " +
         args;
}

bool python_grpc_available() { return run_command(std::string(kDebianPython) + " -c 'import grpc'").status == 0; }

TEST(TlsServerTest, RoundTripsWithM3cliAndAnIndependentClientAndRefusesPlaintext) {
  TestPki pki;
  pki.make_ca("ca");
  pki.make_leaf("server", "ca");
  ServerConfig config = test_config();
  config.tls_cert = pki.cert("server");
  config.tls_key = pki.key("server");
  TestServer server(config);
  const int port = server.app->port();

  std::vector<int32_t> tokens;
  const grpc::Status status = generate_over(tls_channel(port, {pki.cert("ca")}), &tokens);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(tokens, engine_generate(kPrompt, 4));

  const CommandRun cli = run_command(m3cli(port, "--tls-ca " + pki.cert("ca") + " generate --ids 1,2,3 --max-new-tokens 4"));
  EXPECT_EQ(cli.status, 0) << cli.out;
  EXPECT_NE(cli.out.find("finished: length"), std::string::npos) << cli.out;
  const CommandRun health = run_command(m3cli(port, "--tls-ca " + pki.cert("ca") + " health"));
  EXPECT_EQ(health.status, 0) << health.out;
  EXPECT_EQ(health.out, "SERVING\n");

  // An independent TLS stack completes the handshake and verifies the chain.
  const CommandRun handshake = run_command("openssl s_client -connect 127.0.0.1:" + std::to_string(port) +
                                           " -CAfile " + pki.cert("ca") + " -alpn h2 -verify_return_error");
  EXPECT_NE(handshake.out.find("Verify return code: 0 (ok)"), std::string::npos) << handshake.out;

  // Plaintext to the TLS port: no call gets through.
  auto plaintext = grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  EXPECT_EQ(generate_over(plaintext).error_code(), grpc::StatusCode::UNAVAILABLE);
  const CommandRun plain_cli = run_command(m3cli(port, "--connect-timeout 2 health"));
  EXPECT_NE(plain_cli.status, 0) << plain_cli.out;
  // A client trusting another CA is refused too.
  pki.make_ca("other-ca");
  EXPECT_EQ(generate_over(tls_channel(port, {pki.cert("other-ca")})).error_code(), grpc::StatusCode::UNAVAILABLE);

  if (!python_grpc_available()) GTEST_SKIP() << "python3-grpcio is not installed (scripts/setup.sh installs it)";
  const CommandRun python = run_command(python_client(port, "--ca " + pki.cert("ca")));
  EXPECT_EQ(python.status, 0) << python.out;
  EXPECT_NE(python.out.find("health SERVING"), std::string::npos) << python.out;
  EXPECT_NE(python.out.find("generate token_messages"), std::string::npos) << python.out;
  EXPECT_NE(python.out.find("finished yes"), std::string::npos) << python.out;
  const CommandRun python_plain = run_command(python_client(port, ""));
  EXPECT_EQ(python_plain.status, 1) << python_plain.out;
  EXPECT_NE(python_plain.out.find("error UNAVAILABLE"), std::string::npos) << python_plain.out;
}

TEST(TlsServerTest, MutualTlsRefusesClientsWithoutACertificateItsCaSigned) {
  TestPki pki;
  pki.make_ca("ca");
  pki.make_leaf("server", "ca");
  pki.make_ca("client-ca");
  pki.make_leaf("client", "client-ca", /*client=*/true);
  pki.make_ca("rogue-ca");
  pki.make_leaf("rogue", "rogue-ca", /*client=*/true);
  ServerConfig config = test_config();
  config.tls_cert = pki.cert("server");
  config.tls_key = pki.key("server");
  config.tls_client_ca = pki.cert("client-ca");
  TestServer server(config);
  const int port = server.app->port();

  EXPECT_EQ(generate_over(tls_channel(port, {pki.cert("ca")})).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(generate_over(tls_channel(port, {pki.cert("ca"), pki.cert("rogue"), pki.key("rogue")})).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  const grpc::Status with_cert = generate_over(tls_channel(port, {pki.cert("ca"), pki.cert("client"), pki.key("client")}));
  EXPECT_TRUE(with_cert.ok()) << with_cert.error_message();

  const std::string tls = "--tls-ca " + pki.cert("ca");
  const CommandRun without = run_command(m3cli(port, tls + " --connect-timeout 2 health"));
  EXPECT_NE(without.status, 0) << without.out;
  const CommandRun with =
      run_command(m3cli(port, tls + " --tls-cert " + pki.cert("client") + " --tls-key " + pki.key("client") + " health"));
  EXPECT_EQ(with.status, 0) << with.out;

  if (!python_grpc_available()) GTEST_SKIP() << "python3-grpcio is not installed (scripts/setup.sh installs it)";
  const CommandRun python_without = run_command(python_client(port, "--ca " + pki.cert("ca")));
  EXPECT_EQ(python_without.status, 1) << python_without.out;
  const CommandRun python_with = run_command(
      python_client(port, "--ca " + pki.cert("ca") + " --cert " + pki.cert("client") + " --key " + pki.key("client")));
  EXPECT_EQ(python_with.status, 0) << python_with.out;
}

TEST(TlsServerTest, FilesThatCannotServeAreRefusedAtStartNamingThem) {
  TestPki pki;
  pki.make_ca("ca");
  pki.make_leaf("server", "ca");
  pki.make_leaf("other", "ca");
  write_text(pki.file("garbage.pem"), "not a certificate\n");
  EXPECT_EQ(error_of_tls(pki.cert("server"), pki.key("other")),
            "tls_key: '" + pki.key("other") + "' is not the private key of the certificate in tls_cert '" +
                pki.cert("server") + "'");
  EXPECT_EQ(error_of_tls(pki.file("garbage.pem"), pki.key("server")).substr(0, 60),
            ("tls_cert: '" + pki.file("garbage.pem") + "' holds no PEM certificate (").substr(0, 60));
  EXPECT_NE(error_of_tls(pki.cert("server"), pki.cert("server")).find("tls_key: '" + pki.cert("server") +
                                                                      "' holds no PEM private key"),
            std::string::npos);
  EXPECT_NE(error_of_tls(pki.cert("server"), pki.key("server"), pki.file("garbage.pem"))
                .find("tls_client_ca: '" + pki.file("garbage.pem") + "' holds no PEM certificate"),
            std::string::npos);
  // Through the server's own start.
  ServerConfig config = test_config();
  config.tls_cert = pki.cert("server");
  config.tls_key = pki.key("other");
  EXPECT_EQ(m3::test::error_of<std::invalid_argument>([&] { ServerApp app(config); }),
            error_of_tls(pki.cert("server"), pki.key("other")));
  config.tls_key = pki.file("absent.key");
  EXPECT_EQ(m3::test::error_of<std::invalid_argument>([&] { config.validate(); }),
            "tls_key: '" + pki.file("absent.key") + "' is not a file");
  config.tls_key = "";
  EXPECT_EQ(m3::test::error_of<std::invalid_argument>([&] { config.validate(); }),
            "tls_cert is set but tls_key is not: TLS needs both");
}

// The copies gRPC serves hold the private key: only the server's user may read them, and
// they are gone when the server is.
TEST(TlsServerTest, ThePrivateCopiesAreTheOwnersAloneAndRemovedAtTheEnd) {
  TestPki pki;
  pki.make_ca("ca");
  pki.make_leaf("server", "ca");
  const auto private_dirs = [] {
    std::set<std::string> dirs;
    for (const auto& e : std::filesystem::directory_iterator(std::filesystem::temp_directory_path()))
      if (e.path().filename().string().rfind("m3serve-tls-", 0) == 0) dirs.insert(e.path().string());
    return dirs;
  };
  const auto before = private_dirs();
  std::string dir;
  {
    TlsFiles files(pki.cert("server"), pki.key("server"), "");
    files.reload();
    for (const auto& d : private_dirs())
      if (!before.count(d)) dir = d;
    ASSERT_FALSE(dir.empty());
    namespace fs = std::filesystem;
    EXPECT_EQ(fs::status(dir).permissions() & fs::perms::all, fs::perms::owner_all);
    const fs::path key = fs::path(dir) / "current" / "key.pem";
    EXPECT_EQ(read_text(key.string()), read_text(pki.key("server")));
    EXPECT_EQ(fs::status(key).permissions() & fs::perms::all, fs::perms::owner_read | fs::perms::owner_write);
  }
  EXPECT_FALSE(std::filesystem::exists(dir)) << "the key's copy outlived the server";
}

TEST(TlsServerTest, ReloadServesNewCertificatesWithoutDroppingAStream) {
  TestPki pki;
  pki.make_ca("ca1");
  pki.make_leaf("server1", "ca1");
  pki.make_ca("ca2");
  pki.make_leaf("server2", "ca2");
  const std::string cert = pki.file("live.pem"), key = pki.file("live.key");
  write_text(cert, read_text(pki.cert("server1")));
  write_text(key, read_text(pki.key("server1")));
  ServerConfig config = test_config();
  config.tls_cert = cert;
  config.tls_key = key;
  TestServer server(config);
  const int port = server.app->port();

  // A session that outlives the reload: a turn before it, one after.
  auto old_stub = v1::M3Serve::NewStub(tls_channel(port, {pki.cert("ca1")}));
  grpc::ClientContext ctx;
  auto session = old_stub->Converse(&ctx);
  const auto turn = [&] {
    v1::ConverseRequest input, end;
    input.mutable_input()->add_ids(5);
    end.mutable_end_turn()->set_max_new_tokens(3);
    if (!session->Write(input) || !session->Write(end)) return false;
    v1::ConverseResponse response;
    while (session->Read(&response))
      if (response.has_turn_finished()) return true;
    return false;
  };
  ASSERT_TRUE(turn());

  write_text(key, read_text(pki.key("server2")));
  write_text(cert, read_text(pki.cert("server2")));
  ASSERT_TRUE(server.app->reload());
  // New connections get the new certificate (the watcher looks every second).
  EXPECT_TRUE(eventually_true([&] { return generate_over(tls_channel(port, {pki.cert("ca2")})).ok(); }, 15s));
  EXPECT_EQ(generate_over(tls_channel(port, {pki.cert("ca1")})).error_code(), grpc::StatusCode::UNAVAILABLE);

  // The session from before still works.
  EXPECT_TRUE(turn()) << "the session was dropped";
  session->WritesDone();
  const grpc::Status ended = session->Finish();
  EXPECT_TRUE(ended.ok()) << ended.error_message();

  // Files that do not match are refused; the certificate in force stays.
  write_text(key, read_text(pki.key("server1")));
  EXPECT_FALSE(server.app->reload());
  std::this_thread::sleep_for(1500ms);  // (past the watcher's period)
  EXPECT_TRUE(generate_over(tls_channel(port, {pki.cert("ca2")})).ok());
}

}  // namespace
}  // namespace m3::test
