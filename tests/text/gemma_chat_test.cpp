// Gemma-3 chat: the shipped template rendered as a real Jinja implementation renders it, prompt ids
// as Gemma3Processor writes them (the rendering with each <start_of_image> expanded, through the
// real tokenizer), and a two-turn conversation on a tiny Gemma-3 with the real vocabulary.

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
#include "vlmgen/error.h"
#include "vlmgen/generator.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/models/gemma3.h"
#include "vlmgen/testing/forward_spy.h"
#include "vlmgen/text/chat.h"

namespace {

using nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string shipped_template() {
  std::ifstream f(vlmgen::testing_text::gemma3_tokenizer_dir() + "/tokenizer_config.json", std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return json::parse(s.str())["chat_template"].get<std::string>();
}

// The shipped template in a file of its own, for the Jinja reference.
std::string template_file() {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("vlmgen-gemma3-template-" + std::to_string(::getpid()) + ".jinja"))
          .string();
  std::ofstream(path, std::ios::binary) << shipped_template();
  return path;
}

using vlmgen::testing_text::image_part;
using vlmgen::testing_text::text_part;
using vlmgen::testing_text::to_messages;

// Conversations covering what the template distinguishes: a system message as a string and as a
// list, turns with images, text to trim, no generation prompt.
std::vector<json> conversations() {
  const json img = image_part();
  std::vector<json> c;
  const auto add = [&](json messages, bool generation_prompt) {
    c.push_back(
        json{{"messages", std::move(messages)}, {"add_generation_prompt", generation_prompt}, {"bos_token", "<bos>"}});
  };
  add(json::array({{{"role", "user"}, {"content", {img, text_part("Describe this image.")}}}}), true);
  add(json::array({{{"role", "system"}, {"content", "You are terse. "}},
                   {{"role", "user"}, {"content", "  Name three colours.\n"}}}),
      true);
  add(json::array({{{"role", "system"}, {"content", {text_part("System as a list.")}}},
                   {{"role", "user"}, {"content", {text_part(" before "), img, text_part("\tafter\n")}}}}),
      true);
  add(json::array({{{"role", "user"}, {"content", {img, text_part("First.")}}},
                   {{"role", "assistant"}, {"content", " A beach. "}},
                   {{"role", "user"}, {"content", {img, img, text_part("And these?")}}}}),
      true);
  add(json::array({{{"role", "user"}, {"content", "No generation prompt."}},
                   {{"role", "assistant"}, {"content", {text_part("Fine.")}}}}),
      false);
  add(json::array(
          {{{"role", "user"}, {"content", {text_part("日本語で説明して 👍🏽  two  spaces"), img}}}}),
      true);
  return c;
}

TEST(GemmaChatTemplate, IsTheShippedTemplateAndRendersAsJinjaDoes) {
  VLMGEN_REQUIRE_NODE_REFERENCE();
  const auto tmpl = vlmgen::ChatTemplate::from_pretrained(vlmgen::testing_text::gemma3_tokenizer_dir());
  EXPECT_EQ(tmpl.name(), "gemma3");
  const std::vector<json> cases = conversations();
  const auto expected = vlmgen::testing_text::run_reference("render", cases, template_file());
  ASSERT_EQ(expected.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    vlmgen::ChatOptions options;
    options.add_generation_prompt = cases[i]["add_generation_prompt"];
    EXPECT_EQ(tmpl.render_text(to_messages(cases[i]["messages"]), options), expected[i].get<std::string>())
        << "conversation " << i << ": " << cases[i].dump();
  }
}

TEST(GemmaChatTemplate, RefusesRolesThatDoNotAlternateAndRendersLaterMessagesAsInTheWhole) {
  const auto tmpl = vlmgen::ChatTemplate::gemma3();
  try {
    tmpl.render_text({vlmgen::ChatMessage("assistant", "first"), vlmgen::ChatMessage("user", "then")}, {});
    ADD_FAILURE() << "rendered an assistant turn first";
  } catch (const vlmgen::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("alternate user/assistant"));
    EXPECT_THAT(e.what(), HasSubstr("got assistant"));
  }
  const std::vector<vlmgen::ChatMessage> messages = {
      vlmgen::ChatMessage("system", "S"), vlmgen::ChatMessage("user", "U"), vlmgen::ChatMessage("assistant", "A"),
      vlmgen::ChatMessage("user").image_placeholder().text("V")};
  vlmgen::ChatOptions options;
  EXPECT_EQ(tmpl.render_text(messages, options),
            "<bos><start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n"
            "<start_of_turn>user\n<start_of_image>V<end_of_turn>\n<start_of_turn>model\n");
  EXPECT_EQ(tmpl.render_text(messages, options, 2),
            "<start_of_turn>model\nA<end_of_turn>\n<start_of_turn>user\n<start_of_image>V<end_of_turn>\n"
            "<start_of_turn>model\n");
  const auto segments = tmpl.render(messages, options, 3);
  ASSERT_EQ(segments.size(), 3u);
  EXPECT_EQ(segments[1].image, 0);  // the first image of the conversation
  // `trim` is Python's str.strip: U+001C and U+0085 are whitespace to it, U+FEFF is not.
  EXPECT_EQ(tmpl.render_text({vlmgen::ChatMessage("user", "\x1c\xC2\x85 x \xEF\xBB\xBF")}, options),
            "<bos><start_of_turn>user\nx \xEF\xBB\xBF<end_of_turn>\n<start_of_turn>model\n");
}

TEST(GemmaChatTemplate, RefusesInvalidUtf8AndImagesInTheSystemMessageNamingThem) {
  const auto tmpl = vlmgen::ChatTemplate::gemma3();
  try {
    tmpl.render_text({vlmgen::ChatMessage("user", "ok"), vlmgen::ChatMessage("assistant").text(" \xE2\x80")}, {});
    ADD_FAILURE() << "rendered invalid UTF-8";
  } catch (const vlmgen::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("message 1, part 0: the text is not valid UTF-8"));
  }
  try {
    tmpl.render_text({vlmgen::ChatMessage("system").text("S").image_placeholder(), vlmgen::ChatMessage("user", "U")},
                     {});
    ADD_FAILURE() << "rendered a system image";
  } catch (const vlmgen::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("would be left out of the prompt"));
  }
}

vlmgen::Image picture(int64_t height, int64_t width, uint8_t seed) {
  vlmgen::Image image{height, width, std::vector<uint8_t>(static_cast<size_t>(height * width * 3))};
  for (size_t i = 0; i < image.rgb.size(); ++i) image.rgb[i] = static_cast<uint8_t>(i * 5 + seed);
  return image;
}

vlmgen::Gemma3ImageProcessorOptions small_images() {
  vlmgen::Gemma3ImageProcessorOptions options;
  options.size = 16;
  return options;
}

TEST(GemmaChatProcessor, IdsEqualWhatGemma3ProcessorWritesThroughTheRealTokenizer) {
  VLMGEN_REQUIRE_NODE_REFERENCE();
  const auto tokenizer = vlmgen::Tokenizer::from_pretrained(vlmgen::testing_text::gemma3_tokenizer_dir());
  constexpr int64_t kTokensPerImage = 4;
  const vlmgen::ChatProcessor processor(tokenizer, vlmgen::ChatTemplate::gemma3(),
                                        vlmgen::ChatImageFormat::gemma3(tokenizer, small_images(), kTokensPerImage));
  const std::vector<json> cases = conversations();
  const auto rendered = vlmgen::testing_text::run_reference("render", cases, template_file());
  ASSERT_EQ(rendered.size(), cases.size());
  // Gemma3Processor: every <start_of_image> becomes "\n\n<start_of_image>" + the image tokens +
  // "<end_of_image>\n\n", and the text goes through the tokenizer without added tokens.
  std::string image_run = "\n\n<start_of_image>";
  for (int64_t i = 0; i < kTokensPerImage; ++i) image_run += "<image_soft_token>";
  image_run += "<end_of_image>\n\n";
  std::vector<json> expanded;
  for (const json& r : rendered) {
    std::string text = r.get<std::string>();
    for (size_t at = text.find("<start_of_image>"); at != std::string::npos;
         at = text.find("<start_of_image>", at + image_run.size())) {
      text.replace(at, std::string("<start_of_image>").size(), image_run);
    }
    expanded.emplace_back(text);
  }
  const auto expected = vlmgen::testing_text::run_reference("encode", expanded, "gemma3");
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto messages = to_messages(cases[i]["messages"]);
    std::vector<vlmgen::Image> images;
    for (const auto& m : messages) {
      for (const auto& part : m.content) {
        if (part.is_image()) images.push_back(picture(20 + 4 * static_cast<int64_t>(images.size()), 12, 3));
      }
    }
    vlmgen::ChatOptions options;
    options.add_generation_prompt = cases[i]["add_generation_prompt"];
    const vlmgen::ChatPrompt prompt = processor.build(messages, options, images);
    EXPECT_EQ(prompt.ids, expected[i].get<std::vector<int64_t>>()) << "conversation " << i << ": " << cases[i].dump();
    EXPECT_EQ(prompt.num_images, static_cast<int64_t>(images.size()));
    if (!images.empty()) {
      EXPECT_EQ(prompt.vision.layout, vlmgen::VisionLayout::kPerImage);
      EXPECT_EQ(prompt.vision.pixel_values.sizes(),
                (std::vector<int64_t>{static_cast<int64_t>(images.size()), 3, 16, 16}));
      EXPECT_EQ(prompt.vision.image_sizes[0][0].item<int64_t>(), 20);  // each image's original size
    }
  }
}

TEST(GemmaChatSession, AReplyWithSurroundingWhitespaceKeepsItsIdsAndTheNextTurnFollowsThem) {
  VLMGEN_REQUIRE_NODE_REFERENCE();
  const auto tokenizer = vlmgen::Tokenizer::from_pretrained(vlmgen::testing_text::gemma3_tokenizer_dir());
  const vlmgen::ChatProcessor processor(tokenizer, vlmgen::ChatTemplate::gemma3(),
                                        vlmgen::ChatImageFormat::gemma3(tokenizer, small_images(), 4));
  vlmgen::ChatSession session(processor);
  const auto turn1 = session.add_user(vlmgen::ChatMessage("user", "Hi"));
  std::vector<int64_t> reply = tokenizer.encode(" Hello there \n");
  reply.push_back(106);  // <end_of_turn>, where generation stopped
  session.add_reply(reply);
  const auto turn2 = session.add_user(vlmgen::ChatMessage("user", "More"));
  // The earlier ids, the reply as generated (untrimmed, without the end token), then the
  // template's text after the reply.
  std::vector<int64_t> expected = turn1.ids;
  expected.insert(expected.end(), reply.begin(), reply.end() - 1);
  const auto rest = tokenizer.encode("<end_of_turn>\n<start_of_turn>user\nMore<end_of_turn>\n<start_of_turn>model\n");
  expected.insert(expected.end(), rest.begin(), rest.end());
  EXPECT_EQ(turn2.ids, expected);
  EXPECT_EQ(turn2.new_ids, static_cast<int64_t>(rest.size()));
}

TEST(GemmaChatEndToEnd, ASecondTurnWithAnImageComputesOnlyItsColumnsAndEqualsOneShot) {
  VLMGEN_REQUIRE_NODE_REFERENCE();
  const auto tokenizer = vlmgen::Tokenizer::from_pretrained(vlmgen::testing_text::gemma3_tokenizer_dir());
  vlmgen::Gemma3Config config = vlmgen::Gemma3Config::tiny();
  config.vocab_size = 262208;
  config.boi_token_id = 255999;
  config.eoi_token_id = 256000;
  config.image_token_id = 262144;
  vlmgen::Gemma3 model(config, /*seed=*/5);
  vlmgen::testing::ForwardSpy spy(model);
  vlmgen::Generator generator(spy);
  const vlmgen::ChatProcessor processor(
      tokenizer, vlmgen::ChatTemplate::gemma3(),
      vlmgen::ChatImageFormat::gemma3(tokenizer, small_images(), config.mm_tokens_per_image));
  vlmgen::ChatSession session(processor);
  auto context = vlmgen::InferenceContext::allocate(model.traits().kv_cache, 1, 1024);
  const auto config_for = [](bool cache) {
    return vlmgen::GenerationConfig().max_new_tokens(5).enable_kv_cache(cache).end_token_ids({106});
  };
  // The seeds' scenario: a system prompt and a text turn cached, then a turn with an image.
  const auto turn1 = session.add({vlmgen::ChatMessage("system", "Answer briefly."), vlmgen::ChatMessage("user", "Hi")});
  EXPECT_EQ(turn1.ids.front(), 2);  // <bos>, written by the template
  const auto out1 = generator.generate({{turn1.ids}, turn1.vision, context.get()}, config_for(true));
  session.add_reply(out1.sequences[0].tokens);
  const auto turn2 = session.add_user(vlmgen::ChatMessage("user").image(picture(24, 16, 9)).text("And this?"));
  EXPECT_EQ(turn2.new_images, 1);
  const int64_t cached = context->length();
  spy.clear();
  const auto out2 = generator.generate({{turn2.ids}, turn2.vision, context.get()}, config_for(true));
  ASSERT_FALSE(spy.calls().empty());
  EXPECT_EQ(spy.calls()[0].window_start, cached);  // only the new columns
  EXPECT_THAT(spy.calls()[0].images, ElementsAre(0));
  spy.clear();
  const auto one_shot = generator.generate({{turn2.ids}, turn2.vision}, config_for(false));
  EXPECT_EQ(one_shot.sequences[0].tokens, out2.sequences[0].tokens);
  EXPECT_THAT(spy.calls()[0].images, ElementsAre(0));
}

}  // namespace
