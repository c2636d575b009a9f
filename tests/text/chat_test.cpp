// Chat rendering against a real Jinja implementation of the Qwen2-VL template, messages → ids and
// images, bad input, and a two-turn conversation on a tiny Qwen2-VL with the real vocabulary.

#include "vlmgen/text/chat.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "chat_messages.h"
#include "node_reference.h"
#include "tiny_tokenizer.h"
#include "vlmgen/error.h"
#include "vlmgen/generator.h"
#include "vlmgen/image/image.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/models/qwen2_vl.h"
#include "vlmgen/testing/forward_spy.h"

namespace {

using nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string template_path() {
  return std::string(VLMGEN_SOURCE_DIR) + "/tests/text/reference/qwen2_vl_chat_template.jinja";
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

using vlmgen::testing_text::image_part;
using vlmgen::testing_text::text_part;
using vlmgen::testing_text::to_messages;

// Conversations covering what the template distinguishes.
std::vector<json> conversations() {
  const json img = image_part();
  std::vector<json> c;
  const auto add = [&](json messages, bool generation_prompt, bool vision_id) {
    c.push_back(json{
        {"messages", std::move(messages)}, {"add_generation_prompt", generation_prompt}, {"add_vision_id", vision_id}});
  };
  add(json::array({{{"role", "user"}, {"content", {img, text_part("Describe this image.")}}}}), true, false);
  add(json::array({{{"role", "user"}, {"content", {img, img, text_part("Which one is brighter?")}}}}), true, true);
  add(json::array({{{"role", "user"}, {"content", "Hello!"}},
                   {{"role", "assistant"}, {"content", "Hi. How can I help?"}},
                   {{"role", "user"}, {"content", {text_part("What is in "), img, text_part(" this picture?")}}}}),
      true, false);
  add(json::array({{{"role", "system"}, {"content", "You are a terse assistant."}},
                   {{"role", "user"}, {"content", "Name three colours."}}}),
      true, false);
  add(json::array({{{"role", "user"}, {"content", "No generation prompt here."}}}), false, false);
  add(json::array({{{"role", "user"}, {"content", {text_part("Two "), text_part("text parts.")}}}}), true, true);
  add(json::array({{{"role", "user"}, {"content", {img, text_part("First.")}}},
                   {{"role", "assistant"}, {"content", {text_part("A beach.")}}},
                   {{"role", "user"}, {"content", {img, text_part("And this one?"), img}}},
                   {{"role", "assistant"}, {"content", "Two dogs."}},
                   {{"role", "user"}, {"content", {text_part("Compare all three.")}}}}),
      true, true);
  add(json::array({{{"role", "system"}, {"content", {text_part("System as a list.")}}},
                   {{"role", "user"}, {"content", {img}}}}),
      true, false);
  add(json::array({{{"role", "user"}, {"content", ""}}}), true, false);
  add(json::array(
          {{{"role", "user"},
            {"content", {text_part("日本語で説明して 👍🏽\n\ttabs\r\nand <|im_start|> inside"), img}}}}),
      true, true);
  add(json::array({{{"role", "user"}, {"content", {img, text_part("a"), img, text_part("b"), img}}},
                   {{"role", "assistant"}, {"content", "three"}}}),
      false, true);
  add(json::array(
          {{{"role", "assistant"}, {"content", "An assistant speaks first."}}, {{"role", "user"}, {"content", {img}}}}),
      true, false);
  return c;
}

TEST(ChatTemplate, RendersTheQwen2VlTemplateExactlyAsJinjaDoes) {
  VLMGEN_REQUIRE_NODE_REFERENCE();
  const auto tmpl = vlmgen::ChatTemplate::from_source(read_file(template_path()), template_path());
  EXPECT_EQ(tmpl.name(), "qwen2-vl");
  const std::vector<json> cases = conversations();
  const auto expected = vlmgen::testing_text::run_reference("render", cases, template_path());
  ASSERT_EQ(expected.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    vlmgen::ChatOptions options;
    options.add_generation_prompt = cases[i]["add_generation_prompt"];
    options.add_vision_id = cases[i]["add_vision_id"];
    EXPECT_EQ(tmpl.render_text(to_messages(cases[i]["messages"]), options), expected[i].get<std::string>())
        << "conversation " << i << ": " << cases[i].dump();
  }
}

TEST(ChatTemplate, RendersLaterMessagesAsTheyAppearInTheWhole) {
  const auto tmpl = vlmgen::ChatTemplate::qwen2_vl();
  const auto messages = to_messages(conversations()[6]["messages"]);
  vlmgen::ChatOptions options;
  options.add_vision_id = true;
  const std::string whole = tmpl.render_text(messages, options);
  vlmgen::ChatOptions closed = options;
  closed.add_generation_prompt = false;
  for (size_t first = 0; first <= messages.size(); ++first) {
    const std::vector<vlmgen::ChatMessage> head(messages.begin(), messages.begin() + static_cast<long>(first));
    EXPECT_EQ(tmpl.render_text(head, closed) + tmpl.render_text(messages, options, first), whole) << first;
  }
}

TEST(ChatTemplate, RefusesATemplateItDoesNotRecognize) {
  try {
    vlmgen::ChatTemplate::from_source("{% for m in messages %}{{ m.content }}{% endfor %}", "my_template.jinja");
    FAIL() << "accepted an unknown template";
  } catch (const vlmgen::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("my_template.jinja"));
    EXPECT_THAT(e.what(), HasSubstr("not one vlmgen renders"));
    EXPECT_THAT(e.what(), HasSubstr("qwen2-vl"));
  }
  // A trailing newline (as an editor adds to a .jinja file) is the same template.
  EXPECT_EQ(vlmgen::ChatTemplate::from_source(read_file(template_path()) + "\n").name(), "qwen2-vl");
}

TEST(ChatTemplate, FindsAFoldersTemplateWhereHfWritesIt) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("vlmgen-tmpl-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  EXPECT_THROW(vlmgen::ChatTemplate::from_pretrained(dir.string()), vlmgen::Error);
  std::ofstream(dir / "tokenizer_config.json") << json{{"chat_template", read_file(template_path())}}.dump();
  EXPECT_EQ(vlmgen::ChatTemplate::from_pretrained(dir.string()).name(), "qwen2-vl");
  std::ofstream(dir / "chat_template.json") << json{{"chat_template", "{{ other }}"}}.dump();  // takes precedence
  EXPECT_THROW(vlmgen::ChatTemplate::from_pretrained(dir.string()), vlmgen::Error);
  // A template list whose name is not a string (was an uncaught nlohmann::type_error: abort).
  std::ofstream(dir / "chat_template.json") << R"({"chat_template": [{"name": 5, "template": "x"}]})";
  try {
    vlmgen::ChatTemplate::from_pretrained(dir.string());
    ADD_FAILURE() << "took a template without a name";
  } catch (const vlmgen::Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("none is named \"default\""));
  }
  fs::remove_all(dir);
}

// ---- messages → ids and images (hand-made tokenizer, so no npm needed) ----

vlmgen::QwenImageProcessorOptions small_images() {
  // 4-pixel patches merged 2x2: an 8x8 picture is one merged token per 8x8 block.
  return vlmgen::QwenImageProcessorOptions()
      .patch_size(4)
      .temporal_patch_size(2)
      .merge_size(2)
      .min_pixels(64)
      .max_pixels(64 * 64);
}

vlmgen::Image picture(int64_t height, int64_t width, uint8_t seed) {
  vlmgen::Image image{height, width, std::vector<uint8_t>(static_cast<size_t>(height * width * 3))};
  for (size_t i = 0; i < image.rgb.size(); ++i) image.rgb[i] = static_cast<uint8_t>(i * 7 + seed);
  return image;
}

class ChatProcessorTest : public ::testing::Test {
 protected:
  ChatProcessorTest()
      : tokenizer_(vlmgen::Tokenizer::from_json(
            vlmgen::testing_text::tiny_tokenizer(
                {}, R"(\s+|\S+)",
                {"<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"})
                .dump())),
        processor_(tokenizer_, vlmgen::ChatTemplate::qwen2_vl(), small_images()) {}
  vlmgen::Tokenizer tokenizer_;
  vlmgen::ChatProcessor processor_;
};

TEST_F(ChatProcessorTest, ExpandsEachImageToItsGridCountAndBundlesTheImagesInOrder) {
  const auto& v = processor_.vision_tokens();
  EXPECT_EQ(v.vision_start, 1004);
  EXPECT_EQ(v.image_pad, 1005);
  // 16x24 → 2x3 merged tokens = 6; 32x32 → 4x4 = 16.
  std::vector<vlmgen::ChatMessage> messages = {
      vlmgen::ChatMessage("user").image(picture(16, 24, 1)).text("x").image(picture(32, 32, 2))};
  vlmgen::ChatOptions options;
  options.add_generation_prompt = false;
  const vlmgen::ChatPrompt prompt = processor_.build(messages, options);
  EXPECT_EQ(prompt.num_images, 2);
  ASSERT_EQ(prompt.vision.num_images(), 2);
  EXPECT_EQ(prompt.vision.image_grid_thw[0][1].item<int64_t>() * prompt.vision.image_grid_thw[0][2].item<int64_t>(),
            24);
  const auto count = [&](int64_t id) { return std::count(prompt.ids.begin(), prompt.ids.end(), id); };
  EXPECT_EQ(count(v.image_pad), 6 + 16);
  EXPECT_EQ(count(v.vision_start), 2);
  // The ids equal the rendered text tokenized with the placeholders expanded by hand.
  std::string text = tokenizer_.decode(prompt.ids);
  const std::string six = "<|vision_start|>" + [] {
    std::string s;
    for (int i = 0; i < 6; ++i) s += "<|image_pad|>";
    return s;
  }() + "<|vision_end|>";
  EXPECT_EQ(text.substr(0, text.find("x")),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n" + six);
}

TEST_F(ChatProcessorTest, ATensorImageIsThePicturesPixels) {
  const vlmgen::Image pixels = picture(16, 24, 5);
  const at::Tensor hwc = at::from_blob(const_cast<uint8_t*>(pixels.rgb.data()), {16, 24, 3}, at::kByte).clone();
  const auto from_tensor = processor_.build({vlmgen::ChatMessage("user").image(hwc)});
  const auto from_image = processor_.build({vlmgen::ChatMessage("user").image(pixels)});
  EXPECT_EQ(from_tensor.ids, from_image.ids);
  EXPECT_TRUE(at::equal(from_tensor.vision.pixel_values, from_image.vision.pixel_values));
  try {
    vlmgen::ChatMessage("user").image(at::zeros({16, 24}, at::kFloat));
    FAIL() << "took a 2-D float tensor as an image";
  } catch (const vlmgen::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("[height, width, 3] uint8"));
  }
}

TEST_F(ChatProcessorTest, PlaceholderPartsTakeTheGivenImagesAndCountsMustMatch) {
  std::vector<vlmgen::ChatMessage> messages = {
      vlmgen::ChatMessage("user").image_placeholder().text("a").image_placeholder()};
  EXPECT_EQ(processor_.build(messages, {}, {picture(8, 8, 1), picture(8, 16, 2)}).num_images, 2);
  try {
    processor_.build(messages, {}, {picture(8, 8, 1), picture(8, 8, 2), picture(8, 8, 3)});
    FAIL() << "took more images than placeholder parts";
  } catch (const vlmgen::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("3 images were given but the messages have 2 image placeholder parts"));
  }
  try {
    processor_.build(messages, {}, {picture(8, 8, 1)});
    FAIL() << "took fewer images than placeholder parts";
  } catch (const vlmgen::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("message 0, part 2 is an image placeholder"));
  }
}

TEST_F(ChatProcessorTest, AMissingOrBrokenImageIsAnErrorNamingTheFileAndPart) {
  std::vector<vlmgen::ChatMessage> messages = {
      vlmgen::ChatMessage("user", "hi"), vlmgen::ChatMessage("user").text("see").image_file("/no/such/beach.jpg")};
  try {
    processor_.build(messages);
    FAIL() << "built a prompt from a file that does not exist";
  } catch (const vlmgen::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("message 1, part 1"));
    EXPECT_THAT(e.what(), HasSubstr("/no/such/beach.jpg"));
  }
  messages[1] = vlmgen::ChatMessage("user").image_bytes("not a picture");
  try {
    processor_.build(messages);
    FAIL() << "decoded garbage";
  } catch (const vlmgen::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("message 1, part 0"));
  }
}

TEST_F(ChatProcessorTest, ImageTokensTypedIntoTheTextAreRefusedBeforeAnyModelRuns) {
  // Typed, they would stand for an image the prompt does not carry (the model would fail halfway).
  for (const char* typed : {"<|image_pad|>", "<|vision_start|>", "<|vision_end|>"}) {
    try {
      processor_.build({vlmgen::ChatMessage("user", std::string("look: ") + typed)});
      FAIL() << "built a prompt whose text holds " << typed;
    } catch (const vlmgen::Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(std::string("image token '") + typed + "'"));
    }
  }
  // A video token would pass for a video (a 500 from deep in the model instead of a clear refusal).
  try {
    processor_.build({vlmgen::ChatMessage("user", "hi <|video_pad|>")});
    FAIL() << "built a prompt whose text holds <|video_pad|>";
  } catch (const vlmgen::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("video token '<|video_pad|>'"));
    EXPECT_THAT(e.what(), HasSubstr("videos are not supported yet"));
  }
  // The same message with a real image part builds, its tokens written by the processor.
  const vlmgen::ChatPrompt prompt =
      processor_.build({vlmgen::ChatMessage("user").text("look:").image(picture(8, 8, 1))});
  EXPECT_EQ(prompt.num_images, 1);
}

TEST_F(ChatProcessorTest, ASessionRefusesATurnBeforeTheReplyAndStaysUsable) {
  vlmgen::ChatSession session(processor_);
  const auto first = session.add_user(vlmgen::ChatMessage("user", "one"));
  EXPECT_EQ(first.new_ids, static_cast<int64_t>(first.ids.size()));
  EXPECT_THROW(session.add_user(vlmgen::ChatMessage("user", "two")), vlmgen::Error);
  session.add_reply({'o', 'k', 1003 /* <|im_end|> */});
  EXPECT_THROW(session.add_user(vlmgen::ChatMessage("user").image_file("/no/such.png")), vlmgen::Error);
  EXPECT_EQ(session.messages().size(), 2u);
  const auto second = session.add_user(vlmgen::ChatMessage("user", "two"));
  // The reply's text and the end token the template writes after it, then the new turn.
  const std::vector<int64_t> head(second.ids.begin(), second.ids.begin() + static_cast<long>(first.ids.size()));
  EXPECT_EQ(head, first.ids);
  vlmgen::ChatOptions options;
  std::vector<vlmgen::ChatMessage> all = {vlmgen::ChatMessage("user", "one"), vlmgen::ChatMessage("assistant", "ok"),
                                          vlmgen::ChatMessage("user", "two")};
  EXPECT_EQ(tokenizer_.decode(second.ids), processor_.chat_template().render_text(all, options));
}

// ---- end to end on a tiny Qwen2-VL with the real vocabulary and tokenizer ----

TEST(ChatEndToEnd, ASecondTurnComputesOnlyItsColumnsAndSendsOnlyItsImageAndEqualsOneShot) {
  VLMGEN_REQUIRE_NODE_REFERENCE();
  const auto tokenizer = vlmgen::Tokenizer::from_pretrained(vlmgen::testing_text::qwen_tokenizer_dir());
  vlmgen::QwenVlConfig config = vlmgen::QwenVlConfig::tiny();
  config.vocab_size = 151936;
  config.vision_start_token_id = 151652;
  config.vision_end_token_id = 151653;
  config.image_token_id = 151655;
  config.video_token_id = 151656;
  vlmgen::Qwen2Vl model(config, /*seed=*/11);
  vlmgen::testing::ForwardSpy spy(model);
  vlmgen::Generator generator(spy);
  const vlmgen::ChatProcessor processor(tokenizer, vlmgen::ChatTemplate::qwen2_vl(), small_images());
  vlmgen::ChatSession session(processor);
  auto context = vlmgen::InferenceContext::allocate(model.traits().kv_cache, 1, 1024);
  const auto config_for = [](bool cache) {
    return vlmgen::GenerationConfig().max_new_tokens(6).enable_kv_cache(cache).end_token_ids({151645});
  };

  const auto turn1 = session.add_user(vlmgen::ChatMessage("user").image(picture(16, 16, 3)).text("Describe it."));
  const auto out1 = generator.generate({{turn1.ids}, turn1.vision, context.get()}, config_for(true));
  ASSERT_FALSE(spy.calls().empty());
  EXPECT_EQ(spy.calls()[0].window_start, 0);
  EXPECT_THAT(spy.calls()[0].images, ElementsAre(0));
  session.add_reply(out1.sequences[0].tokens);

  const auto turn2 = session.add_user(vlmgen::ChatMessage("user").text("And this?").image(picture(24, 16, 9)));
  EXPECT_EQ(turn2.new_images, 1);
  EXPECT_EQ(turn2.vision.num_images(), 2);
  const int64_t cached = context->length();
  EXPECT_GT(cached, static_cast<int64_t>(turn1.ids.size()));  // the prompt and the reply so far
  spy.clear();
  const auto out2 = generator.generate({{turn2.ids}, turn2.vision, context.get()}, config_for(true));
  ASSERT_FALSE(spy.calls().empty());
  EXPECT_EQ(spy.calls()[0].window_start, cached);  // only the new columns
  EXPECT_EQ(spy.calls()[0].window_end, static_cast<int64_t>(turn2.ids.size()));
  EXPECT_THAT(spy.calls()[0].images, ElementsAre(1));  // only the new image
  for (size_t i = 1; i < spy.calls().size(); ++i) {
    EXPECT_TRUE(spy.calls()[i].images.empty()) << ::testing::PrintToString(spy.calls()[i]);
  }

  // The same conversation in one request without any cache gives the same answer.
  spy.clear();
  const auto one_shot = generator.generate({{turn2.ids}, turn2.vision}, config_for(false));
  EXPECT_EQ(one_shot.sequences[0].tokens, out2.sequences[0].tokens);
  EXPECT_THAT(spy.calls()[0].images, ElementsAre(0, 1));
}

}  // namespace
