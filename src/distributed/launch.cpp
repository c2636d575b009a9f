// The torchrun variables, init_parallel_from_env, and a local multi-process launcher.

#include "vlmgen/distributed/launch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "c10d_communicator.h"
#include "vlmgen/error.h"
#include "vlmgen/logging.h"

extern char** environ;  // NOLINT: POSIX

namespace vlmgen {

std::string self_executable(const char* argv0) {
  std::vector<char> path(4096);
  const ssize_t n = ::readlink("/proc/self/exe", path.data(), path.size() - 1);
  return n > 0 ? std::string(path.data(), static_cast<size_t>(n)) : std::string(argv0);
}
namespace {

const char* getenv_nonempty(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

int64_t parse_env_int(const char* name, const char* value) {
  errno = 0;
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  VLMGEN_CHECK(errno == 0 && end != value && *end == '\0', "environment variable {} must be an integer, got '{}'", name,
               value);
  return parsed;
}

int64_t require_env_int(const char* name, const DistributedEnv& partial) {
  const char* value = getenv_nonempty(name);
  VLMGEN_CHECK(value != nullptr,
               "environment variable {} is not set; a multi-process run (RANK={}, WORLD_SIZE={}) needs RANK, "
               "WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as torchrun sets them",
               name, partial.rank, partial.world_size);
  return parse_env_int(name, value);
}

}  // namespace

std::optional<DistributedEnv> read_distributed_env() {
  const char* rank = getenv_nonempty("RANK");
  const char* world = getenv_nonempty("WORLD_SIZE");
  if (rank == nullptr && world == nullptr) return std::nullopt;
  VLMGEN_CHECK(rank != nullptr, "environment variable RANK is not set but WORLD_SIZE={} is; set both (torchrun does)",
               world);
  VLMGEN_CHECK(world != nullptr, "environment variable WORLD_SIZE is not set but RANK={} is; set both (torchrun does)",
               rank);
  DistributedEnv env;
  env.world_size = parse_env_int("WORLD_SIZE", world);
  env.rank = parse_env_int("RANK", rank);
  VLMGEN_CHECK(env.world_size >= 1, "environment variable WORLD_SIZE must be >= 1, got {}", env.world_size);
  VLMGEN_CHECK(env.rank >= 0 && env.rank < env.world_size,
               "environment variable RANK={} is out of range for WORLD_SIZE={} (expected 0..{})", env.rank,
               env.world_size, env.world_size - 1);
  env.local_rank = env.rank;
  if (const char* local = getenv_nonempty("LOCAL_RANK")) {
    env.local_rank = parse_env_int("LOCAL_RANK", local);
    VLMGEN_CHECK(env.local_rank >= 0 && env.local_rank < env.world_size,
                 "environment variable LOCAL_RANK={} is out of range for WORLD_SIZE={} (expected 0..{})",
                 env.local_rank, env.world_size, env.world_size - 1);
  }
  const char* addr = getenv_nonempty("MASTER_ADDR");
  // Alone, there is nothing to rendezvous with; the address is read when given (a group of one).
  if (env.world_size == 1 && (addr == nullptr || getenv_nonempty("MASTER_PORT") == nullptr)) return env;
  VLMGEN_CHECK(addr != nullptr,
               "environment variable MASTER_ADDR is not set; a multi-process run (RANK={}, WORLD_SIZE={}) needs "
               "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as torchrun sets them",
               env.rank, env.world_size);
  env.master_addr = addr;
  const int64_t port = require_env_int("MASTER_PORT", env);
  VLMGEN_CHECK(port >= 1 && port <= 65535, "environment variable MASTER_PORT must be a TCP port in [1, 65535], got {}",
               port);
  env.master_port = static_cast<int>(port);
  return env;
}

ParallelContext init_parallel_from_env(int64_t tp_size, std::chrono::milliseconds timeout) {
  return init_parallel_from_env(tp_size, DistributedOptions().timeout(timeout));
}

ParallelContext init_parallel_from_env(int64_t tp_size, const DistributedOptions& options) {
  VLMGEN_CHECK(tp_size >= 0, "tensor-parallel size must be >= 0 (0 = the whole world), got {}", tp_size);
  const std::optional<DistributedEnv> env = read_distributed_env();
  if (!env || (env->world_size == 1 && !options.group_of_one())) {
    VLMGEN_CHECK(tp_size <= 1,
                 "tensor-parallel size {} needs {} processes, but this one runs alone (RANK/WORLD_SIZE {}); start it "
                 "with torchrun or vlmgen::launch_local_ranks",
                 tp_size, tp_size, env ? "say WORLD_SIZE=1" : "are not set");
    return ParallelContext::single();
  }
  const int64_t tp = tp_size == 0 ? env->world_size : tp_size;
  VLMGEN_CHECK(env->world_size % tp == 0, "tensor-parallel size {} does not divide WORLD_SIZE {}", tp, env->world_size);
  VLMGEN_CHECK(tp > 1 || !options.group_of_one() || env->master_port > 0,
               "a group of one rank (DistributedOptions::group_of_one) connects through a store: set MASTER_ADDR and "
               "MASTER_PORT (RANK={}, WORLD_SIZE={})",
               env->rank, env->world_size);
  std::shared_ptr<Communicator> group =
      tp > 1 || options.group_of_one() ? detail::connect_tp_group(*env, tp, options) : nullptr;
  return ParallelContext::make(env->world_size, env->rank, tp, env->rank % tp, std::move(group));
}

int find_free_port(const std::string& host) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  VLMGEN_CHECK(fd >= 0, "cannot open a socket to find a free port: {}", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;  // the OS picks
  const std::string ip = host == "localhost" ? "127.0.0.1" : host;
  if (::inet_pton(AF_INET, ip.c_str(), &addr.sin_addr) != 1) {
    ::close(fd);
    VLMGEN_FAIL("find_free_port needs an IPv4 address or localhost, got '{}'", host);
  }
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    ::close(fd);
    VLMGEN_FAIL("cannot bind a socket on {} to find a free port: {}", host, std::strerror(err));
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

namespace {

// Exit status in the shell's convention: the code, or 128 + the signal.
int shell_status(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

// The signal a forwarding launcher received and has not passed on yet (0: none); lock-free,
// so the handler may set it.
std::atomic<int> g_pending_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "a signal handler may only touch lock-free atomics");
extern "C" void remember_signal(int sig) { g_pending_signal.store(sig); }

// While alive, SIGINT and SIGTERM are remembered instead of ending the process; the previous
// handlers come back at the end.
class SignalForwarding {
 public:
  explicit SignalForwarding(bool on) : on_(on) {
    if (!on_) return;
    g_pending_signal.store(0);
    struct sigaction action {};
    action.sa_handler = remember_signal;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGINT, &action, &old_int_);
    ::sigaction(SIGTERM, &action, &old_term_);
  }
  ~SignalForwarding() {
    if (!on_) return;
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
  }
  SignalForwarding(const SignalForwarding&) = delete;
  SignalForwarding& operator=(const SignalForwarding&) = delete;

  // Sends a signal that arrived since the last call to every rank still running. (Ctrl-C in a
  // terminal reaches the ranks directly too: they share the launcher's process group.)
  void pass_on(const std::vector<pid_t>& pids) const {
    if (!on_) return;
    const int sig = g_pending_signal.exchange(0);
    if (sig == 0) return;
    for (pid_t pid : pids) {
      if (pid > 0) ::kill(pid, sig);
    }
  }

 private:
  bool on_;
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

// Stops the ranks still running: SIGTERM, then SIGKILL after the grace period; reaps them all.
void stop_ranks(std::vector<pid_t>& pids, std::chrono::milliseconds grace) {
  for (pid_t pid : pids) {
    if (pid > 0) ::kill(pid, SIGTERM);
  }
  const auto deadline = std::chrono::steady_clock::now() + grace;
  bool killed = false;
  for (;;) {
    bool running = false;
    for (pid_t& pid : pids) {
      if (pid <= 0) continue;
      int status = 0;
      const pid_t done = ::waitpid(pid, &status, WNOHANG);
      if (done == pid || (done < 0 && errno == ECHILD)) {
        pid = -1;
      } else {
        running = true;
      }
    }
    if (!running) return;
    if (!killed && std::chrono::steady_clock::now() >= deadline) {
      for (pid_t pid : pids) {
        if (pid > 0) ::kill(pid, SIGKILL);
      }
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace

std::optional<int> relaunch_as_local_ranks(int nproc, int argc, char** argv, LaunchOptions options) {
  const bool in_a_launch = std::getenv("RANK") != nullptr || std::getenv("WORLD_SIZE") != nullptr;
  if (nproc <= 1 || in_a_launch) return std::nullopt;
  std::vector<std::string> args = {self_executable(argv[0])};
  args.insert(args.end(), argv + 1, argv + argc);
  return launch_local_ranks(nproc, args, options);
}

int launch_local_ranks(int nproc, const std::vector<std::string>& argv, const LaunchOptions& options) {
  VLMGEN_CHECK(nproc >= 1, "launch_local_ranks needs nproc >= 1, got {}", nproc);
  VLMGEN_CHECK(!argv.empty() && !argv[0].empty(), "launch_local_ranks needs a command, got an empty argv");
  VLMGEN_CHECK(options.timeout.count() > 0, "launch_local_ranks needs a timeout > 0 ms, got {}",
               options.timeout.count());
  const int port = options.master_port != 0 ? options.master_port : find_free_port(options.master_addr);

  // The inherited environment minus every variable set here, then ours.
  std::vector<std::pair<std::string, std::string>> common = {
      {"WORLD_SIZE", std::to_string(nproc)},
      {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
      {"MASTER_ADDR", options.master_addr},
      {"MASTER_PORT", std::to_string(port)},
  };
  common.insert(common.end(), options.env.begin(), options.env.end());
  std::set<std::string> overridden = {"RANK", "LOCAL_RANK"};
  for (const auto& kv : common) overridden.insert(kv.first);
  std::vector<std::string> inherited;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    if (overridden.count(entry.substr(0, entry.find('='))) == 0) inherited.push_back(entry);
  }

  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const bool search_path = argv[0].find('/') == std::string::npos;

  std::vector<pid_t> pids(static_cast<size_t>(nproc), -1);
  const SignalForwarding forwarding(options.forward_signals);
  for (int rank = 0; rank < nproc; ++rank) {
    std::vector<std::string> env_strings = inherited;
    env_strings.push_back("RANK=" + std::to_string(rank));
    env_strings.push_back("LOCAL_RANK=" + std::to_string(rank));
    for (const auto& kv : common) env_strings.push_back(kv.first + "=" + kv.second);
    std::vector<char*> envp;
    envp.reserve(env_strings.size() + 1);
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    // posix_spawn (exec right away) rather than fork: a forked copy of a process with LibTorch's
    // thread pools may deadlock before it execs.
    pid_t pid = -1;
    const int err = search_path ? ::posix_spawnp(&pid, args[0], nullptr, nullptr, args.data(), envp.data())
                                : ::posix_spawn(&pid, args[0], nullptr, nullptr, args.data(), envp.data());
    if (err != 0) {
      stop_ranks(pids, options.kill_grace);
      VLMGEN_FAIL("cannot start rank {} of {} ('{}'): {}", rank, nproc, argv[0], std::strerror(err));
    }
    pids[static_cast<size_t>(rank)] = pid;
  }

  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  int remaining = nproc;
  while (remaining > 0) {
    forwarding.pass_on(pids);
    for (int rank = 0; rank < nproc; ++rank) {
      pid_t& pid = pids[static_cast<size_t>(rank)];
      if (pid <= 0) continue;
      int status = 0;
      const pid_t done = ::waitpid(pid, &status, WNOHANG);
      if (done == 0) continue;
      // done < 0: the child was reaped elsewhere (a SIGCHLD handler); its status is lost.
      const int failure = done == pid ? shell_status(status) : 1;
      pid = -1;
      --remaining;
      if (failure != 0) {
        if (remaining > 0) {
          log(LogLevel::kWarning, "rank {} of {} exited with status {}; stopping the other ranks", rank, nproc,
              failure);
          stop_ranks(pids, options.kill_grace);
        }
        return failure;
      }
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      log(LogLevel::kWarning, "{} of {} ranks still running after {} ms; stopping them", remaining, nproc,
          options.timeout.count());
      stop_ranks(pids, options.kill_grace);
      return 124;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return 0;
}

}  // namespace vlmgen
