// dir:PATH — one file a snapshot (ID.m3snap). A snapshot is written to a temporary file
// in the same directory, fsynced, renamed over its name and the directory fsynced, so a
// crash leaves either the whole snapshot or none.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>

#include "server/snapshot_store.h"

namespace m3 {
namespace {

namespace fs = std::filesystem;
constexpr const char kSuffix[] = ".m3snap";

SnapshotStoreError unavailable(const std::string& what, const fs::path& p, int err) {
  return SnapshotStoreError(SnapshotStoreError::Kind::kUnavailable,
                            "snapshot store dir: " + what + " " + p.string() + ": " + std::strerror(err));
}

// Ids become file names: only what cannot climb out of the directory.
bool safe_id(const std::string& id) {
  if (id.empty() || id.size() > 128 || id[0] == '.') return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
           c == '.';
  });
}

void write_all(int fd, const std::byte* p, size_t n, const fs::path& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw unavailable("cannot write", path, errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

class DirBackend final : public SnapshotBackend {
 public:
  explicit DirBackend(fs::path dir) : dir_(std::move(dir)) {
    std::error_code ec;
    fs::create_directories(dir_, ec);
    if (ec || !fs::is_directory(dir_)) {
      throw std::runtime_error("snapshot_store dir:" + dir_.string() + ": cannot create the directory" +
                               (ec ? ": " + ec.message() : std::string(" (a file is in the way)")));
    }
  }
  std::string describe() const override { return "dir:" + dir_.string(); }

  void put(const std::string& id, std::span<const std::byte> bytes, std::chrono::milliseconds) override {
    if (!safe_id(id)) throw std::invalid_argument("snapshot id '" + id + "' cannot name a file");
    static thread_local std::mt19937_64 rng{std::random_device{}()};
    const fs::path tmp = dir_ / ("." + id + ".tmp-" + std::to_string(rng()));
    const fs::path dst = file(id);
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) throw unavailable("cannot create", tmp, errno);
    try {
      write_all(fd, bytes.data(), bytes.size(), tmp);
      if (::fsync(fd) != 0) throw unavailable("cannot fsync", tmp, errno);
    } catch (...) {
      ::close(fd);
      ::unlink(tmp.c_str());
      throw;
    }
    ::close(fd);
    if (::rename(tmp.c_str(), dst.c_str()) != 0) {
      const int err = errno;
      ::unlink(tmp.c_str());
      throw unavailable("cannot rename into", dst, err);
    }
    sync_dir();
  }

  std::optional<std::vector<std::byte>> get(const std::string& id) override {
    if (!safe_id(id)) return std::nullopt;
    const fs::path p = file(id);
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT) return std::nullopt;
      throw unavailable("cannot open", p, errno);
    }
    std::vector<std::byte> out;
    struct stat st {};
    if (::fstat(fd, &st) == 0 && st.st_size > 0) out.reserve(static_cast<size_t>(st.st_size));
    std::byte buf[1 << 16];
    for (;;) {
      const ssize_t r = ::read(fd, buf, sizeof buf);
      if (r < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        ::close(fd);
        throw unavailable("cannot read", p, err);
      }
      if (r == 0) break;
      out.insert(out.end(), buf, buf + r);
    }
    ::close(fd);
    return out;
  }

  bool remove(const std::string& id) override {
    if (!safe_id(id)) return false;
    const fs::path p = file(id);
    if (::unlink(p.c_str()) != 0) {
      if (errno == ENOENT) return false;
      throw unavailable("cannot remove", p, errno);
    }
    sync_dir();
    return true;
  }

  std::vector<Entry> existing() override {
    struct Found {
      Entry e;
      fs::file_time_type at;
    };
    std::vector<Found> found;
    std::error_code ec;
    for (const auto& f : fs::directory_iterator(dir_, ec)) {
      const std::string name = f.path().filename().string();
      if (name.size() <= sizeof kSuffix - 1 || name[0] == '.' ||
          name.compare(name.size() - (sizeof kSuffix - 1), std::string::npos, kSuffix) != 0)
        continue;
      std::error_code e1, e2;
      const uint64_t size = f.file_size(e1);
      const auto at = f.last_write_time(e2);
      if (e1 || e2) continue;
      found.push_back({{name.substr(0, name.size() - (sizeof kSuffix - 1)), size}, at});
    }
    std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.at < b.at; });
    std::vector<Entry> out;
    for (auto& f : found) out.push_back(std::move(f.e));
    return out;
  }

 private:
  fs::path file(const std::string& id) const { return dir_ / (id + kSuffix); }
  void sync_dir() {
    const int fd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) throw unavailable("cannot open", dir_, errno);
    const int rc = ::fsync(fd);
    const int err = errno;
    ::close(fd);
    if (rc != 0) throw unavailable("cannot fsync", dir_, err);
  }

  fs::path dir_;
};

}  // namespace

std::unique_ptr<SnapshotBackend> make_dir_snapshot_backend(const std::string& path) {
  return std::make_unique<DirBackend>(path);
}

}  // namespace m3
