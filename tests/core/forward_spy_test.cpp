// The spy as a user's GoogleTest/gmock suite would use it.

#include "vlmgen/testing/forward_spy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "test_util.h"
#include "vlmgen/generator.h"
#include "vlmgen/testing/fake_vlm.h"

namespace vlmgen {
namespace {

using ::testing::AllOf;
using ::testing::Field;
using testing::ForwardCall;
using ::testing::Property;

struct MockObserver {
  MOCK_METHOD(void, Seen, (const ForwardCall& call));
};

TEST(ForwardSpy, DrivesGmockExpectationsOnEveryCall) {
  testing::FakeVlm model;
  testing::ForwardSpy spy(model);
  MockObserver observer;
  spy.on_call([&](const ForwardCall& c) { observer.Seen(c); });
  auto prompt = test::prompt_with_image({1, 2}, 63, 4, {3});
  auto vision = test::make_images({{1, 4, 4}});

  EXPECT_CALL(observer, Seen(AllOf(Property(&ForwardCall::has_all_vision, true),
                                   Field(&ForwardCall::had_context, false), Field(&ForwardCall::window_start, 0))))
      .Times(5);
  Generator(spy).generate({{prompt}, vision}, GenerationConfig().max_new_tokens(5).enable_kv_cache(false));
  ::testing::Mock::VerifyAndClearExpectations(&observer);

  ::testing::InSequence in_order;
  EXPECT_CALL(observer, Seen(AllOf(Field(&ForwardCall::step, 0), Property(&ForwardCall::has_all_vision, true))));
  EXPECT_CALL(observer, Seen(Property(&ForwardCall::has_any_vision, false))).Times(3);
  Generator(spy).generate({{prompt}, vision}, GenerationConfig().max_new_tokens(4));
}

TEST(ForwardSpy, RecordsWindowsShapesAndPrintsReadably) {
  testing::FakeVlm model;
  testing::ForwardSpy spy(model);
  Generator(spy).generate({{test::prompt_with_image({1}, 63, 4, {2})}, test::make_images({{1, 4, 4}})},
                          GenerationConfig().max_new_tokens(2));
  ASSERT_EQ(spy.calls().size(), 2u);
  EXPECT_EQ(spy.calls()[1].index, 1);
  EXPECT_EQ(spy.calls()[1].context_length, 6);
  std::string printed = ::testing::PrintToString(spy.calls()[0]);
  EXPECT_THAT(printed, ::testing::HasSubstr("window [0, 6) kv pixel_values [16,12] grid [1,3]"));
  spy.clear();
  EXPECT_TRUE(spy.calls().empty());
}

}  // namespace
}  // namespace vlmgen
