// The production settings (drain_delay_s, health_listen, tls_*, api_keys, metrics_auth):
// defaults, and every bad value refused with a message that names it.
#include <gtest/gtest.h>

#include "server/server_config.h"
#include "tests/server/config_test_support.h"
#include "tests/server/security_test_support.h"

namespace m3 {
namespace {

template <typename F>
std::string error_of(F&& f) {
  return test::config_error_of(f);
}
using test::from_yaml;

TEST(ProductionConfigTest, DefaultsListenOnLoopbackWithADrainDelay) {
  const ServerConfig c;
  EXPECT_EQ(c.listen, "127.0.0.1:50051");
  EXPECT_EQ(c.metrics_listen, "127.0.0.1:9464");
  EXPECT_EQ(c.drain_delay_s, 5.0);
  EXPECT_EQ(c.health_listen, "");
  EXPECT_TRUE(c.tls_cert.empty() && c.tls_key.empty() && c.tls_client_ca.empty() && c.api_keys.empty() &&
              c.metrics_auth.empty());
}

TEST(ProductionConfigTest, BadValuesAreRefusedWithTheirReason) {
  EXPECT_EQ(from_yaml("drain_delay_s: 0.25\n").drain_delay_s, 0.25);
  EXPECT_EQ(error_of([] { from_yaml("drain_delay_s: -1\n"); }),
            "drain_delay_s must be between 0 and 3600 seconds, got -1.000000");
  EXPECT_EQ(error_of([] { from_yaml("drain_delay_s: 4000\n"); }),
            "drain_delay_s must be between 0 and 3600 seconds, got 4000.000000");
  EXPECT_EQ(error_of([] { from_yaml("health_listen: localhost\n"); }),
            "health_listen must be host:port (port 0..65535), got 'localhost'");
  test::TempDir dir("m3-config");
  test::write_text(dir / "cert.pem", "x");
  const std::string cert = dir / "cert.pem";
  EXPECT_EQ(error_of([&] { from_yaml("tls_cert: " + cert + "\n"); }),
            "tls_cert is set but tls_key is not: TLS needs both");
  EXPECT_EQ(error_of([&] { from_yaml("tls_key: " + cert + "\n"); }), "tls_key is set but tls_cert is not: TLS needs both");
  EXPECT_EQ(error_of([&] { from_yaml("tls_client_ca: " + cert + "\n"); }),
            "tls_client_ca needs tls_cert and tls_key (mutual TLS is TLS first)");
  EXPECT_EQ(error_of([&] { from_yaml("tls_cert: " + cert + "\ntls_key: /nonexistent/key.pem\n"); }),
            "tls_key: '/nonexistent/key.pem' is not a file");
  EXPECT_EQ(error_of([] { from_yaml("api_keys: /nonexistent/keys\n"); }), "api_keys: '/nonexistent/keys' is not a file");
  EXPECT_EQ(error_of([] { from_yaml("metrics_auth: /nonexistent/users\n"); }),
            "metrics_auth: '/nonexistent/users' is not a file");
  EXPECT_EQ(error_of([] { parse_command_line({"--drain-delay-s", "soon"}, ""); }),
            "--drain-delay-s: expected a number, got 'soon'");
  for (const char* flag : {"--drain-delay-s", "--health-listen", "--tls-cert", "--tls-key", "--tls-client-ca",
                           "--api-keys", "--metrics-auth"})
    EXPECT_NE(command_line_help().find(flag), std::string::npos) << flag;
}

}  // namespace
}  // namespace m3
