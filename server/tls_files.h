// The server's TLS certificate, private key and (for mutual TLS) client CA, as gRPC's
// credentials serve them. The files are checked with OpenSSL first (readable, PEM, the key
// belongs to the certificate), so a mistake is an error at start naming the file rather
// than a failed handshake later. gRPC serves private copies of them, watched every second
// (a FileWatcherCertificateProvider); reload() (SIGHUP) checks the operator's files again
// and only then replaces the copies, so a certificate changes when the operator says so,
// a bad one never replaces a good one, and connections and streams already open stay.
#pragma once

#include <filesystem>
#include <memory>
#include <string>

namespace grpc {
class ServerCredentials;
}

namespace m3 {

class TlsFiles {
 public:
  // client_ca: "" = no client certificates asked for. Throws std::invalid_argument naming
  // the setting and file when one cannot be used.
  TlsFiles(std::string cert, std::string key, std::string client_ca);
  ~TlsFiles();  // removes the private copies
  TlsFiles(const TlsFiles&) = delete;
  TlsFiles& operator=(const TlsFiles&) = delete;

  // TLS credentials for a listening port (mutual TLS when a client CA is set).
  std::shared_ptr<grpc::ServerCredentials> credentials() const;
  bool mutual() const { return !client_ca_.empty(); }

  // Checks the files again and replaces what gRPC serves; throws (as the constructor) and
  // keeps the files in force on an error. New handshakes use the new files within about a
  // second (the watcher's period).
  void reload();

  // Throws std::invalid_argument when `key` is not the private key of `cert`'s first
  // certificate or either is not PEM (the messages name tls_cert / tls_key and the paths).
  static void check_key_pair(const std::string& cert, const std::string& key);
  // Throws when `path` holds no PEM certificate (`setting` names it in the message).
  static void check_certificates(const std::string& setting, const std::string& path);

 private:
  void copy_in();  // check all, then write a new generation of copies and switch to it

  std::string cert_, key_, client_ca_;
  std::filesystem::path dir_;  // private (0700) directory of the copies gRPC watches
  int generation_ = 0;         // dir_/gen-N holds the copies; dir_/current links to the newest
};

}  // namespace m3
