// Tensor/sequence-parallel plumbing: the torchrun-style environment and the local launcher, in
// this process.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "distributed_test_util.h"
#include "vlmgen/distributed/launch.h"
#include "vlmgen/error.h"
#include "vlmgen/parallel.h"

namespace vlmgen {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;
using Clock = std::chrono::steady_clock;
using distributed_test::seconds_since;

// ---------------------------------------------------------------------------------------------
// Helpers

// Sets (or, with nullopt, unsets) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(std::string name, const std::optional<std::string>& value) : name_(std::move(name)) {
    if (const char* old = std::getenv(name_.c_str())) old_ = old;
    if (value) {
      ::setenv(name_.c_str(), value->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// Clears every torchrun variable, then sets the given ones.
class TorchrunEnv {
 public:
  explicit TorchrunEnv(const std::vector<std::pair<std::string, std::string>>& values) {
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}) {
      std::optional<std::string> value;
      for (const auto& kv : values) {
        if (kv.first == name) value = kv.second;
      }
      guards_.push_back(std::make_unique<ScopedEnv>(name, value));
    }
  }

 private:
  std::vector<std::unique_ptr<ScopedEnv>> guards_;
};

// ---------------------------------------------------------------------------------------------
// The environment, in this process.

TEST(DistributedEnvTest, NoVariablesMeansASingleProcess) {
  TorchrunEnv env({});
  EXPECT_FALSE(read_distributed_env().has_value());
  ParallelContext par = init_parallel_from_env();
  EXPECT_EQ(par.world_size(), 1);
  EXPECT_EQ(par.tp_size(), 1);
  EXPECT_EQ(par.tp_group(), nullptr);
  EXPECT_THAT([] { init_parallel_from_env(2); }, ThrowsMessage<Error>(HasSubstr("tensor-parallel size 2 needs 2")));
}

TEST(DistributedEnvTest, WorldOfOneNeedsNoRendezvous) {
  TorchrunEnv env({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  ParallelContext par = init_parallel_from_env();
  EXPECT_EQ(par.world_size(), 1);
  EXPECT_EQ(par.tp_group(), nullptr);
}

TEST(DistributedEnvTest, ReadsTorchrunVariables) {
  TorchrunEnv env(
      {{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "29511"}});
  std::optional<DistributedEnv> e = read_distributed_env();
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->rank, 3);
  EXPECT_EQ(e->world_size, 4);
  EXPECT_EQ(e->local_rank, 1);
  EXPECT_EQ(e->master_addr, "10.1.2.3");
  EXPECT_EQ(e->master_port, 29511);
}

TEST(DistributedEnvTest, MissingOrMalformedVariablesAreNamed) {
  const std::vector<std::pair<std::string, std::string>> full = {
      {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
  auto without = [&](const std::string& name) {
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto& kv : full) {
      if (kv.first != name) out.push_back(kv);
    }
    return out;
  };
  auto with = [&](const std::string& name, const std::string& value) {
    auto out = without(name);
    out.emplace_back(name, value);
    return out;
  };
  struct Case {
    std::vector<std::pair<std::string, std::string>> vars;
    std::vector<std::string> message;
  };
  const std::vector<Case> cases = {
      {without("RANK"), {"RANK is not set", "WORLD_SIZE=2"}},
      {without("WORLD_SIZE"), {"WORLD_SIZE is not set", "RANK=0"}},
      {without("MASTER_ADDR"), {"MASTER_ADDR is not set"}},
      {without("MASTER_PORT"), {"MASTER_PORT is not set"}},
      {with("MASTER_PORT", "abc"), {"MASTER_PORT must be an integer", "'abc'"}},
      {with("MASTER_PORT", "70000"), {"MASTER_PORT must be a TCP port", "70000"}},
      {with("RANK", "2"), {"RANK=2 is out of range for WORLD_SIZE=2"}},
      {with("RANK", "1x"), {"RANK must be an integer", "'1x'"}},
      {with("WORLD_SIZE", "0"), {"WORLD_SIZE must be >= 1", "0"}},
      {with("LOCAL_RANK", "-1"), {"LOCAL_RANK=-1 is out of range"}},
  };
  for (const Case& c : cases) {
    TorchrunEnv env(c.vars);
    try {
      init_parallel_from_env(0, std::chrono::milliseconds(500));
      ADD_FAILURE() << "no error for " << ::testing::PrintToString(c.vars);
    } catch (const Error& e) {
      for (const auto& part : c.message) EXPECT_THAT(e.what(), HasSubstr(part)) << ::testing::PrintToString(c.vars);
    }
  }
}

TEST(DistributedEnvTest, TensorParallelSizeMustDivideTheWorld) {
  // Checked before any connection is tried (nothing listens on this port).
  TorchrunEnv env({{"RANK", "0"}, {"WORLD_SIZE", "3"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1"}});
  EXPECT_THAT([] { init_parallel_from_env(2, std::chrono::milliseconds(500)); },
              ThrowsMessage<Error>(HasSubstr("tensor-parallel size 2 does not divide WORLD_SIZE 3")));
  EXPECT_THAT([] { init_parallel_from_env(-1); }, ThrowsMessage<Error>(HasSubstr("got -1")));
}

TEST(DistributedEnvTest, AbsentPeersAreAnErrorAfterTheTimeout) {
  // Rank 1 of 2 with nobody serving the store: an error naming the address, not a hang.
  const int port = find_free_port();
  TorchrunEnv env(
      {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}});
  const auto start = Clock::now();
  EXPECT_THAT([] { init_parallel_from_env(2, std::chrono::milliseconds(1000)); },
              ThrowsMessage<Error>(AllOf(HasSubstr("rank 1 of 2 could not reach the rendezvous store"),
                                         HasSubstr("127.0.0.1:" + std::to_string(port)))));
  EXPECT_LT(seconds_since(start), 15.0);
}

// ---------------------------------------------------------------------------------------------
// The launcher, with a shell as the command (no LibTorch start-up).

TEST(LaunchLocalRanks, SetsTheTorchrunVariables) {
  const std::string check =
      "test \"$WORLD_SIZE\" = 3 && test \"$RANK\" = \"$LOCAL_RANK\" && test \"$RANK\" -ge 0 && "
      "test \"$RANK\" -lt 3 && test \"$MASTER_ADDR\" = 127.0.0.1 && test \"$MASTER_PORT\" -gt 0 && "
      "test \"$EXTRA\" = yes";
  LaunchOptions options;
  options.env = {{"EXTRA", "yes"}};
  EXPECT_EQ(launch_local_ranks(3, {"/bin/sh", "-c", check}, options), 0);
}

TEST(LaunchLocalRanks, AFailingRankStopsTheOthers) {
  const auto start = Clock::now();
  const int status = launch_local_ranks(2, {"/bin/sh", "-c", "if [ \"$RANK\" = 1 ]; then exit 3; fi; exec sleep 30"});
  EXPECT_EQ(status, 3);
  EXPECT_LT(seconds_since(start), 10.0);
}

TEST(LaunchLocalRanks, TimeoutStopsEveryRank) {
  LaunchOptions options;
  options.timeout = std::chrono::milliseconds(300);
  options.kill_grace = std::chrono::milliseconds(200);
  const auto start = Clock::now();
  EXPECT_EQ(launch_local_ranks(2, {"/bin/sh", "-c", "trap '' TERM; exec sleep 30"}, options), 124);
  EXPECT_LT(seconds_since(start), 10.0);
}

TEST(LaunchLocalRanks, ACommandThatCannotStartIsAnError) {
  EXPECT_THAT([] { launch_local_ranks(2, {"/no/such/binary"}); },
              ThrowsMessage<Error>(HasSubstr("cannot start rank 0 of 2 ('/no/such/binary')")));
  EXPECT_THAT([] { launch_local_ranks(0, {"/bin/true"}); }, ThrowsMessage<Error>(HasSubstr("nproc >= 1, got 0")));
}

}  // namespace
}  // namespace vlmgen
