// Files a stranger could hand vlmgen: JSON nested thousands deep, config.json sizes near 2^62,
// FIFOs where files belong, safetensors whose tensors overlap or leave bytes unaccounted for.
// Each must become a vlmgen::Error that says what was expected and what came, quickly.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "hostile_test_util.h"
#include "vlmgen/error.h"
#include "vlmgen/io/json.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/models/qwen2_vl.h"
#include "vlmgen/models/qwen_vl_config.h"

namespace vlmgen {
namespace {

using hostile_test::error_of;
using hostile_test::error_within;
using hostile_test::seconds_since;
using hostile_test::TempDir;
using hostile_test::write_bytes;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using Clock = std::chrono::steady_clock;

std::string nested(size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

std::string length_field(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// A safetensors file: `header` JSON and `data_bytes` bytes of data.
std::string safetensors_bytes(const std::string& header, size_t data_bytes) {
  return length_field(header.size()) + header + std::string(data_bytes, '\0');
}

std::string f32_entry(const std::string& name, int64_t begin, int64_t end) {
  return fmt::format(R"("{}":{{"dtype":"F32","shape":[{}],"data_offsets":[{},{}]}})", name, (end - begin) / 4, begin,
                     end);
}

// ---- bounded JSON ----

TEST(HostileJson, DepthIsCountedOutsideStringsUpToTheLimit) {
  EXPECT_NO_THROW(check_json_limits(nested(kMaxJsonDepth), JsonLimits(), "t"));
  EXPECT_THAT(error_of([] { check_json_limits(nested(kMaxJsonDepth + 1), JsonLimits(), "t"); }),
              AllOf(HasSubstr("deeper than the limit of 64"), HasSubstr("depth 65")));
  // Brackets inside strings, escaped quotes included, are text, not nesting.
  const std::string in_string = "{\"a\": \"" + std::string(500, '[') + "\\\"" + std::string(500, '{') + "\"}";
  EXPECT_NO_THROW(check_json_limits(in_string, JsonLimits(), "t"));
  EXPECT_THAT(error_of([] { check_json_limits(nested(10), JsonLimits().max_depth(9), "custom"); }),
              AllOf(HasSubstr("custom"), HasSubstr("limit of 9")));
  EXPECT_THAT(error_of([] { check_json_limits(std::string(101, ' '), JsonLimits().max_bytes(100), "t"); }),
              AllOf(HasSubstr("101 bytes"), HasSubstr("limit of 100 bytes")));
}

TEST(HostileJson, ConfigNested5000DeepIsRefusedNamingTheDepth) {
  const std::string text = R"({"hidden_size": )" + nested(5000) + "}";
  const auto start = Clock::now();
  EXPECT_THAT(error_of([&] { QwenVlConfig::from_json(text); }),
              AllOf(HasSubstr("config"), HasSubstr("deeper than the limit of 64")));
  EXPECT_LT(seconds_since(start), 1.0);
}

TEST(HostileJson, SafetensorsHeaderAndIndexNested5000DeepAreRefused) {
  TempDir dir;
  write_bytes(dir / "deep.safetensors", safetensors_bytes(R"({"__metadata__":)" + nested(5000) + "}", 0));
  EXPECT_THAT(error_of([&] { SafetensorsFile f(dir / "deep.safetensors"); }),
              AllOf(HasSubstr("deep.safetensors"), HasSubstr("deeper than the limit of 64")));
  write_bytes(dir / "model.safetensors.index.json", R"({"weight_map": {"a": )" + nested(5000) + "}}");
  EXPECT_THAT(error_of([&] { SafetensorsCheckpoint c(dir.path()); }),
              AllOf(HasSubstr("index"), HasSubstr("deeper than the limit of 64")));
}

TEST(HostileJson, MessagesQuoteOnlyAShortPrefixOfUntrustedText) {
  const std::string huge(1 << 20, 'x');
  const std::string config = R"({"hidden_size": ")" + huge + R"("})";
  const std::string message = error_of([&] { QwenVlConfig::from_json(config); });
  EXPECT_THAT(message, AllOf(HasSubstr("hidden_size"), HasSubstr("string")));
  EXPECT_LT(message.size(), 1000u);
  // A parse error on a megabyte-long token: nlohmann quotes the token, we cut it.
  const std::string broken = R"({"a": ")" + huge;
  EXPECT_LT(error_of([&] { QwenVlConfig::from_json(broken); }).size(), 1000u);
  EXPECT_THAT(error_of([] { QwenVlConfig::from_json(std::string(QwenVlConfigLimits::kMaxConfigBytes + 1, ' ')); }),
              HasSubstr("exceeds the limit of 4194304 bytes"));
}

// ---- config sizes ----

// config.json text of QwenVlConfig::tiny() with `field` (a top-level or vision_config key)
// replaced by `value`.
std::string tiny_json_with(const std::string& field, const std::string& value) {
  std::string text = QwenVlConfig::tiny().to_json();
  const std::string key = "\"" + field + "\": ";
  const size_t at = text.find(key);
  EXPECT_NE(at, std::string::npos) << field;
  const size_t begin = at + key.size();
  const size_t end = text[begin] == '[' ? text.find(']', begin) + 1 : text.find_first_of(",\n}", begin);
  return text.replace(begin, end - begin, value);
}

TEST(HostileConfig, SizesNear2To62AreRefusedNamingFieldValueAndBound) {
  const std::string huge = "4611686018427387904";  // 2^62
  const std::map<std::string, std::string> fields = {
      {"hidden_size", "65536"},
      {"num_hidden_layers", "1024"},
      {"num_attention_heads", "1024"},
      {"num_key_value_heads", "1024"},
      {"intermediate_size", "1048576"},
      {"vocab_size", "16777216"},
      {"head_dim", "4096"},
      {"depth", "1024"},
      {"embed_dim", "65536"},
      {"patch_size", "1024"},
      {"spatial_merge_size", "64"},
      {"max_position_embeddings", "16777216"},
  };
  for (const auto& [field, bound] : fields) {
    const QwenVlConfig config = QwenVlConfig::from_json(tiny_json_with(field, huge));
    const auto start = Clock::now();
    EXPECT_THAT(error_of([&] { config.validate(); }), AllOf(HasSubstr(field), HasSubstr(huge), HasSubstr(bound)))
        << field;
    // The model refuses it before allocating: a vlmgen::Error, not a c10 allocator error.
    EXPECT_THAT(error_of([&] { Qwen2Vl model(config, 0); }), AllOf(HasSubstr(field), HasSubstr(huge))) << field;
    EXPECT_LT(seconds_since(start), 1.0) << field;
  }
}

TEST(HostileConfig, MropeSectionsThatWrapAroundToHeadDimAreRefused) {
  // Three times this is 2^64 + 8: the old unchecked sum wrapped to 8 = head_dim / 2 and passed.
  const std::string wraps = "6148914691236517208";
  const QwenVlConfig config =
      QwenVlConfig::from_json(tiny_json_with("mrope_section", "[" + wraps + ", " + wraps + ", " + wraps + "]"));
  EXPECT_THAT(error_of([&] { config.validate(); }), AllOf(HasSubstr("mrope_section"), HasSubstr(wraps)));
  EXPECT_THAT(error_of([&] { Qwen2Vl model(config, 0); }), HasSubstr("mrope_section"));
}

TEST(HostileConfig, ParameterCountIsWhatTheModelAllocates) {
  for (const bool tied : {false, true}) {
    QwenVlConfig config = QwenVlConfig::tiny();
    config.tie_word_embeddings = tied;
    const Qwen2Vl model(config, 0);
    int64_t allocated = 0;
    std::vector<const at::Tensor*> seen;
    for (const auto& [name, tensor] : model.named_weights()) {
      if (std::find(seen.begin(), seen.end(), tensor) != seen.end()) continue;
      seen.push_back(tensor);
      allocated += tensor->numel();
    }
    EXPECT_EQ(config.parameter_count(), allocated) << "tied " << tied;
  }
}

TEST(HostileConfig, ValidConfigsBeyondTheParameterLimitAreRefused) {
  QwenVlConfig config = QwenVlConfig::tiny();
  config.hidden_size = 65536;
  config.vision.hidden_size = 65536;
  config.num_hidden_layers = 1024;
  config.intermediate_size = 1 << 20;
  const auto start = Clock::now();
  EXPECT_THAT(error_of([&] { Qwen2Vl model(config, 0); }),
              AllOf(HasSubstr("weights"), HasSubstr("above the limit of 1099511627776")));
  EXPECT_LT(seconds_since(start), 1.0);
}

TEST(HostileConfig, CheckpointPromisingMoreWeightsThanItsFilesHoldIsRefusedBeforeAllocating) {
  TempDir dir;
  Qwen2Vl(QwenVlConfig::tiny(), 0).save_checkpoint(dir.path());
  QwenVlConfig big = QwenVlConfig::tiny();
  big.num_hidden_layers = 1000;
  big.hidden_size = 4096;
  big.vision.hidden_size = 4096;
  big.intermediate_size = 16384;
  write_bytes(dir / "config.json", big.to_json());
  const auto start = Clock::now();
  const std::string message = error_of([&] { Qwen2Vl::from_checkpoint(dir.path()); });
  EXPECT_THAT(message, AllOf(HasSubstr(std::to_string(big.parameter_count())), HasSubstr("weights"),
                             HasSubstr("files hold only")));
  EXPECT_LT(seconds_since(start), 1.0);

  write_bytes(dir / "config.json", tiny_json_with("hidden_size", "4611686018427387904"));
  EXPECT_THAT(error_of([&] { Qwen2Vl::from_checkpoint(dir.path()); }),
              AllOf(HasSubstr("hidden_size"), HasSubstr("4611686018427387904"), HasSubstr("65536")));
}

// ---- files that are not regular files ----

TEST(HostileFiles, FifoConfigShardIndexAreRefusedWithinASecond) {
  using std::chrono::milliseconds;
  TempDir dir;
  ASSERT_EQ(::mkfifo((dir / "config.json").c_str(), 0600), 0);
  EXPECT_THAT(
      error_within(milliseconds(1000), dir / "config.json", [&] { QwenVlConfig::from_file(dir / "config.json"); }),
      AllOf(HasSubstr("config.json"), HasSubstr("must be a regular file, got a FIFO")));

  ASSERT_EQ(::mkfifo((dir / "model.safetensors").c_str(), 0600), 0);
  EXPECT_THAT(error_within(milliseconds(1000), dir / "model.safetensors", [&] { SafetensorsCheckpoint c(dir.path()); }),
              AllOf(HasSubstr("model.safetensors"), HasSubstr("got a FIFO")));
  EXPECT_THAT(
      error_within(milliseconds(1000), dir / "model.safetensors", [&] { Qwen2Vl::from_checkpoint(dir.path()); }),
      HasSubstr("got a FIFO"));

  ASSERT_EQ(::mkfifo((dir / "model.safetensors.index.json").c_str(), 0600), 0);
  EXPECT_THAT(error_within(milliseconds(1000), dir / "model.safetensors.index.json",
                           [&] { SafetensorsCheckpoint c(dir.path()); }),
              AllOf(HasSubstr("index"), HasSubstr("got a FIFO")));
}

TEST(HostileFiles, DirectoriesAndDevicesAreNamedForWhatTheyAre) {
  TempDir dir;
  ::mkdir((dir / "config.json").c_str(), 0700);
  EXPECT_THAT(error_of([&] { QwenVlConfig::from_file(dir / "config.json"); }), HasSubstr("got a directory"));
  EXPECT_THAT(error_of([] { SafetensorsFile f("/dev/null"); }),
              AllOf(HasSubstr("/dev/null"), HasSubstr("got a character device")));
}

// ---- safetensors layout: every data byte belongs to exactly one tensor ----

std::string layout_error(const std::string& header_entries, size_t data_bytes) {
  TempDir dir;
  write_bytes(dir / "m.safetensors", safetensors_bytes("{" + header_entries + "}", data_bytes));
  return error_of([&] { SafetensorsFile f(dir / "m.safetensors"); });
}

TEST(HostileSafetensors, OverlappingTensorsAreRefusedNamingBoth) {
  EXPECT_THAT(
      layout_error(f32_entry("a", 0, 8) + "," + f32_entry("b", 4, 12), 12),
      AllOf(HasSubstr("'b'"), HasSubstr("[4, 12]"), HasSubstr("'a'"), HasSubstr("[0, 8]"), HasSubstr("overlap")));
  // Two tensors on the same bytes.
  EXPECT_THAT(layout_error(f32_entry("a", 0, 8) + "," + f32_entry("b", 0, 8), 8),
              AllOf(HasSubstr("overlap"), HasSubstr("[0, 8]")));
}

TEST(HostileSafetensors, HolesAndTrailingBytesAreRefusedWithTheOffsets) {
  EXPECT_THAT(layout_error(f32_entry("a", 0, 4) + "," + f32_entry("b", 8, 12), 12),
              AllOf(HasSubstr("'b' starts at byte 8"), HasSubstr("ends at byte 4"), HasSubstr("hole of 4 bytes")));
  EXPECT_THAT(layout_error(f32_entry("a", 4, 8), 8), AllOf(HasSubstr("starts at byte 4"), HasSubstr("hole")));
  EXPECT_THAT(layout_error(f32_entry("a", 0, 4), 12),
              AllOf(HasSubstr("12 bytes"), HasSubstr("[0, 4)"), HasSubstr("8 trailing bytes")));
  EXPECT_THAT(layout_error("", 3), AllOf(HasSubstr("no tensors"), HasSubstr("3 trailing bytes")));
  // Packed exactly, empty tensors at a boundary included: accepted.
  EXPECT_EQ(layout_error(R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)" + f32_entry("a", 0, 4) + "," +
                             f32_entry("b", 4, 8),
                         8),
            "<no error>");
}

TEST(HostileSafetensors, ShardWithTrailingBytesIsRefusedNamingTheShard) {
  TempDir dir;
  save_safetensors(dir / "s1.safetensors", {{"a", at::ones({2})}});
  write_bytes(dir / "s2.safetensors", safetensors_bytes("{" + f32_entry("b", 0, 4) + "}", 5));
  write_bytes(dir / "model.safetensors.index.json",
              R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})");
  EXPECT_THAT(error_of([&] { SafetensorsCheckpoint c(dir.path()); }),
              AllOf(HasSubstr("s2.safetensors"), HasSubstr("1 trailing bytes")));
}

TEST(HostileSafetensors, RanksAbove64AreRefused) {
  std::string shape = "1";
  for (int i = 1; i < 65; ++i) shape += ",1";
  EXPECT_THAT(layout_error(R"("a":{"dtype":"F32","shape":[)" + shape + R"(],"data_offsets":[0,4]})", 4),
              AllOf(HasSubstr("65 dimensions"), HasSubstr("limit of 64")));
}

// A tensor's name given twice in a header means two things at once: refused, naming it, whether
// the two point at other bytes (the first would be dropped, its bytes a "hole") or at the same
// bytes (one of two dtypes would win silently). So is a name mapped twice in an index.
TEST(HostileSafetensors, ANameGivenTwiceIsRefusedNamingIt) {
  EXPECT_THAT(layout_error(f32_entry("a", 0, 4) + "," + f32_entry("b", 4, 8) + "," + f32_entry("a", 8, 12), 12),
              AllOf(HasSubstr("m.safetensors"), HasSubstr("'a' appears twice"), Not(HasSubstr("hole"))));
  EXPECT_THAT(layout_error(f32_entry("a", 0, 4) + R"(,"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]})", 4),
              HasSubstr("'a' appears twice"));
  // The same key in different objects is no repeat: each entry's "dtype", a metadata key that is
  // also a tensor's name.
  EXPECT_EQ(layout_error(R"("__metadata__":{"a":"x"},)" + f32_entry("a", 0, 4) + "," + f32_entry("b", 4, 8), 8),
            "<no error>");
  TempDir dir;
  save_safetensors(dir / "s1.safetensors", {{"a", at::ones({2})}});
  save_safetensors(dir / "s2.safetensors", {{"a", at::zeros({2})}});
  write_bytes(dir / "model.safetensors.index.json",
              R"({"weight_map": {"a": "s1.safetensors", "a": "s2.safetensors"}})");
  EXPECT_THAT(error_of([&] { SafetensorsCheckpoint c(dir.path()); }),
              AllOf(HasSubstr("model.safetensors.index.json"), HasSubstr("'a' appears twice")));
}

// The check for repeated names takes one linear pass: 1.2 MB of header holding 200,000 objects
// is refused (not a tensor entry) at once, where a parser that rescans a container's members as
// each object closes takes minutes.
TEST(HostileSafetensors, CheckingNamesOfAHugeHeaderTakesLinearTime) {
  std::string objects;
  for (int i = 0; i < 200'000; ++i) objects += i == 0 ? "{}" : ",{}";
  const Clock::time_point start = Clock::now();
  EXPECT_THAT(layout_error(R"("x":[)" + objects + "]", 0), HasSubstr("'x'"));
  EXPECT_LT(seconds_since(start), 2.0);
}

// The model's constructor holds a config to the same rules as QwenVlConfig::validate(): a
// config the loader would refuse cannot be built by hand either.
TEST(HostileConfig, TheConstructorRefusesWhatValidateRefuses) {
  QwenVlConfig c = QwenVlConfig::tiny();
  c.max_position_embeddings = QwenVlConfigLimits::kMaxPositionEmbeddings + 1;
  EXPECT_THROW(c.validate(), Error);
  EXPECT_THAT(error_of([&] { Qwen2Vl model(c, 1); }), HasSubstr("max_position_embeddings"));
  c = QwenVlConfig::tiny();
  c.vision.spatial_merge_size = QwenVlConfigLimits::kMaxSpatialMergeSize + 1;
  EXPECT_THROW(c.validate(), Error);
  EXPECT_THROW(Qwen2Vl(c, 1), Error);
}

}  // namespace
}  // namespace vlmgen
