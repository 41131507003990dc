#include "server/tls_files.h"

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <system_error>

namespace m3 {
namespace {

constexpr const char* kCertCopy = "cert.pem";
constexpr const char* kKeyCopy = "key.pem";
constexpr const char* kClientCaCopy = "client-ca.pem";
// How often gRPC looks at the copies; they change only in reload().
constexpr unsigned kWatchSeconds = 1;

std::string read_bytes(const std::string& setting, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument(setting + ": cannot read '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string openssl_error() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "not PEM";
  char text[256];
  ERR_error_string_n(e, text, sizeof text);
  return text;
}

struct Bio {
  explicit Bio(const std::string& bytes) : bio(BIO_new_mem_buf(bytes.data(), static_cast<int>(bytes.size()))) {}
  ~Bio() { BIO_free(bio); }
  BIO* bio;
};

// The first certificate of a PEM file.
std::unique_ptr<X509, decltype(&X509_free)> first_certificate(const std::string& setting, const std::string& path) {
  const std::string bytes = read_bytes(setting, path);
  Bio in(bytes);
  ERR_clear_error();
  X509* cert = PEM_read_bio_X509(in.bio, nullptr, nullptr, nullptr);
  if (cert == nullptr)
    throw std::invalid_argument(setting + ": '" + path + "' holds no PEM certificate (" + openssl_error() + ")");
  return {cert, &X509_free};
}

void write_private(const std::filesystem::path& path, const std::string& bytes) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << bytes;
    if (!out) throw std::runtime_error("tls: cannot write " + path.string());
  }
  std::filesystem::permissions(path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
}

}  // namespace

void TlsFiles::check_certificates(const std::string& setting, const std::string& path) {
  first_certificate(setting, path);
}

void TlsFiles::check_key_pair(const std::string& cert_path, const std::string& key_path) {
  auto cert = first_certificate("tls_cert", cert_path);
  const std::string key_bytes = read_bytes("tls_key", key_path);
  Bio in(key_bytes);
  ERR_clear_error();
  EVP_PKEY* key = PEM_read_bio_PrivateKey(in.bio, nullptr, nullptr, nullptr);
  if (key == nullptr)
    throw std::invalid_argument("tls_key: '" + key_path + "' holds no PEM private key (" + openssl_error() +
                                "; an encrypted key is not supported)");
  const int matches = X509_check_private_key(cert.get(), key);
  EVP_PKEY_free(key);
  ERR_clear_error();
  if (matches != 1)
    throw std::invalid_argument("tls_key: '" + key_path + "' is not the private key of the certificate in tls_cert '" +
                                cert_path + "'");
}

TlsFiles::TlsFiles(std::string cert, std::string key, std::string client_ca)
    : cert_(std::move(cert)), key_(std::move(key)), client_ca_(std::move(client_ca)) {
  std::string pattern = (std::filesystem::temp_directory_path() / "m3serve-tls-XXXXXX").string();
  if (mkdtemp(pattern.data()) == nullptr)  // (mode 0700)
    throw std::runtime_error("tls: cannot create a private directory under " +
                             std::filesystem::temp_directory_path().string());
  dir_ = pattern;
  try {
    copy_in();
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
    throw;
  }
}

TlsFiles::~TlsFiles() {
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

void TlsFiles::copy_in() {
  check_key_pair(cert_, key_);
  if (!client_ca_.empty()) check_certificates("tls_client_ca", client_ca_);
  // Read once more for the copies: what was checked is what is served (unless the files
  // change in between, which the next SIGHUP repairs).
  const std::string cert = read_bytes("tls_cert", cert_);
  const std::string key = read_bytes("tls_key", key_);
  const std::string ca = client_ca_.empty() ? "" : read_bytes("tls_client_ca", client_ca_);
  // A new generation of the files, then the link "current" swapped to it at once (as the
  // kubelet updates a Secret's volume): gRPC's watcher reads the files through the link and
  // reads again when they change while it reads, so it never pairs one generation's key
  // with another's certificate. The generation before stays for a reader still in it.
  ++generation_;
  const std::filesystem::path fresh = dir_ / ("gen-" + std::to_string(generation_));
  std::filesystem::create_directory(fresh);
  write_private(fresh / kKeyCopy, key);
  write_private(fresh / kCertCopy, cert);
  if (!client_ca_.empty()) write_private(fresh / kClientCaCopy, ca);
  std::filesystem::remove(dir_ / "current.new");
  std::filesystem::create_directory_symlink(fresh.filename(), dir_ / "current.new");
  std::filesystem::rename(dir_ / "current.new", dir_ / "current");
  std::error_code ec;
  if (generation_ > 2) std::filesystem::remove_all(dir_ / ("gen-" + std::to_string(generation_ - 2)), ec);
}

void TlsFiles::reload() { copy_in(); }

std::shared_ptr<grpc::ServerCredentials> TlsFiles::credentials() const {
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> provider;
  if (client_ca_.empty()) {
    provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        (dir_ / "current" / kKeyCopy).string(), (dir_ / "current" / kCertCopy).string(), kWatchSeconds);
  } else {
    provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        (dir_ / "current" / kKeyCopy).string(), (dir_ / "current" / kCertCopy).string(),
        (dir_ / "current" / kClientCaCopy).string(), kWatchSeconds);
  }
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (client_ca_.empty()) {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

}  // namespace m3
