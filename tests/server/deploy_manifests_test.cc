// deploy/k8s and deploy/envoy load, and agree with configs/server.yaml and with each
// other: the ports the Deployment's flags listen on are its container ports, the probes
// ask the health service where it is served in plaintext, the readiness probe and Envoy's
// health check see NOT_SERVING within drain_delay_s, the liveness probe never kills a
// draining pod, terminationGracePeriodSeconds covers preStop + drain_delay_s +
// shutdown_grace_s, the secrets and the model volume are mounted where the flags point,
// and Envoy keeps a session's stream for longer than session_idle_timeout_s. (The
// Deployment and Service are also checked against Kubernetes' schemas when
// kubernetes-validate is installed: production_tests.cmake.)
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>

#include "m3serve.grpc.pb.h"
#include "server/server_config.h"

namespace m3 {
namespace {

namespace fs = std::filesystem;
const fs::path kRoot = M3_TEST_SOURCE_DIR;

ServerConfig shipped_config() { return load_server_config_file((kRoot / "configs/server.yaml").string()); }

std::map<std::string, YAML::Node> k8s_objects() {
  std::map<std::string, YAML::Node> by_kind;
  for (const auto& entry : fs::directory_iterator(kRoot / "deploy/k8s")) {
    if (entry.path().extension() != ".yaml") continue;
    for (const YAML::Node& doc : YAML::LoadAllFromFile(entry.path().string())) {
      EXPECT_TRUE(doc["apiVersion"] && doc["kind"]) << entry.path();
      if (doc["kind"].as<std::string>() != "Kustomization") {
        EXPECT_TRUE(doc["metadata"]["name"]) << entry.path();
      }
      EXPECT_EQ(by_kind.count(doc["kind"].as<std::string>()), 0u) << "two of " << doc["kind"];
      by_kind[doc["kind"].as<std::string>()] = doc;
    }
  }
  return by_kind;
}

// "--some-key=value" arguments as setting names ("some_key") and values.
std::map<std::string, std::string> flags_of(const YAML::Node& args) {
  std::map<std::string, std::string> flags;
  for (const auto& arg : args) {
    const std::string text = arg.as<std::string>();
    EXPECT_EQ(text.rfind("--", 0), 0u) << text;
    const size_t eq = text.find('=');
    EXPECT_NE(eq, std::string::npos) << text << ": give flags as --flag=value";
    std::string key = text.substr(2, eq - 2);
    for (char& c : key)
      if (c == '-') c = '_';
    flags[key] = text.substr(eq + 1);
  }
  return flags;
}

int port_of(const std::string& address) { return std::stoi(address.substr(address.rfind(':') + 1)); }

double seconds(const YAML::Node& duration) {  // Envoy's "2s", "0.5s"
  const std::string text = duration.as<std::string>();
  EXPECT_EQ(text.back(), 's') << text;
  return std::stod(text.substr(0, text.size() - 1));
}

TEST(DeployManifestsTest, TheKustomizationListsEveryManifest) {
  auto objects = k8s_objects();
  ASSERT_TRUE(objects.count("Kustomization"));
  std::set<std::string> listed, present;
  for (const auto& r : objects["Kustomization"]["resources"]) listed.insert(r.as<std::string>());
  for (const auto& entry : fs::directory_iterator(kRoot / "deploy/k8s"))
    if (entry.path().extension() == ".yaml" && entry.path().filename() != "kustomization.yaml")
      present.insert(entry.path().filename().string());
  EXPECT_EQ(listed, present);
  for (const char* kind : {"Deployment", "Service", "PodMonitor"}) EXPECT_TRUE(objects.count(kind)) << kind;
}

TEST(DeployManifestsTest, TheDeploymentAgreesWithTheServerConfig) {
  const ServerConfig config = shipped_config();
  auto objects = k8s_objects();
  const YAML::Node deployment = objects["Deployment"];
  const YAML::Node pod = deployment["spec"]["template"]["spec"];
  ASSERT_EQ(pod["containers"].size(), 1u);
  const YAML::Node container = pod["containers"][0];
  const auto flags = flags_of(container["args"]);

  // Every flag is one of m3serve's.
  const std::string help = command_line_help();
  for (const auto& [key, value] : flags) {
    std::string flag = "--" + key;
    for (char& c : flag)
      if (c == '_') c = '-';
    EXPECT_NE(help.find("  " + flag + " "), std::string::npos) << flag << " is not an m3serve flag";
  }
  // Timings from configs/server.yaml (which the image reads), unless the flags say otherwise.
  const double drain = flags.count("drain_delay_s") ? std::stod(flags.at("drain_delay_s")) : config.drain_delay_s;
  const double grace =
      flags.count("shutdown_grace_s") ? std::stod(flags.at("shutdown_grace_s")) : config.shutdown_grace_s;
  EXPECT_GT(drain, 0) << "without a drain delay load balancers see connections refused before NOT_SERVING";

  std::map<std::string, int> ports;
  for (const auto& p : container["ports"]) ports[p["name"].as<std::string>()] = p["containerPort"].as<int>();
  ASSERT_TRUE(flags.count("listen") && flags.count("metrics_listen") && flags.count("health_listen"));
  EXPECT_EQ(flags.at("listen").substr(0, 8), "0.0.0.0:");
  EXPECT_EQ(port_of(flags.at("listen")), ports["grpc"]);
  EXPECT_EQ(port_of(flags.at("health_listen")), ports["health"]);
  EXPECT_EQ(port_of(flags.at("metrics_listen")), ports["metrics"]);

  // Probes: the kubelet's gRPC probes speak no TLS, so with TLS on they ask the
  // plaintext health port.
  const int probe_port = flags.count("tls_cert") ? ports["health"] : ports["grpc"];
  for (const char* probe : {"startupProbe", "readinessProbe", "livenessProbe"}) {
    ASSERT_TRUE(container[probe]["grpc"]) << probe << " is not a native gRPC probe";
    EXPECT_EQ(container[probe]["grpc"]["port"].as<int>(), probe_port) << probe;
  }
  const YAML::Node readiness = container["readinessProbe"];
  EXPECT_EQ(readiness["grpc"]["service"].as<std::string>(), m3serve::v1::M3Serve::service_full_name());
  const auto window = [](const YAML::Node& probe) {
    return probe["periodSeconds"].as<double>() * probe["failureThreshold"].as<double>();
  };
  EXPECT_LE(window(readiness) + readiness["timeoutSeconds"].as<double>(), drain)
      << "the readiness probe may not see NOT_SERVING before the server stops accepting";

  // Termination: preStop, then SIGTERM: drain_delay_s, shutdown_grace_s, and the 5 s in
  // which gRPC closes what the grace left (ServerApp::shutdown).
  const YAML::Node pre_stop = container["lifecycle"]["preStop"]["exec"]["command"];
  ASSERT_EQ(pre_stop.size(), 2u);
  EXPECT_EQ(pre_stop[0].as<std::string>(), "sleep");
  const double pre_stop_s = pre_stop[1].as<double>();
  const double needed = pre_stop_s + drain + grace + 5;
  const double termination = pod["terminationGracePeriodSeconds"].as<double>();
  EXPECT_GE(termination, needed) << "SIGKILL would cut the drain";
  EXPECT_LE(termination, needed + 30) << "a stuck pod would linger";
  EXPECT_GT(window(container["livenessProbe"]), pre_stop_s + drain + grace)
      << "the liveness probe could restart a draining pod";

  EXPECT_GE(container["resources"]["limits"]["nvidia.com/gpu"].as<int>(), 1);

  // The files the flags name are on the volumes meant for them.
  std::map<std::string, std::string> mount_volume;  // mount path -> volume name
  for (const auto& m : container["volumeMounts"]) mount_volume[m["mountPath"].as<std::string>()] = m["name"].as<std::string>();
  std::map<std::string, YAML::Node> volumes;
  for (const YAML::Node& v : pod["volumes"]) volumes[v["name"].as<std::string>()] = v;
  const auto volume_of = [&](const std::string& file) -> YAML::Node {
    for (const auto& [path, name] : mount_volume)
      if (file.rfind(path + "/", 0) == 0) return volumes[name];
    ADD_FAILURE() << file << " is on no mounted volume";
    return YAML::Node();
  };
  for (const char* secret_file : {"tls_cert", "tls_key", "api_keys", "metrics_auth"}) {
    ASSERT_TRUE(flags.count(secret_file)) << secret_file;
    EXPECT_TRUE(volume_of(flags.at(secret_file))["secret"]) << secret_file << " is not from a Secret";
  }
  EXPECT_EQ(volume_of(flags.at("tls_cert"))["secret"]["secretName"].as<std::string>(),
            volume_of(flags.at("tls_key"))["secret"]["secretName"].as<std::string>());
  ASSERT_TRUE(flags.count("model"));
  EXPECT_TRUE(volume_of(flags.at("model"))["persistentVolumeClaim"]) << "the model is not on a volume";
}

TEST(DeployManifestsTest, TheServiceAndPodMonitorSelectTheDeploymentsPods) {
  auto objects = k8s_objects();
  const YAML::Node pod = objects["Deployment"]["spec"]["template"];
  const auto labels = pod["metadata"]["labels"].as<std::map<std::string, std::string>>();
  const auto selects = [&](const YAML::Node& selector) {
    for (const auto& [k, v] : selector.as<std::map<std::string, std::string>>())
      if (!labels.count(k) || labels.at(k) != v) return false;
    return true;
  };
  std::set<std::string> port_names;
  for (const auto& p : pod["spec"]["containers"][0]["ports"]) port_names.insert(p["name"].as<std::string>());

  const YAML::Node service = objects["Service"];
  EXPECT_TRUE(selects(service["spec"]["selector"]));
  EXPECT_EQ(service["spec"]["clusterIP"].as<std::string>(), "None") << "headless: Envoy balances per replica";
  for (const auto& p : service["spec"]["ports"]) EXPECT_TRUE(port_names.count(p["targetPort"].as<std::string>()));

  const YAML::Node monitor = objects["PodMonitor"];
  EXPECT_TRUE(selects(monitor["spec"]["selector"]["matchLabels"]));
  const YAML::Node endpoint = monitor["spec"]["podMetricsEndpoints"][0];
  EXPECT_TRUE(port_names.count(endpoint["port"].as<std::string>()));
  EXPECT_EQ(endpoint["path"].as<std::string>(), "/metrics");
  std::string metrics_secret;
  for (const auto& v : pod["spec"]["volumes"])
    if (v["name"].as<std::string>() == "metrics-auth") metrics_secret = v["secret"]["secretName"].as<std::string>();
  EXPECT_EQ(endpoint["basicAuth"]["username"]["name"].as<std::string>(), metrics_secret);
  EXPECT_EQ(endpoint["basicAuth"]["password"]["name"].as<std::string>(), metrics_secret);
}

TEST(DeployManifestsTest, EnvoyBalancesGrpcOverHttp2AndSeesTheDrainInTime) {
  const ServerConfig config = shipped_config();
  auto objects = k8s_objects();
  const YAML::Node envoy = YAML::LoadFile((kRoot / "deploy/envoy/envoy.yaml").string());
  const YAML::Node cluster = envoy["static_resources"]["clusters"][0];
  EXPECT_TRUE(cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
                     ["explicit_http_config"]["http2_protocol_options"])
      << "gRPC needs HTTP/2 to the replicas";
  const YAML::Node check = cluster["health_checks"][0];
  EXPECT_EQ(check["grpc_health_check"]["service_name"].as<std::string>(), m3serve::v1::M3Serve::service_full_name());
  EXPECT_LE(seconds(check["interval"]) * check["unhealthy_threshold"].as<double>() + seconds(check["timeout"]),
            config.drain_delay_s)
      << "Envoy may not see NOT_SERVING before the replica stops accepting";

  // The replicas: the headless Service's name, on the Deployment's gRPC port.
  const YAML::Node address =
      cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
  EXPECT_EQ(address["address"].as<std::string>().rfind(objects["Service"]["metadata"]["name"].as<std::string>() + ".", 0), 0u);
  int grpc_port = 0;
  for (const auto& p : objects["Service"]["spec"]["ports"])
    if (p["name"].as<std::string>() == "grpc") grpc_port = p["port"].as<int>();
  EXPECT_EQ(address["port_value"].as<int>(), grpc_port);
  EXPECT_EQ(cluster["type"].as<std::string>(), "STRICT_DNS") << "one upstream host per replica";

  const YAML::Node manager = envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
  EXPECT_GT(seconds(manager["stream_idle_timeout"]), config.session_idle_timeout_s)
      << "Envoy would end idle sessions before the server does";
  EXPECT_EQ(seconds(manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["timeout"]), 0)
      << "a route timeout would cut long streams";
}

TEST(DeployManifestsTest, TheImageListsOnEveryAddressExplicitly) {
  std::ifstream in(kRoot / "Dockerfile");
  const std::string dockerfile(std::istreambuf_iterator<char>(in), {});
  EXPECT_NE(dockerfile.find("\"--listen\", \"0.0.0.0:50051\""), std::string::npos);
  EXPECT_NE(dockerfile.find("\"--metrics-listen\", \"0.0.0.0:9464\""), std::string::npos);
  const ServerConfig config = shipped_config();
  EXPECT_EQ(config.listen.substr(0, 10), "127.0.0.1:") << "the default config must listen on loopback";
  EXPECT_EQ(config.metrics_listen.substr(0, 10), "127.0.0.1:");
}

}  // namespace
}  // namespace m3
