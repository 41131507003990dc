// m3drift as a program: bf16 against fp32 state on the tiny golden model, as JSON.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

namespace {

std::string run(const std::string& args, int* exit_code) {
  std::string out;
  FILE* p = popen((std::string("'") + M3DRIFT_PATH + "' " + args + " 2>&1").c_str(), "r");
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int status = pclose(p);
  *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

TEST(M3drift, ReportsTheErrorOfBf16StateAlongAGreedyPath) {
  const std::filesystem::path dir = std::filesystem::path(M3_TEST_DATA_DIR) / "golden_tiny";
  int code = -1;
  const std::string out = run("'" + dir.string() + "' --tokens 120 --sequences 2 --threads 1 --json", &code);
  ASSERT_EQ(code, 0) << out;
  const nlohmann::json j = nlohmann::json::parse(out);
  EXPECT_EQ(j["generated_tokens"], 120);
  EXPECT_EQ(j["sequences"], 2);
  const double worst = j["max_rel_err"];
  EXPECT_GT(worst, 0.0);  // the state is rounded
  EXPECT_LT(worst, 3e-2);
  EXPECT_LE(j["mean_rel_err"].get<double>(), worst);
  // The first generated token reads a state rounded after the prompt's steps.
  for (const char* k : {"1", "10", "100", "120"}) EXPECT_TRUE(j["rel_err_at_token"].contains(k)) << k;
  ASSERT_EQ(j["first_greedy_divergence"].size(), 2u);
  for (const auto& d : j["first_greedy_divergence"]) EXPECT_TRUE(d.is_null() || (d.get<int>() >= 1 && d.get<int>() <= 120));
}

TEST(M3drift, BadArgumentsExitTwo) {
  int code = -1;
  const std::string out = run("--tokens 0 somewhere", &code);
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("--tokens must be an integer in [1, 1000000], got \"0\""), std::string::npos) << out;
}

}  // namespace
