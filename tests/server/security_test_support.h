// Shared by the TLS, API key, drain and soak tests: a private temporary directory,
// certificates made with the openssl command at test time (no private key is kept in the
// repository), running a command for its exit status and output, and the server's
// Prometheus counters.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace m3::test {

// A directory of its own under the system's temporary directory, removed at the end.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& prefix) {
    std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp " + pattern);
    path = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

inline void write_text(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp, std::ios::binary | std::ios::trunc) << text;
  std::filesystem::rename(tmp, path);  // (a reader sees the old file or the new one)
}

struct CommandRun {
  int status = -1;  // exit status; -1: did not exit normally
  std::string out;  // stdout and stderr together
};

// Runs `command` with /bin/sh, stdout and stderr into `out`.
inline CommandRun run_command(const std::string& command) {
  TempDir dir("m3-cmd");
  const std::string out = dir / "out";
  const int raw = std::system((command + " >" + out + " 2>&1 </dev/null").c_str());
  return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, read_text(out)};
}

// A CA and certificates it signs, made with the openssl command (EC P-256, valid 2 days).
class TestPki {
 public:
  explicit TestPki(const std::string& prefix = "m3-pki") : dir_(prefix) {}

  // <name>.pem and <name>.key: a self-signed CA.
  void make_ca(const std::string& name) {
    run("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=" + name +
        " -keyout " + key(name) + " -out " + cert(name));
  }
  // <name>.pem and <name>.key signed by CA `ca`: a server certificate for localhost and
  // 127.0.0.1, or (client = true) a client certificate.
  void make_leaf(const std::string& name, const std::string& ca, bool client = false) {
    const std::string ext = dir_ / (name + ".ext");
    std::ofstream(ext) << (client ? "extendedKeyUsage=clientAuth\n"
                                  : "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n");
    run("openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=" + name + " -keyout " +
        key(name) + " -out " + (dir_ / (name + ".csr")));
    run("openssl x509 -req -days 2 -in " + (dir_ / (name + ".csr")) + " -CA " + cert(ca) + " -CAkey " + key(ca) +
        " -CAcreateserial -extfile " + ext + " -out " + cert(name));
  }
  std::string cert(const std::string& name) const { return dir_ / (name + ".pem"); }
  std::string key(const std::string& name) const { return dir_ / (name + ".key"); }
  std::string file(const std::string& name) const { return dir_ / name; }

 private:
  static void run(const std::string& command) {
    const CommandRun r = run_command(command);
    if (r.status != 0) throw std::runtime_error("openssl failed: " + command + "\n" + r.out);
  }
  TempDir dir_;
};

// The value of one series in the Prometheus text ("name{labels} value"); NaN when absent.
inline double prometheus_value(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  return std::nan("");
}

inline std::string requests_series(const std::string& status) {
  return "m3serve_requests_total{status=\"" + status + "\"}";
}

// Polls `done` every 10 ms for at most `limit`.
inline bool eventually_true(const std::function<bool()>& done,
                            std::chrono::milliseconds limit = std::chrono::seconds(10)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

// grpc.health.v1.Health/Check of `service` ("" = the server): "SERVING", "NOT_SERVING",
// or the call's failure ("error 14 ...").
inline std::string health_status(const std::shared_ptr<grpc::Channel>& channel, const std::string& service = "") {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  std::string request_bytes;
  if (!service.empty()) request_bytes = "\x0a" + std::string(1, static_cast<char>(service.size())) + service;
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1), response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status status) { done.set_value(std::move(status)); });
  const grpc::Status status = done.get_future().get();
  if (!status.ok()) return "error " + std::to_string(status.error_code()) + " " + status.error_message();
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (response.Dump(&slices).ok())
    for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  if (bytes == std::string("\x08\x01", 2)) return "SERVING";
  if (bytes == std::string("\x08\x02", 2)) return "NOT_SERVING";
  return "status bytes " + std::to_string(bytes.size());
}

}  // namespace m3::test
