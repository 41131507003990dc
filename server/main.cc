// m3serve: serves a Mamba-3 MIMO decoder over gRPC (see configs/server.yaml, --help).
#include <signal.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "server/server_app.h"
#include "server/server_config.h"

int main(int argc, char** argv) {
  // Every thread inherits this mask; the main thread takes the signals with sigwait().
  // A shell starts background jobs with SIGINT ignored; an ignored signal never reaches
  // sigwait(), so take both back to their default first (they stay blocked).
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  m3::CommandLine cmd;
  try {
    cmd = m3::parse_command_line(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "m3serve: %s\n", e.what());
    return 2;
  }
  if (cmd.help) {
    std::fputs(m3::command_line_help().c_str(), stdout);
    return 0;
  }
  spdlog::set_level(spdlog::level::from_str(cmd.config.log_level));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");

  try {
    m3::ServerApp app(cmd.config);
    int received = 0;
    sigwait(&stop_signals, &received);
    spdlog::info("received {}: shutting down (grace {:.1f}s)", received == SIGTERM ? "SIGTERM" : "SIGINT",
                 cmd.config.shutdown_grace_s);
    app.shutdown(std::chrono::duration<double>(cmd.config.shutdown_grace_s));
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return 1;
  }
  return 0;
}
