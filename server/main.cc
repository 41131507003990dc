// m3serve: serves a Mamba-3 MIMO decoder over gRPC (see configs/server.yaml, --help).
#include <signal.h>
#include <unistd.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "server/server_app.h"
#include "server/server_config.h"

namespace {

// SIGTERM/SIGINT: the handler (any thread may run it) writes the signal number into a
// pipe; main() waits on the pipe and shuts down outside signal context.
int g_signal_pipe[2] = {-1, -1};

extern "C" void on_stop_signal(int sig) {
  const unsigned char byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = write(g_signal_pipe[1], &byte, 1);
}

void install_stop_signal_handlers() {
  if (pipe(g_signal_pipe) != 0) throw std::runtime_error("cannot create the signal pipe");
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  // Also takes SIGINT back from SIG_IGN (a shell's background jobs start with it ignored).
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

int wait_for_stop_signal() {
  unsigned char byte = 0;
  while (read(g_signal_pipe[0], &byte, 1) != 1) {
  }
  return byte;
}

}  // namespace

int main(int argc, char** argv) {
  install_stop_signal_handlers();

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
    const int received = wait_for_stop_signal();
    spdlog::info("received {}: shutting down (grace {:.1f}s)", received == SIGTERM ? "SIGTERM" : "SIGINT",
                 cmd.config.shutdown_grace_s);
    app.shutdown(std::chrono::duration<double>(cmd.config.shutdown_grace_s));
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return 1;
  }
  return 0;
}
