// The m3serve executable as an operator runs it: a bad flag exits 2 with a message;
// started with the demo model it serves, and SIGTERM stops it with exit status 0.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

struct Process {
  pid_t pid = -1;
  std::filesystem::path log;
};

Process spawn_m3serve(const std::vector<std::string>& args, const std::string& name) {
  Process p;
  p.log = std::filesystem::temp_directory_path() / (name + "-" + std::to_string(getpid()) + ".log");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, p.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  std::vector<std::string> all = {M3_TEST_M3SERVE};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  EXPECT_EQ(posix_spawn(&p.pid, M3_TEST_M3SERVE, &actions, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  return p;
}

std::string read_all(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int exit_status(pid_t pid) {
  int status = 0;
  EXPECT_EQ(waitpid(pid, &status, 0), pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(M3serveProcessTest, BadFlagExitsTwoWithAMessage) {
  Process p = spawn_m3serve({"--max-batch", "0"}, "m3serve-badflag");
  EXPECT_EQ(exit_status(p.pid), 2);
  EXPECT_EQ(read_all(p.log), "m3serve: max_batch must be between 1 and 1024, got 0\n");
  std::filesystem::remove(p.log);
}

TEST(M3serveProcessTest, ServesTheDemoModelAndStopsOnSigterm) {
  const auto demo_dir = std::filesystem::temp_directory_path() /
                        ("m3serve-process-demo-" + std::to_string(getpid()));
  Process p = spawn_m3serve({"--backend", "cpu", "--listen", "127.0.0.1:0", "--metrics-listen", "",
                             "--demo-model-dir", demo_dir.string(), "--shutdown-grace-s", "1"},
                            "m3serve-demo");
  std::string log;
  for (int i = 0; i < 300 && log.find("serving m3serve.v1.M3Serve on") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    log = read_all(p.log);
  }
  ASSERT_NE(log.find("serving m3serve.v1.M3Serve on 127.0.0.1:"), std::string::npos) << log;
  EXPECT_NE(log.find("serving a DEMO model with random weights"), std::string::npos) << log;
  kill(p.pid, SIGTERM);
  EXPECT_EQ(exit_status(p.pid), 0);
  log = read_all(p.log);
  EXPECT_NE(log.find("received SIGTERM: shutting down"), std::string::npos) << log;
  EXPECT_NE(log.find("server stopped"), std::string::npos) << log;
  std::filesystem::remove(p.log);
  std::filesystem::remove_all(demo_dir);
}

}  // namespace
