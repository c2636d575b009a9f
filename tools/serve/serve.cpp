// vlmgen-serve: an OpenAI-compatible chat-completions server on vlmgen's Engine.
//
//   vlmgen-serve --model DIR [--host 127.0.0.1] [--port 8000] [--max-running 16]
//                [--kv-cache-bytes N] [--api-key KEY] [--allow-local-images DIR] ...
//
// POST /v1/chat/completions (JSON or server-sent events), GET /v1/models, GET /health and
// GET /metrics (Prometheus text). Every request is checked before it reaches the engine; a bad
// one gets an OpenAI-style error naming the field. SIGINT/SIGTERM stop accepting, let in-flight
// requests finish for --grace-seconds, cancel the rest, and exit 0.
//
// This file: the command line, the signals and the tensor-parallel ranks. The server itself is in
// server.cpp (routes, request checks) and server_replies.cpp (replies, /metrics).

#include <fmt/format.h>
#include <httplib.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <thread>

#include "serve_internal.h"
#include "vlmgen/distributed/launch.h"
#include "vlmgen/engine/engine.h"
#include "vlmgen/error.h"
#include "vlmgen/models/load_model.h"

namespace vlmgen::serve {
namespace {

std::atomic<int> g_signal{0};
extern "C" void on_signal(int sig) { g_signal.store(sig); }

// A rank other than 0 under --nproc: its shard of the model and an engine that runs rank 0's
// plans, until rank 0's engine stops. Signals (the launcher passes them to every rank) are
// left to rank 0, which drains and then stops the engines.
int follow(const Options& o, const ParallelContext& parallel) {
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  auto model = load_model(o.model, parallel, load_options_for(o.dtype, o.device, o.kv_dtype));
  Engine engine(*model, engine_options(o), parallel);
  engine.join();
  return 0;
}

// vlmgen-serve's command line, onto `o`.
void add_options(CLI::App& app, Options& o) {
  app.add_option("--model", o.model, "HF checkpoint folder: config.json, *.safetensors, tokenizer.json, chat template")
      ->required();
  app.add_option("--served-model-name", o.model_name, "the model id clients see (default: the folder's name)");
  app.add_option("--host", o.host, "address to listen on")->capture_default_str();
  app.add_option("--dtype", o.dtype,
                 "weights of the language model: f32, bf16 (half the bytes a decode step reads), f16, or fp8 (an FP8 "
                 "checkpoint's linears kept as bytes, the rest bf16; CPU)")
      ->check(CLI::IsMember({"f32", "bf16", "f16", "fp8"}))
      ->capture_default_str();
  app.add_option("--kv-dtype", o.kv_dtype, vlmgen::kKvCacheDtypeHelp)
      ->check(CLI::IsMember({"f32", "bf16", "fp8"}))
      ->capture_default_str();
  app.add_option("--device", o.device,
                 "cpu, cuda or cuda:N (with --nproc, 'cuda' gives each rank the device of its local rank; use "
                 "--dtype bf16 there)")
      ->capture_default_str();
  app.add_option("--port", o.port, "port to listen on (0: any free port; the chosen one is printed)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  app.add_option("--max-running", o.max_running, "requests stepping at once")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-waiting", o.max_waiting, "requests queued before new ones get 429")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--kv-cache-bytes", o.kv_cache_bytes, "KV-cache bytes all running requests share")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-body-bytes", o.max_body_bytes, "largest request body (413 above)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-image-pixels", o.max_image_pixels, "largest decoded image, width x height (400 above)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-images", o.max_images, "images in one request (400 above)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-total-image-pixels", o.max_total_image_pixels,
                 "decoded pixels of all of a request's images together (400 above)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--default-max-tokens", o.default_max_tokens, "max_tokens when a request gives none")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--api-key", o.api_key, "require Authorization: Bearer KEY on /v1/*");
  app.add_option("--allow-local-images", o.allow_local_images, "serve image_url paths inside this folder")
      ->check(CLI::ExistingDirectory);
  app.add_option("--grace-seconds", o.grace_seconds, "on SIGINT/SIGTERM, how long in-flight requests may finish")
      ->capture_default_str();
  app.add_option("--keep-alive-seconds", o.keep_alive_seconds,
                 "a stream with nothing to send (queued, or computing a long prompt) sends an SSE comment this often; "
                 "a client that left is found by the failing write and its request cancelled")
      ->check(CLI::Range(0.01, 3600.0))
      ->capture_default_str();
  app.add_option("--threads", o.threads,
                 "HTTP worker threads (connections served at once); all but 4 may generate, the 4 answer /health, "
                 "/metrics and refusals")
      ->capture_default_str()
      ->check(CLI::Range(kReservedThreads + 1, 1 << 16));
  app.add_option("--nproc", o.nproc,
                 "tensor-parallel ranks to start on this machine (rank 0 serves HTTP and schedules; the others run "
                 "its plan)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--timeout", o.timeout_s, "seconds a rank waits for its peers")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
}

}  // namespace
}  // namespace vlmgen::serve

int main(int argc, char** argv) {
  using namespace vlmgen::serve;  // NOLINT(google-build-using-namespace)
  CLI::App app("vlmgen-serve: an OpenAI-compatible chat-completions server");
  Options o;
  add_options(app, o);
  CLI11_PARSE(app, argc, argv);

  const bool in_a_launch = std::getenv("RANK") != nullptr || std::getenv("WORLD_SIZE") != nullptr;
  try {
    vlmgen::LaunchOptions launch;
    launch.timeout = std::chrono::hours(24 * 365);
    launch.forward_signals = true;  // rank 0 drains on SIGTERM, then every rank exits
    if (auto status = vlmgen::relaunch_as_local_ranks(o.nproc, argc, argv, launch)) return *status;
  } catch (const vlmgen::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  if (in_a_launch) {  // the launcher passes signals on to every rank, even while they connect and load
    std::signal(SIGINT, on_signal);
    std::signal(SIGTERM, on_signal);
  }
  try {
    vlmgen::ParallelContext parallel = vlmgen::ParallelContext::single();
    if (in_a_launch) {
      parallel =
          vlmgen::init_parallel_from_env(0, vlmgen::DistributedOptions().timeout(std::chrono::seconds(o.timeout_s)));
    }
    if (parallel.tp_rank() != 0) return follow(o, parallel);
    // From here a signal drains the server once it listens (the launcher passes signals on to
    // every rank, possibly while the model still loads).
    std::signal(SIGINT, on_signal);
    std::signal(SIGTERM, on_signal);
    Server server(o, parallel);
    httplib::Server svr;
    const int threads = o.threads;
    svr.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
    server.install(svr);
    const int port = o.port == 0 ? svr.bind_to_any_port(o.host) : (svr.bind_to_port(o.host, o.port) ? o.port : -1);
    if (port < 0) {
      fmt::print(stderr, "error: cannot listen on {}:{}\n", o.host, o.port);
      return 1;
    }
    std::signal(SIGPIPE, SIG_IGN);
    std::thread watcher([&] {
      while (g_signal.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      if (g_signal.load() > 0) {
        // Drain: new requests get 503, the ones in flight (streams included) run to their end
        // within the grace period and are cancelled after it; then the listener stops.
        server.drain();
        fmt::print(stderr, "[serve] signal {}: refusing new requests; {} in flight get {} s\n", g_signal.load(),
                   server.in_flight(), o.grace_seconds);
        auto wait_until = [&](double seconds) {
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
          while (server.in_flight() > 0 && std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          }
        };
        wait_until(o.grace_seconds);
        if (server.in_flight() > 0) {
          fmt::print(stderr, "[serve] grace period over: cancelling {} requests\n", server.in_flight());
          server.cancel_all();
          wait_until(5.0);
        }
      }
      svr.stop();
    });
    fmt::print("vlmgen-serve: listening on http://{}:{}\n", o.host, port);
    std::fflush(stdout);
    svr.listen_after_bind();
    if (g_signal.load() == 0) g_signal.store(-1);  // listen ended on its own: let the watcher go
    watcher.join();
    fmt::print(stderr, "[serve] stopped\n");
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
