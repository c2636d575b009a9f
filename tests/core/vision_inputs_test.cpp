#include "vlmgen/vision_inputs.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "test_util.h"
#include "vlmgen/image_spans.h"

namespace vlmgen {
namespace {

using ::testing::HasSubstr;

TEST(VisionInputs, CountsImagesAndPlaceholders) {
  auto v = test::make_images({{1, 4, 4}, {2, 2, 6}, {1, 2, 2}});
  EXPECT_EQ(v.num_images(), 3);
  EXPECT_NO_THROW(v.validate(2));
  EXPECT_EQ(v.placeholder_counts(2), (std::vector<int64_t>{4, 6, 1}));
  EXPECT_EQ(v.placeholder_counts(1), (std::vector<int64_t>{16, 24, 4}));
  EXPECT_TRUE(VisionInputs().empty());
  EXPECT_EQ(VisionInputs().num_images(), 0);
}

TEST(VisionInputs, SelectKeepsPixelsGridAndSizesConsistent) {
  auto v = test::make_images({{1, 4, 4}, {2, 2, 6}, {1, 2, 2}}, 9);
  // Image 1 owns pixel rows [16, 40), image 2 rows [40, 44).
  auto s = v.select({1, 2});
  ASSERT_EQ(s.num_images(), 2);
  EXPECT_NO_THROW(s.validate(2));
  EXPECT_TRUE(at::equal(s.pixel_values, v.pixel_values.narrow(0, 16, 28)));
  EXPECT_TRUE(at::equal(s.image_grid_thw, v.image_grid_thw.narrow(0, 1, 2)));
  EXPECT_TRUE(at::equal(s.image_sizes, v.image_sizes.narrow(0, 1, 2)));
  auto first_last = v.select({0, 2});
  EXPECT_TRUE(
      at::equal(first_last.pixel_values, at::cat({v.pixel_values.narrow(0, 0, 16), v.pixel_values.narrow(0, 40, 4)})));
  EXPECT_TRUE(v.select({}).empty());
  EXPECT_THROW(v.select({3}), Error);
  EXPECT_THROW(v.select({1, 0}), Error);
}

TEST(VisionInputs, PerImageLayoutSelectsLeadingEntries) {
  auto pixels = at::rand({3, 3, 8, 8});
  auto sizes = at::tensor({10, 20, 30, 40, 50, 60}, at::kLong).reshape({3, 2});
  auto v = VisionInputs::per_image(pixels, sizes);
  EXPECT_EQ(v.num_images(), 3);
  EXPECT_NO_THROW(v.validate(1));
  EXPECT_EQ(v.placeholder_counts(1, 5), (std::vector<int64_t>{5, 5, 5}));
  EXPECT_THROW(v.placeholder_counts(1, 0), Error);
  auto s = v.select({2});
  EXPECT_TRUE(at::equal(s.pixel_values, pixels.narrow(0, 2, 1)));
  EXPECT_TRUE(at::equal(s.image_sizes, sizes.narrow(0, 2, 1)));
}

TEST(VisionInputs, ValidationNamesTheNumbers) {
  auto v = test::make_images({{1, 4, 4}, {1, 2, 2}});
  auto bad_rows = v;
  bad_rows.pixel_values = v.pixel_values.narrow(0, 0, 19);
  try {
    bad_rows.validate(2);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("19 rows"));
    EXPECT_THAT(e.what(), HasSubstr("needs 20"));
  }
  auto bad_grid = test::make_images({{1, 4, 5}});
  EXPECT_THROW(bad_grid.validate(2), Error);
  EXPECT_NO_THROW(bad_grid.validate(1));
  auto no_pixels = v;
  no_pixels.pixel_values = at::Tensor();
  EXPECT_THROW(no_pixels.validate(2), Error);
  auto int_pixels = v;
  int_pixels.pixel_values = v.pixel_values.to(at::kLong);
  EXPECT_THROW(int_pixels.validate(2), Error);
  auto bad_grid_shape = v;
  bad_grid_shape.image_grid_thw = at::ones({2, 2}, at::kLong);
  EXPECT_THROW(bad_grid_shape.validate(2), Error);
}

TEST(ImageSpans, FindsSpansInOrderAndSplitsAdjacentImages) {
  const int64_t P = 50;
  std::vector<std::vector<int64_t>> rows = {{1, P, P, 2}, {3, 4}, {P, P, P, P, P, 5, P}};
  auto spans = find_image_spans(rows, P, {2, 3, 2, 1}, {2, 0, 0});
  ASSERT_EQ(spans.size(), 4u);
  EXPECT_EQ(spans[0], (ImageSpan{0, 0, 3, 5}));  // shifted by the row's offset 2
  EXPECT_EQ(spans[1], (ImageSpan{1, 2, 0, 3}));
  EXPECT_EQ(spans[2], (ImageSpan{2, 2, 3, 5}));  // same run as image 1
  EXPECT_EQ(spans[3], (ImageSpan{3, 2, 6, 7}));
}

TEST(ImageSpans, MismatchesAreErrorsWithBothNumbers) {
  const int64_t P = 50;
  try {
    find_image_spans({{1, P, P, P}}, P, {2, 2});
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("hold 3 image placeholder"));
    EXPECT_THAT(e.what(), HasSubstr("need 4"));
  }
  // Right total, wrong split: the run of 3 cannot hold an image of 2 and then end mid-image.
  EXPECT_THROW(find_image_spans({{P, P, P, 1, P}}, P, {2, 2}), Error);
  EXPECT_TRUE(find_image_spans({{1, 2, 3}}, P, {}).empty());
}

}  // namespace
}  // namespace vlmgen
