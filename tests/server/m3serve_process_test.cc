// The m3serve executable as an operator runs it: a bad flag or a missing model directory
// exits 2 with a message, a model it cannot load or a port it cannot listen on exits 1
// with one; started with the demo model it serves, and SIGTERM stops it with exit status 0.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
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
#include <utility>
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

// Kills and reaps a server the test did not stop itself (a failed assertion returns early).
struct KillIfRunning {
  pid_t& pid;
  ~KillIfRunning() {
    if (pid <= 0) return;
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
};

// Runs m3serve with `args` to its exit (one that still runs after 60 s is killed: -1);
// its status and log.
std::pair<int, std::string> run_to_exit(const std::vector<std::string>& args, const std::string& name) {
  Process p = spawn_m3serve(args, name);
  int status = -1;
  for (int i = 0; i < 6000; ++i) {
    int raw = 0;
    if (waitpid(p.pid, &raw, WNOHANG) == p.pid) {
      status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (status == -1) {
    ADD_FAILURE() << "m3serve " << name << " did not exit within 60 s";
    kill(p.pid, SIGKILL);
    waitpid(p.pid, nullptr, 0);
  }
  std::string log = read_all(p.log);
  std::filesystem::remove(p.log);
  return {status, log};
}

TEST(M3serveProcessTest, BadFlagExitsTwoWithAMessage) {
  Process p = spawn_m3serve({"--max-batch", "0"}, "m3serve-badflag");
  EXPECT_EQ(exit_status(p.pid), 2);
  EXPECT_EQ(read_all(p.log), "m3serve: --max-batch: expected auto or a positive integer, got '0'\n");
  std::filesystem::remove(p.log);
}

TEST(M3serveProcessTest, AMissingModelDirectoryExitsTwo) {
  const auto [status, log] = run_to_exit({"--model", "/nonexistent/m3-model"}, "m3serve-nomodel");
  EXPECT_EQ(status, 2);
  EXPECT_EQ(log, "m3serve: model: '/nonexistent/m3-model' is not a directory\n");
}

TEST(M3serveProcessTest, AModelItCannotLoadExitsOneNamingTheFile) {
  const auto dir = std::filesystem::temp_directory_path() / ("m3serve-badmodel-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << "{\"d_model\": 64,";
  const auto [status, log] =
      run_to_exit({"--backend", "cpu", "--model", dir.string(), "--metrics-listen", ""}, "m3serve-badmodel");
  EXPECT_EQ(status, 1);
  EXPECT_NE(log.find((dir / "config.json").string()), std::string::npos) << log;
  EXPECT_EQ(log.find("serving m3serve.v1.M3Serve"), std::string::npos) << log;
  std::filesystem::remove_all(dir);
}

TEST(M3serveProcessTest, APortInUseExitsOne) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), len), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string listen = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  const auto demo_dir = std::filesystem::temp_directory_path() / ("m3serve-busyport-" + std::to_string(getpid()));
  const auto [status, log] = run_to_exit({"--backend", "cpu", "--listen", listen, "--metrics-listen", "",
                                          "--demo-model-dir", demo_dir.string()},
                                         "m3serve-busyport");
  close(fd);
  EXPECT_EQ(status, 1);
  EXPECT_NE(log.find("cannot listen for gRPC on " + listen), std::string::npos) << log;
  std::filesystem::remove_all(demo_dir);
}

TEST(M3serveProcessTest, ServesTheDemoModelAndStopsOnSigterm) {
  const auto demo_dir = std::filesystem::temp_directory_path() /
                        ("m3serve-process-demo-" + std::to_string(getpid()));
  Process p = spawn_m3serve({"--backend", "cpu", "--listen", "127.0.0.1:0", "--metrics-listen", "",
                             "--demo-model-dir", demo_dir.string(), "--shutdown-grace-s", "1", "--drain-delay-s", "0"},
                            "m3serve-demo");
  KillIfRunning guard{p.pid};
  std::string log;
  for (int i = 0; i < 1500 && log.find("serving m3serve.v1.M3Serve on") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    log = read_all(p.log);
  }
  ASSERT_NE(log.find("serving m3serve.v1.M3Serve on 127.0.0.1:"), std::string::npos) << log;
  EXPECT_NE(log.find("serving a DEMO model with random weights"), std::string::npos) << log;
  kill(p.pid, SIGTERM);
  EXPECT_EQ(exit_status(p.pid), 0);
  p.pid = -1;  // reaped
  log = read_all(p.log);
  EXPECT_NE(log.find("received SIGTERM: shutting down"), std::string::npos) << log;
  EXPECT_NE(log.find("server stopped"), std::string::npos) << log;
  std::filesystem::remove(p.log);
  std::filesystem::remove_all(demo_dir);
}

}  // namespace
