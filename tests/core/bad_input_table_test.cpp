// The bad-input table: every row is an input a caller (or an attacker) can send through the
// public API. Each must give a vlmgen::Error naming what was expected and what came, before any
// forward call, and leave the Generator and the caller's contexts exactly as they were.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "test_util.h"
#include "vlmgen/generator.h"
#include "vlmgen/testing/fake_vlm.h"
#include "vlmgen/testing/forward_spy.h"

namespace vlmgen {
namespace {

using testing::FakeVlm;
using testing::FakeVlmOptions;
using testing::ForwardSpy;

constexpr int64_t kImage = 63;
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
const double kNan = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

/// A model, a spy, a generator and two caller contexts: one holding a text prefix, one holding a
/// whole prompt with an image.
struct Bench {
  explicit Bench(const FakeVlmOptions& options)
      : model(options),
        spy(model),
        generator(spy),
        prefix_ctx(model.traits().kv_cache, 1, 64),
        image_ctx(model.traits().kv_cache, 1, 64) {
    if (has_images()) {
      const bool framed = options.vision_start_token_id.has_value();
      prompt = framed ? test::prompt_with_image({3, *options.vision_start_token_id}, kImage, 4,
                                                {*options.vision_end_token_id})
                      : test::prompt_with_image({3, 7}, kImage, 4, {11});
      vision = options.layout == VisionLayout::kPerImage ? VisionInputs::per_image(at::rand({1, 16}))
                                                         : test::make_images({{1, 4, 4}});
      generator.generate({{prompt}, vision, &image_ctx}, GenerationConfig().max_new_tokens(0));
    }
    generator.generate({{{prompt[0], prompt[1]}}, {}, &prefix_ctx}, GenerationConfig().max_new_tokens(0));
    expected = good();
    snapshot = {prefix_ctx.tokens().clone(), image_ctx.tokens().clone()};
    spy.clear();
  }
  bool has_images() const { return model.traits().image_token_id.has_value(); }
  /// A valid continuation of the cached text prefix; the prefix is kept for the next call.
  std::vector<int64_t> good() {
    auto out = generator.generate({{prompt}, vision, &prefix_ctx}, GenerationConfig().max_new_tokens(3));
    prefix_ctx.truncate(2);
    return out.sequences[0].tokens;
  }

  FakeVlm model;
  ForwardSpy spy;
  Generator generator;
  InferenceContext prefix_ctx;
  InferenceContext image_ctx;
  std::vector<int64_t> prompt = {3, 7, 11};
  VisionInputs vision;
  std::vector<int64_t> expected;
  std::vector<at::Tensor> snapshot;
};

/// What a row changes in the otherwise valid request.
struct Call {
  GenerateRequest request;
  GenerationConfig config = GenerationConfig().max_new_tokens(3);
  Bench* bench = nullptr;
};

struct Row {
  std::string name;
  std::function<void(Call&)> mutate;
  std::string expect;  ///< a substring of the error message
  FakeVlmOptions options = {};
};

void PrintTo(const Row& row, std::ostream* os) { *os << row.name; }

// --- the rows ------------------------------------------------------------------------------

void token_rows(std::vector<Row>& rows) {
  const std::vector<int64_t> bad_ids = {-1, -2, kMin, 64, 65, int64_t{1} << 62, kMax};
  for (int64_t id : bad_ids) {
    for (size_t at : {size_t{0}, size_t{2}}) {
      rows.push_back({fmt::format("prompt_token_{}_at_{}", id, at),
                      [id, at](Call& c) { c.request.prompts[0][at] = id; },
                      fmt::format("token {} is {}, outside the vocabulary [0, 64)", at, id)});
    }
    rows.push_back({fmt::format("second_row_token_{}", id),
                    [id](Call& c) {
                      c.request.prompts.push_back({1, id, 2});
                    },
                    fmt::format("prompt 1 token 1 is {}", id)});
  }
  for (int64_t id : {int64_t{-1}, int64_t{64}, kMax}) {
    rows.push_back({fmt::format("end_id_{}", id),
                    [id](Call& c) {
                      c.config.end_token_ids({5, id});
                    },
                    fmt::format("end token id {} is outside", id)});
    rows.push_back({fmt::format("stop_id_{}", id), [id](Call& c) { c.config.stop_token_ids({id}); },
                    fmt::format("stop token id {} is outside", id)});
    rows.push_back({fmt::format("pad_id_{}", id), [id](Call& c) { c.config.pad_token_id(id); },
                    fmt::format("pad_token_id {} is outside", id)});
  }
  rows.push_back({"pad_id_is_the_image_token", [](Call& c) { c.config.pad_token_id(kImage); },
                  "pad_token_id 63 is the model's image/video placeholder"});
  rows.push_back({"empty_batch", [](Call& c) { c.request.prompts.clear(); }, "the batch is empty"});
  rows.push_back({"empty_second_prompt", [](Call& c) { c.request.prompts.push_back({}); }, "prompt 1 is empty"});
}

void config_rows(std::vector<Row>& rows) {
  for (int64_t n : {int64_t{-1}, kMin}) {
    rows.push_back({fmt::format("max_new_tokens_{}", n), [n](Call& c) { c.config.max_new_tokens(n); },
                    fmt::format("max_new_tokens must be >= 0, got {}", n)});
  }
  for (int64_t n : {GenerationConfig::kMaxSequenceColumns + 1, (int64_t{1} << 40) - 100, kMax}) {
    rows.push_back({fmt::format("max_new_tokens_{}", n), [n](Call& c) { c.config.max_new_tokens(n); },
                    fmt::format("max_new_tokens {} exceeds the limit of 1048576 columns", n)});
  }
  // Each under the limit, together over it (the model sets no max_sequence_length).
  rows.push_back({"prompt_plus_max_new_tokens_over_the_limit",
                  [](Call& c) {
                    c.request.prompts = {std::vector<int64_t>(600000, 1)};
                    c.config.max_new_tokens(600000);
                  },
                  "prompt 0 of 600000 tokens + max_new_tokens 600000 exceeds the limit of 1048576 columns"});
  FakeVlmOptions short_model;
  short_model.max_sequence_length = 10;
  rows.push_back({"beyond_the_model_length", [](Call& c) { c.config.max_new_tokens(4); },
                  "exceeds the model's maximum sequence length 10", short_model});
  for (int64_t n : {int64_t{-1}, kMin}) {
    rows.push_back({fmt::format("prefill_chunk_{}", n), [n](Call& c) { c.config.prefill_chunk_size(n); },
                    fmt::format("prefill_chunk_size must be >= 0 (0 = whole prompt), got {}", n)});
  }
  for (double t : {-1.0, kNan, kInf, -kInf}) {
    rows.push_back({fmt::format("temperature_{}", t), [t](Call& c) { c.config.temperature(t); },
                    "temperature must be a finite number >= 0"});
  }
  rows.push_back({"top_k_negative", [](Call& c) { c.config.top_k(-1); }, "top_k must be >= 0 (0 = off), got -1"});
  for (double p : {0.0, -0.5, 1.5, kNan}) {
    rows.push_back({fmt::format("top_p_{}", p), [p](Call& c) { c.config.top_p(p); }, "top_p must be in (0, 1]"});
  }
  for (size_t n : {size_t{2}, size_t{3}}) {
    rows.push_back({fmt::format("row_seeds_{}", n), [n](Call& c) { c.config.row_seeds(std::vector<uint64_t>(n, 1)); },
                    fmt::format("row_seeds has {} entries for a batch of 1 rows", n)});
  }
  rows.push_back({"replay_always_with_a_kv_cache", [](Call& c) { c.config.replay_mode(ReplayMode::kAlways); },
                  "replay mode 'always' sends every image to every call"});
}

void pixel_rows(std::vector<Row>& rows) {
  for (double v : {kNan, kInf, -kInf}) {
    for (int64_t at : {int64_t{0}, int64_t{95}, int64_t{191}}) {
      rows.push_back({fmt::format("pixel_{}_at_{}", v, at),
                      [v, at](Call& c) {
                        c.request.vision.pixel_values = c.request.vision.pixel_values.clone();
                        c.request.vision.pixel_values.view({-1})[at] = v;
                      },
                      "pixel_values must be finite"});
    }
  }
  rows.push_back({"pixel_values_integer",
                  [](Call& c) {
                    c.request.vision.pixel_values = at::ones({16, 12}, at::kLong);
                  },
                  "pixel_values must be a floating-point tensor, got Long"});
  rows.push_back({"pixel_values_1d", [](Call& c) { c.request.vision.pixel_values = at::ones({16}); },
                  "pixel_values must be [patches, patch_dim] for the patch-flattened layout, got [16]"});
  rows.push_back({"pixel_values_3d",
                  [](Call& c) {
                    c.request.vision.pixel_values = at::ones({16, 3, 4});
                  },
                  "got [16, 3, 4]"});
  for (int64_t n : {15, 17, 0}) {
    rows.push_back({fmt::format("pixel_rows_{}", n),
                    [n](Call& c) {
                      c.request.vision.pixel_values = at::ones({n, 12});
                    },
                    fmt::format("pixel_values has {} rows but image_grid_thw needs 16", n)});
  }
  rows.push_back(
      {"pixel_values_missing", [](Call& c) { c.request.vision.pixel_values = at::Tensor(); }, "no pixel_values"});
}

void grid_rows(std::vector<Row>& rows) {
  auto grid = [](std::vector<int64_t> v) {
    return [v](Call& c) { c.request.vision.image_grid_thw = at::tensor(v).reshape({1, 3}); };
  };
  const int64_t big = (int64_t{1} << 62) + 1;
  rows.push_back({"grid_overflow_t", grid({big, 2, 2}), "overflows a 64-bit count"});
  rows.push_back({"grid_overflow_h", grid({2, big - 1, 2}), "overflows a 64-bit count"});
  rows.push_back({"grid_overflow_hw", grid({1, int64_t{1} << 32, int64_t{1} << 32}), "overflows a 64-bit count"});
  rows.push_back(
      {"grid_overflow_thw", grid({int64_t{1} << 21, int64_t{1} << 22, int64_t{1} << 22}), "overflows a 64-bit count"});
  rows.push_back({"grid_negative_t", grid({-1, 4, 4}), "(-1, 4, 4) must be positive"});
  rows.push_back({"grid_zero_h", grid({1, 0, 4}), "(1, 0, 4) must be positive"});
  rows.push_back({"grid_negative_pair", grid({1, -4, -4}), "(1, -4, -4) must be positive"});
  rows.push_back({"grid_not_divisible", grid({1, 3, 4}), "is not divisible by spatial_merge_size 2"});
  rows.push_back({"grid_float",
                  [](Call& c) {
                    c.request.vision.image_grid_thw = at::ones({1, 3});
                  },
                  "image_grid_thw must be an integer tensor, got Float"});
  rows.push_back({"grid_0d", [](Call& c) { c.request.vision.image_grid_thw = at::scalar_tensor(4, at::kLong); },
                  "image_grid_thw must be [num_images, 3], got []"});
  FakeVlmOptions per_image;
  per_image.layout = VisionLayout::kPerImage;
  rows.push_back({"grid_0d_in_a_per_image_bundle",
                  [](Call& c) { c.request.vision.image_grid_thw = at::scalar_tensor(4, at::kLong); },
                  "image_grid_thw must be [num_images, 3], got []", per_image});
  rows.push_back({"grid_two_columns",
                  [](Call& c) {
                    c.request.vision.image_grid_thw = at::ones({1, 2}, at::kLong);
                  },
                  "image_grid_thw must be [num_images, 3], got [1, 2]"});
  rows.push_back({"grid_3d",
                  [](Call& c) {
                    c.request.vision.image_grid_thw = at::ones({1, 3, 1}, at::kLong);
                  },
                  "got [1, 3, 1]"});
  rows.push_back(
      {"grid_smaller_than_the_pixels", grid({1, 2, 2}), "pixel_values has 16 rows but image_grid_thw needs 4"});
}

void size_rows(std::vector<Row>& rows) {
  auto sizes = [](std::vector<int64_t> v) {
    return [v](Call& c) { c.request.vision.image_sizes = at::tensor(v).reshape({-1, 2}); };
  };
  rows.push_back({"sizes_zero_height", sizes({0, 56}), "image_sizes (height, width) = (0, 56) must be positive"});
  rows.push_back({"sizes_zero_width", sizes({56, 0}), "(56, 0) must be positive"});
  rows.push_back({"sizes_negative", sizes({-1, 56}), "(-1, 56) must be positive"});
  rows.push_back({"sizes_min", sizes({kMin, kMin}), "must be positive"});
  rows.push_back({"sizes_float",
                  [](Call& c) {
                    c.request.vision.image_sizes = at::full({1, 2}, 56.0);
                  },
                  "image_sizes must be an integer tensor, got Float"});
  rows.push_back({"sizes_three_columns",
                  [](Call& c) {
                    c.request.vision.image_sizes = at::ones({1, 3}, at::kLong);
                  },
                  "image_sizes must be [num_images, 2], got [1, 3]"});
  rows.push_back({"sizes_0d", [](Call& c) { c.request.vision.image_sizes = at::scalar_tensor(1, at::kLong); },
                  "image_sizes must be [num_images, 2], got []"});
  rows.push_back({"sizes_two_rows", sizes({56, 56, 56, 56}), "image_sizes has 2 rows but the bundle has 1 images"});
}

void placeholder_rows(std::vector<Row>& rows) {
  rows.push_back({"one_placeholder_short",
                  [](Call& c) {
                    c.request.prompts[0] = test::prompt_with_image({3, 7}, kImage, 3, {11});
                  },
                  "the prompts hold 3 image placeholder tokens (id 63) but the vision bundle's 1 images need 4"});
  rows.push_back({"one_placeholder_extra",
                  [](Call& c) {
                    c.request.prompts[0] = test::prompt_with_image({3, 7}, kImage, 5, {11});
                  },
                  "hold 5 image placeholder tokens"});
  rows.push_back({"placeholders_without_images", [](Call& c) { c.request.vision = {}; },
                  "hold 4 image placeholder tokens (id 63) but the vision bundle's 0 images need 0"});
  rows.push_back({"an_image_without_placeholders",
                  [](Call& c) {
                    c.request.prompts[0] = {3, 7, 11};
                  },
                  "hold 0 image placeholder tokens"});
  rows.push_back({"two_images_one_run",
                  [](Call& c) {
                    c.request.vision = test::make_images({{1, 4, 4}, {1, 2, 2}});
                  },
                  "hold 4 image placeholder tokens (id 63) but the vision bundle's 2 images need 5"});
  FakeVlmOptions text_only;
  text_only.image_token_id = std::nullopt;
  rows.push_back({"vision_for_a_text_only_model",
                  [](Call& c) {
                    c.request.vision = test::make_images({{1, 4, 4}});
                  },
                  "the request has vision tensors (1 images) but the model declares no image token id", text_only});
  FakeVlmOptions per_image;
  per_image.layout = VisionLayout::kPerImage;
  rows.push_back({"layout_mismatch",
                  [](Call& c) {
                    c.request.vision = test::make_images({{1, 4, 4}});
                  },
                  "the vision bundle uses the patch-flattened layout but the model expects per-image", per_image});
  FakeVlmOptions framed;
  framed.vision_start_token_id = 60;
  framed.vision_end_token_id = 61;
  rows.push_back(
      {"no_vision_start",
       [](Call& c) {
         c.request.prompts[0] = test::prompt_with_image({3, 7}, kImage, 4, {61});
       },
       "must be enclosed by the vision start token 60 and the vision end token 61, got 7 before and 61 after", framed});
  rows.push_back({"no_vision_end",
                  [](Call& c) {
                    c.request.prompts[0] = test::prompt_with_image({3, 60}, kImage, 4, {11});
                  },
                  "got 60 before and 11 after", framed});
  rows.push_back({"placeholders_at_the_edges",
                  [](Call& c) { c.request.prompts[0] = test::prompt_with_image({}, kImage, 4, {}); },
                  "got nothing before and nothing after", framed});
}

void context_rows(std::vector<Row>& rows) {
  rows.push_back({"context_without_kv_cache",
                  [](Call& c) {
                    c.request.context = &c.bench->prefix_ctx;
                    c.config.enable_kv_cache(false);
                  },
                  "a context was given but enable_kv_cache is false"});
  rows.push_back({"context_prefix_differs",
                  [](Call& c) {
                    c.request.context = &c.bench->prefix_ctx;
                    c.request.prompts[0][1] = 8;
                  },
                  "differ from the prompt at row 0 column 1 (cached token 7 mask 1, prompt token 8 mask 1)"});
  rows.push_back({"context_batch_differs",
                  [](Call& c) {
                    c.request.context = &c.bench->prefix_ctx;
                    c.request.prompts.push_back(c.request.prompts[0]);
                    c.request.vision = test::make_images({{1, 4, 4}, {1, 4, 4}});
                  },
                  "the context holds 1 rows but the request has 2"});
  rows.push_back({"context_too_small",
                  [](Call& c) {
                    c.request.context = &c.bench->prefix_ctx;
                    c.config.max_new_tokens(60);
                  },
                  "needs 66 KV cache columns but the context has capacity 64"});
  rows.push_back({"context_not_extended", [](Call& c) { c.request.context = &c.bench->image_ctx; },
                  "the context already holds 7 columns; the prompt (7 columns, left-padded) must extend it"});
  // Four pixels edited so that any sum weighted by position modulo 127 or 8191 is unchanged:
  // only a hash of the bytes can tell the two pictures apart.
  rows.push_back({"context_image_is_another_picture",
                  [](Call& c) {
                    c.request.context = &c.bench->image_ctx;
                    c.request.prompts[0].push_back(12);
                    at::Tensor edited = c.request.vision.pixel_values.clone();
                    auto flat = edited.view({-1});
                    flat[0] += 0.25;
                    flat[1] -= 0.25;
                    flat[127] -= 0.25;
                    flat[128] += 0.25;
                    c.request.vision.pixel_values = edited;
                  },
                  "the request's image 0 (row 0 columns [2, 6)) is not the picture cached there"});
  rows.push_back({"context_image_missing",
                  [](Call& c) {
                    c.request.context = &c.bench->image_ctx;
                    c.request.prompts[0] = {3, 7, 1, 2, 3, 4, 11, 12};
                    c.request.vision = {};
                  },
                  "the context's cached columns differ from the prompt at row 0 column 2"});
}

std::vector<Row> all_rows() {
  std::vector<Row> rows;
  token_rows(rows);
  config_rows(rows);
  pixel_rows(rows);
  grid_rows(rows);
  size_rows(rows);
  placeholder_rows(rows);
  context_rows(rows);
  return rows;
}

// --- the test --------------------------------------------------------------------------------

class BadInput : public ::testing::TestWithParam<Row> {};

TEST_P(BadInput, IsRefusedBeforeTheModelRunsAndChangesNothing) {
  const Row& row = GetParam();
  Bench bench(row.options);
  Call call;
  call.bench = &bench;
  call.request = GenerateRequest({bench.prompt}, bench.vision);
  row.mutate(call);
  try {
    bench.generator.generate(call.request, call.config);
    ADD_FAILURE() << "expected vlmgen::Error containing: " << row.expect;
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr(row.expect));
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected vlmgen::Error, got another exception: " << e.what();
  }
  EXPECT_EQ(bench.spy.calls().size(), 0u) << "the model ran before the input was refused";
  EXPECT_EQ(bench.prefix_ctx.length(), 2);
  EXPECT_TRUE(at::equal(bench.prefix_ctx.tokens(), bench.snapshot[0])) << "the text-prefix context changed";
  EXPECT_TRUE(at::equal(bench.image_ctx.tokens(), bench.snapshot[1])) << "the image context changed";
  EXPECT_EQ(bench.good(), bench.expected) << "the generator must work after the error";
}

std::string row_name(const ::testing::TestParamInfo<Row>& info) {
  std::string out;
  for (char ch : info.param.name) out.push_back(std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_');
  return out;
}

INSTANTIATE_TEST_SUITE_P(Table, BadInput, ::testing::ValuesIn(all_rows()), row_name);

TEST(BadInputTable, HasAtLeastAHundredRows) { EXPECT_GE(all_rows().size(), 100u); }

}  // namespace
}  // namespace vlmgen
