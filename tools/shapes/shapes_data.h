#pragma once

// Synthetic grounded-captioning data: small RGB pictures of one or more coloured shapes on a
// 3 x 3 grid, each with a caption that names every shape's colour, kind and place.
//
//   vlmgen::shapes::Scene scene = vlmgen::shapes::make_scene(/*seed=*/1, vlmgen::shapes::Split::kTrain, 0);
//   // scene.image:   96 x 96 RGB
//   // scene.caption: "a red circle top left and a blue square bottom right"
//
// Every word after the leading "a" depends on the picture, so a caption generated without the
// image behind it (the legacy step-zero replay bug) comes out visibly wrong.

#include <cstdint>
#include <string>
#include <vector>

#include "vlmgen/image/qwen_image_processor.h"

namespace vlmgen::shapes {

enum class Colour { kRed, kGreen, kBlue, kYellow, kPurple, kOrange };
enum class ShapeKind { kCircle, kSquare, kTriangle, kCross };

inline constexpr int64_t kNumColours = 6;
inline constexpr int64_t kNumShapeKinds = 4;
/// Shapes sit in the cells of a kGridSize x kGridSize grid, one shape per cell at most.
inline constexpr int64_t kGridSize = 3;

/// "red", "green", ...
const char* colour_name(Colour colour);
/// "circle", "square", ...
const char* shape_name(ShapeKind kind);
/// The words naming grid cell (row, col): "top left", "top center", ..., "center", ...,
/// "bottom right". Throws vlmgen::Error for a cell outside the grid.
std::string position_phrase(int64_t row, int64_t col);

/// Every word a caption can use, in a fixed order (the tokenizer's id order after its
/// special tokens).
std::vector<std::string> caption_words();

/// One shape in a scene. Coordinates are in pixels of the scene's image.
struct ShapeItem {
  Colour colour = Colour::kRed;
  ShapeKind kind = ShapeKind::kCircle;
  int64_t row = 0;  ///< grid row, 0 = top
  int64_t col = 0;  ///< grid column, 0 = left
  double center_x = 0.0;
  double center_y = 0.0;
  double radius = 0.0;  ///< half the shape's extent
};

/// "a <colour> <shape> <position>" for each item, joined by " and ", in the given order.
std::string caption_of(const std::vector<ShapeItem>& items);

/// Which stream of scenes: the two never share a scene seed, so a model evaluated on kEval with
/// the training seed still sees pictures it was not trained on.
enum class Split { kTrain, kEval };

/// Settings of the scene generator.
///   auto options = SceneOptions().image_size(64).max_shapes(1);
class SceneOptions {
 public:
  /// Side of the square image in pixels (>= 24). Default 96.
  SceneOptions& image_size(int64_t value) {
    image_size_ = value;
    return *this;
  }
  int64_t image_size() const { return image_size_; }

  /// Shapes per scene are drawn uniformly from [1, max_shapes] (1 to kGridSize^2). Default 2.
  SceneOptions& max_shapes(int64_t value) {
    max_shapes_ = value;
    return *this;
  }
  int64_t max_shapes() const { return max_shapes_; }

  /// Throws vlmgen::Error naming the field when a value is out of range.
  void validate() const;

 private:
  int64_t image_size_ = 96;
  int64_t max_shapes_ = 2;
};

/// One picture with its shapes (in reading order of their cells) and its caption.
struct Scene {
  Image image;
  std::vector<ShapeItem> items;
  std::string caption;
};

/// Scene `index` of the stream (seed, split): a pure function of its arguments, the same on every
/// platform and build (own integer random generator, no std distributions), so any scene can be
/// regenerated on its own and training data never depends on batch size or order.
/// Shapes get a random colour, kind and distinct cell, a jittered centre and size, and a
/// slightly jittered colour; the background is a noisy dark grey of random level.
Scene make_scene(uint64_t seed, Split split, int64_t index, const SceneOptions& options = SceneOptions());

/// Scenes first, first + 1, ..., first + count - 1 of the stream (seed, split).
std::vector<Scene> make_scenes(uint64_t seed, Split split, int64_t first, int64_t count,
                               const SceneOptions& options = SceneOptions());

/// Draws `items` (anti-aliased) on a plain background of grey `background`, without noise.
/// Handy for a hand-made test picture. Throws vlmgen::Error for an item outside the grid.
Image render_scene(const std::vector<ShapeItem>& items, int64_t image_size, uint8_t background = 48);

}  // namespace vlmgen::shapes
