// An m3serve executable run as a child process by a test (the drain, SIGHUP and soak tests
// need the real signal handling and a process of its own to measure): started with
// arguments, its log in a file, its gRPC and metrics ports read from its start line;
// killed at the end if the test did not stop it.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace m3::test {

class M3serveChild {
 public:
  // Starts `executable` with `args` and waits (up to 60 s) for its "serving ..." line;
  // ok() says whether it came.
  M3serveChild(const std::string& executable, const std::vector<std::string>& args, const std::string& log_path)
      : log_(log_path) {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    std::vector<std::string> all = {executable};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, executable.c_str(), &actions, nullptr, argv.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
    const std::regex serving(R"(serving m3serve\.v1\.M3Serve on [^ ]*:(\d+) .*\(metrics: (off|https?://[^ ]*:(\d+)/metrics))");
    for (int i = 0; pid_ > 0 && i < 3000 && !exited(); ++i) {
      std::smatch m;
      const std::string text = log();
      if (std::regex_search(text, m, serving)) {
        port_ = std::stoi(m[1]);
        if (m[3].matched) metrics_port_ = std::stoi(m[3]);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ~M3serveChild() {
    if (pid_ > 0 && !exited()) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    std::error_code ec;
    std::filesystem::remove(log_, ec);
  }

  bool ok() const { return port_ > 0; }
  pid_t pid() const { return pid_; }
  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  std::string log() const {
    std::ifstream in(log_);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  void signal(int sig) const { kill(pid_, sig); }

  // Whether it has exited (reaping it; its status then in exit_status()).
  bool exited() {
    if (reaped_) return true;
    int raw = 0;
    if (waitpid(pid_, &raw, WNOHANG) != pid_) return false;
    reaped_ = true;
    status_ = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
    return true;
  }
  // Waits up to `limit` for it to exit; its status, or -1 when it still runs.
  int wait_exit(std::chrono::milliseconds limit) {
    const auto end = std::chrono::steady_clock::now() + limit;
    while (!exited() && std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return exited() ? status_ : -1;
  }

 private:
  std::string log_;
  pid_t pid_ = -1;
  int port_ = 0;
  int metrics_port_ = 0;
  bool reaped_ = false;
  int status_ = -1;
};

}  // namespace m3::test
