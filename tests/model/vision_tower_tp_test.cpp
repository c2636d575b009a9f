// Tensor parallelism of the SigLIP (Gemma-3) and CLIP (LLaVA-NeXT) towers: their encoder layers
// are split over the ranks when the heads and the MLP width divide by tp and replicated otherwise.
// Either way every rank computes the same image features, equal to TP=1's, and a TP=2 model loads
// its slices from a TP=1 checkpoint and writes the same checkpoint back.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "multiprocess_test_util.h"
#include "tp_test_util.h"
#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/logging.h"
#include "vlmgen/models/gemma3.h"
#include "vlmgen/models/llava_next.h"

namespace vlmgen {
namespace {

using namespace tp_test;  // NOLINT(google-build-using-namespace)

using multiprocess::getenv_or;
using multiprocess::run_workers;
using multiprocess::worker_comm;
using ::testing::AllOf;
using ::testing::HasSubstr;

// The tiny configs' towers (2 heads, MLP 48) split over 2 ranks; one with a single head, and one
// with an odd MLP width, stay whole on every rank.
enum class Tower { kSplit, kOneHead, kOddMlp };

const char* tower_name(Tower tower) {
  switch (tower) {
    case Tower::kSplit: return "split";
    case Tower::kOneHead: return "one head, whole";
    case Tower::kOddMlp: return "odd MLP, whole";
  }
  return "?";
}

template <typename Config>
Config with_tower(Config c, Tower tower) {
  if (tower == Tower::kOneHead) c.vision_num_attention_heads = 1;
  if (tower == Tower::kOddMlp) c.vision_intermediate_size = 45;
  return c;
}

bool is_tower_weight(const std::string& name) { return name.find("vision_tower.") != std::string::npos; }

// Every weight of `part` (rank `rank` of 2) is its layout's slice of the same weight of `whole`:
// the text model always split, the tower's layers split only when `split_tower`. Returns how many
// tower weights are split.
template <typename Model>
int64_t expect_slices_of(Model& whole, Model& part, bool split_tower, int64_t rank, const std::string& what) {
  std::map<std::string, const at::Tensor*> full;
  for (const auto& [name, t] : whole.named_weights()) full[name] = t;
  int64_t split = 0;
  for (const auto& [name, t] : part.named_weights()) {
    const bool tower = is_tower_weight(name);
    const ShardLayout layout = tower && !split_tower ? ShardLayout::kReplicated : layout_by_name(name);
    EXPECT_EQ(part.shard_layout(name), layout) << what << ": " << name;
    EXPECT_TRUE(t->equal(expected_slice(*full.at(name), layout, rank, 2))) << what << ": " << name;
    split += tower && layout != ShardLayout::kReplicated;
  }
  return split;
}

// The log lines of one construction.
template <typename Fn>
std::vector<std::string> logged_by(Fn&& fn) {
  std::vector<std::string> lines;
  LogSink previous = set_log_sink([&](LogLevel, const std::string& message) { lines.push_back(message); });
  fn();
  set_log_sink(previous);
  return lines;
}

template <typename Model, typename Config>
void expect_split_decided_at_construction(const Config& tiny, const std::string& family) {
  for (Tower tower : {Tower::kSplit, Tower::kOneHead, Tower::kOddMlp}) {
    const Config config = with_tower(tiny, tower);
    const bool split = tower == Tower::kSplit;
    const std::string what =
        fmt::format("{}, {} heads, MLP {}", family, config.vision_num_attention_heads, config.vision_intermediate_size);
    Model whole(config, 5);
    EXPECT_FALSE(whole.vision_tower_sharded()) << what;
    for (int64_t rank : {0, 1}) {
      std::unique_ptr<Model> part;
      const std::vector<std::string> lines =
          logged_by([&] { part = std::make_unique<Model>(config, 5, 0.02, without_collectives(rank, 2)); });
      EXPECT_EQ(part->vision_tower_sharded(), split) << what;
      const int64_t split_weights = expect_slices_of(whole, *part, split, rank, what);
      // Per layer: q, k, v and fc1 weights and biases by rows, out_proj and fc2 weights by columns.
      EXPECT_EQ(split_weights, split ? 10 * config.vision_num_hidden_layers : 0) << what;
      if (rank == 1) {
        EXPECT_THAT(lines, ::testing::Not(::testing::Contains(HasSubstr("vision tower")))) << "rank 0 logs it";
      } else if (split) {
        EXPECT_THAT(lines, ::testing::Contains(AllOf(HasSubstr(family), HasSubstr("vision tower sharded over 2"))));
      } else {
        EXPECT_THAT(lines,
                    ::testing::Contains(AllOf(
                        HasSubstr("vision tower replicated"),
                        HasSubstr(fmt::format("its {} heads and MLP width {} do not both divide by 2",
                                              config.vision_num_attention_heads, config.vision_intermediate_size)))));
      }
    }
  }
}

TEST(VisionTowerTpTest, LayersSplitWhenHeadsAndMlpDivideElseReplicatedDecidedOnceAndLogged) {
  expect_split_decided_at_construction<Gemma3>(Gemma3Config::tiny(), "gemma3");
  expect_split_decided_at_construction<LlavaNext>(LlavaNextConfig::tiny(), "llava_next");
}

// ---------------------------------------------------------------------------------------------
// Workers (run as ranks of a launch; see multiprocess_test_util.h)

// The tower's features: two all-reduces per layer and image when split, none when whole; the same bits
// on every rank, within float rounding of TP=1's. Then a generate call equals TP=1's, step by step.
template <typename Model, typename Config>
double expect_tower_equals_tp1(const Config& config, Tower tower, int64_t layers_run, const GenerateRequest& request,
                               const std::string& what) {
  auto [par, counter] = counted_context(/*sequence_parallel=*/false);
  Model reference(config, 13);
  Model model(config, 13, 0.02, par);
  const bool split = tower == Tower::kSplit;
  EXPECT_EQ(model.vision_tower_sharded(), split) << what;
  counter->reset();
  const at::Tensor features = model.encode_images(request.vision);
  // Both towers run image by image.
  EXPECT_EQ(counter->all_reduces, split ? 2 * layers_run * request.vision.num_images() : 0) << what;
  const at::Tensor expected = reference.encode_images(request.vision);
  EXPECT_EQ(features.sizes(), expected.sizes()) << what;
  const double worst = (features - expected).abs().max().item<double>();
  EXPECT_LE(worst, kTpTolerance) << what;
  const at::Tensor all = worker_comm().all_gather(features.unsqueeze(0), 0);
  EXPECT_TRUE(at::equal(all[0], all[1])) << what << ": the ranks' image features differ";

  const auto gen_config = GenerationConfig().max_new_tokens(4);
  RecordedRun tp1 = generate_recorded(reference, ParallelContext::single(), request, gen_config);
  RecordedRun tp2 = generate_recorded(model, par, request, gen_config);
  expect_same_tokens_on_every_rank(tp2.result, *par.tp_group(), 4);
  return std::max(worst, expect_run_matches_tp1(tp1, tp2, what));
}

TEST(DISABLED_VisionTowerTpWorker, SplitOrReplicatedTowersEqualTp1) {
  SKIP_UNLESS_WORKER();
  double worst = 0.0;
  for (Tower tower : {Tower::kSplit, Tower::kOneHead}) {
    const Gemma3Config gemma = with_tower(Gemma3Config::tiny(), tower);
    worst =
        std::max(worst, expect_tower_equals_tp1<Gemma3>(gemma, tower, gemma.vision_num_hidden_layers, gemma3_request(),
                                                        fmt::format("gemma3, tower {}", tower_name(tower))));
    const LlavaNextConfig llava = with_tower(LlavaNextConfig::tiny(), tower);
    worst = std::max(
        worst, expect_tower_equals_tp1<LlavaNext>(llava, tower, llava.vision_layers_used(), llava_next_request(llava),
                                                  fmt::format("llava_next, tower {}", tower_name(tower))));
  }
  std::printf("[ measured ] SigLIP and CLIP towers split or whole: TP=2 vs TP=1 features and logits, max|diff|: %.3g\n",
              worst);
}

std::string file_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// A TP=1 checkpoint loaded over two ranks: each rank holds its slices (the tower's layers split);
// saving gathers them into the same tensors, bit for bit, and the same config.json.
template <typename Model>
void expect_checkpoint_round_trip(const std::string& dir, const std::string& family) {
  const ParallelContext& par = multiprocess::worker_context();
  auto reference = Model::from_checkpoint(dir);
  auto model = Model::from_checkpoint(dir, par);
  EXPECT_TRUE(model->vision_tower_sharded()) << family;
  EXPECT_GT(expect_slices_of(*reference, *model, true, par.tp_rank(), family), 0) << family;
  // Each rank reads and keeps only its slices: no weight is a view into the whole tensor.
  for (const auto& [name, t] : model->named_weights())
    EXPECT_EQ(t->storage().nbytes(), t->nbytes()) << family << ": " << name << " keeps the whole tensor's storage";

  const std::string again = dir + "/saved-by-tp";
  model->save_checkpoint(again);  // every rank returns once rank 0 has written it
  SafetensorsCheckpoint original(dir);
  SafetensorsCheckpoint saved(again);
  EXPECT_EQ(saved.names(), original.names()) << family;
  for (const std::string& name : original.names()) {
    if (saved.contains(name)) {
      EXPECT_TRUE(saved.tensor(name).equal(original.tensor(name))) << family << ": " << name;
    }
  }
  EXPECT_EQ(file_text(std::filesystem::path(again) / "config.json"),
            file_text(std::filesystem::path(dir) / "config.json"))
      << family;
}

TEST(DISABLED_VisionTowerTpWorker, CheckpointsLoadSlicesAndSaveWhole) {
  SKIP_UNLESS_WORKER();
  const std::string dir = getenv_or("VLMGEN_TEST_CHECKPOINT", "");
  ASSERT_FALSE(dir.empty()) << "the launching test passes VLMGEN_TEST_CHECKPOINT";
  expect_checkpoint_round_trip<Gemma3>(dir + "/gemma3", "gemma3");
  expect_checkpoint_round_trip<LlavaNext>(dir + "/llava_next", "llava_next");
}

// ---------------------------------------------------------------------------------------------
// The launching tests: two ranks (two_rank_env).

TEST(VisionTowerTp, SplitOrReplicatedSigLipAndClipTowersEqualTp1) {
  EXPECT_EQ(run_workers(2, "DISABLED_VisionTowerTpWorker.SplitOrReplicatedTowersEqualTp1", two_rank_env()), 0);
}

TEST(VisionTowerTp, CheckpointsShardedAtLoadGatheredAtSave) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("vlmgen_tower_tp_checkpoint_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  Gemma3(Gemma3Config::tiny(), 21).save_checkpoint((dir / "gemma3").string());
  LlavaNext(LlavaNextConfig::tiny(), 21).save_checkpoint((dir / "llava_next").string());
  EXPECT_EQ(run_workers(2, "DISABLED_VisionTowerTpWorker.CheckpointsLoadSlicesAndSaveWhole",
                        two_rank_env({{"VLMGEN_TEST_CHECKPOINT", dir.string()}})),
            0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace vlmgen
