// m3serve: serves a Mamba-3 MIMO decoder over gRPC (see configs/server.yaml, --help).
#include <poll.h>
#include <signal.h>
#include <unistd.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "server/server_app.h"
#include "server/server_config.h"

namespace {

// SIGTERM/SIGINT/SIGHUP: the handler (any thread may run it) writes the signal number
// into a pipe; main() reads the pipe and acts outside signal context.
int g_signal_pipe[2] = {-1, -1};

extern "C" void on_signal(int sig) {
  const unsigned char byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = write(g_signal_pipe[1], &byte, 1);
}

void install_signal_handlers() {
  if (pipe(g_signal_pipe) != 0) throw std::runtime_error("cannot create the signal pipe");
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  // Also takes SIGINT back from SIG_IGN (a shell's background jobs start with it ignored).
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGHUP, &action, nullptr);
}

// The next signal, or 0 when `timeout` passed first (negative: wait for ever).
int next_signal(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int wait_ms = -1;
    if (timeout.count() >= 0) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return 0;
      wait_ms = static_cast<int>(std::min<int64_t>(left.count(), INT32_MAX));
    }
    pollfd fd{g_signal_pipe[0], POLLIN, 0};
    if (poll(&fd, 1, wait_ms) <= 0) continue;  // (EINTR, or the time is up: checked above)
    unsigned char byte = 0;
    if (read(g_signal_pipe[0], &byte, 1) == 1) return byte;
  }
}

const char* signal_name(int sig) { return sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "SIGHUP"; }

}  // namespace

int main(int argc, char** argv) {
  install_signal_handlers();

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
    while ((received = next_signal(std::chrono::milliseconds(-1))) == SIGHUP) app.reload();
    // The drain: load balancers' health checks see NOT_SERVING while requests are still
    // served; a second SIGTERM/SIGINT ends the delay early.
    spdlog::info("received {}: shutting down (drain {:g}s, then grace {:.1f}s)", signal_name(received),
                 cmd.config.drain_delay_s, cmd.config.shutdown_grace_s);
    if (cmd.config.drain_delay_s > 0) {
      app.begin_drain();
      const auto delay = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::duration<double>(cmd.config.drain_delay_s));
      const auto end = std::chrono::steady_clock::now() + delay;
      for (int sig = -1; sig != 0 && sig != SIGTERM && sig != SIGINT;) {
        if (sig == SIGHUP) app.reload();
        sig = next_signal(std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                                     end - std::chrono::steady_clock::now())));
        if (sig == SIGTERM || sig == SIGINT) spdlog::info("received {} again: the drain delay ends now", signal_name(sig));
      }
    }
    app.shutdown(std::chrono::duration<double>(cmd.config.shutdown_grace_s));
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return 1;
  }
  return 0;
}
