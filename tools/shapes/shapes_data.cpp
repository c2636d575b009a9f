#include "shapes/shapes_data.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>

#include "vlmgen/error.h"

namespace vlmgen::shapes {
namespace {

/// SplitMix64: the output is fixed by the algorithm (unlike std distributions, which differ
/// between standard libraries), so a scene is the same on every platform.
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}

  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  /// Uniform in [0, n); the modulo bias is below 1e-17 for the small n used here.
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t state_;
};

uint64_t scene_seed(uint64_t seed, Split split, int64_t index) {
  // Three chained draws so that nearby (seed, index) pairs land far apart.
  Random a(seed);
  Random b(a.next() ^ (split == Split::kTrain ? 0x5452414E5ULL : 0x4556414C5ULL));
  Random c(b.next() ^ static_cast<uint64_t>(index));
  return c.next();
}

constexpr std::array<std::array<int, 3>, kNumColours> kColourRgb = {{
    {215, 40, 40},   // red
    {40, 175, 60},   // green
    {45, 85, 225},   // blue
    {235, 215, 45},  // yellow
    {150, 60, 205},  // purple
    {245, 135, 30},  // orange
}};

uint8_t clamp_byte(double v) { return static_cast<uint8_t>(std::clamp(std::lround(v), 0L, 255L)); }

/// Whether offset (dx, dy) from the centre lies inside a shape of half-extent r. The square and
/// cross are a little smaller than their box so that every kind covers a similar area.
bool inside(ShapeKind kind, double dx, double dy, double r) {
  switch (kind) {
    case ShapeKind::kCircle: return dx * dx + dy * dy <= r * r;
    case ShapeKind::kSquare: return std::abs(dx) <= 0.8 * r && std::abs(dy) <= 0.8 * r;
    case ShapeKind::kTriangle:
      // Apex up at (0, -r), base from (-r, 0.75 r) to (r, 0.75 r).
      return dy >= -r && dy <= 0.75 * r && std::abs(dx) <= (dy + r) / 1.75;
    case ShapeKind::kCross: {
      const double arm = 0.32 * r;
      return (std::abs(dx) <= arm && std::abs(dy) <= r) || (std::abs(dy) <= arm && std::abs(dx) <= r);
    }
  }
  return false;
}

void check_item(const ShapeItem& item) {
  VLMGEN_CHECK(item.row >= 0 && item.row < kGridSize && item.col >= 0 && item.col < kGridSize,
               "shape cell ({}, {}) is outside the {}x{} grid", item.row, item.col, kGridSize, kGridSize);
  VLMGEN_CHECK(static_cast<int64_t>(item.colour) >= 0 && static_cast<int64_t>(item.colour) < kNumColours &&
                   static_cast<int64_t>(item.kind) >= 0 && static_cast<int64_t>(item.kind) < kNumShapeKinds,
               "shape colour {} or kind {} is not a known value", static_cast<int64_t>(item.colour),
               static_cast<int64_t>(item.kind));
}

/// Blends `item` over `image` with 4 x 4 supersampling per pixel: soft edges, so the model
/// does not learn from staircase artefacts that a resized photo would not have.
void draw(Image& image, const ShapeItem& item, const std::array<int, 3>& rgb) {
  constexpr int kSub = 4;
  const double r = item.radius;
  const int64_t x0 = std::max<int64_t>(0, static_cast<int64_t>(std::floor(item.center_x - r)));
  const int64_t x1 = std::min<int64_t>(image.width - 1, static_cast<int64_t>(std::ceil(item.center_x + r)));
  const int64_t y0 = std::max<int64_t>(0, static_cast<int64_t>(std::floor(item.center_y - r)));
  const int64_t y1 = std::min<int64_t>(image.height - 1, static_cast<int64_t>(std::ceil(item.center_y + r)));
  for (int64_t y = y0; y <= y1; ++y) {
    for (int64_t x = x0; x <= x1; ++x) {
      int hits = 0;
      for (int sy = 0; sy < kSub; ++sy) {
        for (int sx = 0; sx < kSub; ++sx) {
          const double dx = static_cast<double>(x) + (sx + 0.5) / kSub - item.center_x;
          const double dy = static_cast<double>(y) + (sy + 0.5) / kSub - item.center_y;
          hits += inside(item.kind, dx, dy, r) ? 1 : 0;
        }
      }
      if (hits == 0) continue;
      const double cover = static_cast<double>(hits) / (kSub * kSub);
      uint8_t* px = &image.rgb[static_cast<size_t>((y * image.width + x) * 3)];
      for (int c = 0; c < 3; ++c) px[c] = clamp_byte(px[c] * (1.0 - cover) + rgb[c] * cover);
    }
  }
}

Image blank(int64_t size, uint8_t level) {
  Image image;
  image.height = size;
  image.width = size;
  image.rgb.assign(static_cast<size_t>(size * size * 3), level);
  return image;
}

}  // namespace

const char* colour_name(Colour colour) {
  switch (colour) {
    case Colour::kRed: return "red";
    case Colour::kGreen: return "green";
    case Colour::kBlue: return "blue";
    case Colour::kYellow: return "yellow";
    case Colour::kPurple: return "purple";
    case Colour::kOrange: return "orange";
  }
  return "?";
}

const char* shape_name(ShapeKind kind) {
  switch (kind) {
    case ShapeKind::kCircle: return "circle";
    case ShapeKind::kSquare: return "square";
    case ShapeKind::kTriangle: return "triangle";
    case ShapeKind::kCross: return "cross";
  }
  return "?";
}

std::string position_phrase(int64_t row, int64_t col) {
  VLMGEN_CHECK(row >= 0 && row < kGridSize && col >= 0 && col < kGridSize, "cell ({}, {}) is outside the {}x{} grid",
               row, col, kGridSize, kGridSize);
  static const std::array<const char*, kGridSize> kRows = {"top", "middle", "bottom"};
  static const std::array<const char*, kGridSize> kCols = {"left", "center", "right"};
  if (row == 1 && col == 1) return "center";
  return std::string(kRows[row]) + " " + kCols[col];
}

std::vector<std::string> caption_words() {
  std::vector<std::string> words = {"a", "and"};
  for (int64_t c = 0; c < kNumColours; ++c) words.emplace_back(colour_name(static_cast<Colour>(c)));
  for (int64_t k = 0; k < kNumShapeKinds; ++k) words.emplace_back(shape_name(static_cast<ShapeKind>(k)));
  for (const char* w : {"top", "middle", "bottom", "left", "center", "right"}) words.emplace_back(w);
  return words;
}

std::string caption_of(const std::vector<ShapeItem>& items) {
  std::string caption;
  for (const ShapeItem& item : items) {
    check_item(item);
    if (!caption.empty()) caption += " and ";
    caption +=
        fmt::format("a {} {} {}", colour_name(item.colour), shape_name(item.kind), position_phrase(item.row, item.col));
  }
  return caption;
}

void SceneOptions::validate() const {
  VLMGEN_CHECK(image_size_ >= 24, "image_size must be >= 24 pixels, got {}", image_size_);
  VLMGEN_CHECK(max_shapes_ >= 1 && max_shapes_ <= kGridSize * kGridSize, "max_shapes must be in [1, {}], got {}",
               kGridSize * kGridSize, max_shapes_);
}

Scene make_scene(uint64_t seed, Split split, int64_t index, const SceneOptions& options) {
  options.validate();
  VLMGEN_CHECK(index >= 0, "scene index must be >= 0, got {}", index);
  Random random(scene_seed(seed, split, index));
  const int64_t size = options.image_size();
  const double cell = static_cast<double>(size) / kGridSize;

  // Distinct cells by a partial Fisher-Yates shuffle, then reading order for the caption.
  const int64_t count = 1 + random.below(options.max_shapes());
  std::array<int64_t, kGridSize * kGridSize> cells{};
  for (int64_t i = 0; i < kGridSize * kGridSize; ++i) cells[i] = i;
  for (int64_t i = 0; i < count; ++i) std::swap(cells[i], cells[i + random.below(kGridSize * kGridSize - i)]);
  std::sort(cells.begin(), cells.begin() + count);

  Scene scene;
  std::vector<std::array<int, 3>> tints;
  for (int64_t i = 0; i < count; ++i) {
    ShapeItem item;
    item.row = cells[i] / kGridSize;
    item.col = cells[i] % kGridSize;
    item.colour = static_cast<Colour>(random.below(kNumColours));
    item.kind = static_cast<ShapeKind>(random.below(kNumShapeKinds));
    item.radius = cell * random.uniform(0.26, 0.38);
    // Jitter keeps the whole shape inside its cell, so its cell is never ambiguous, and small
    // against a vision patch, so a tiny model learns the kinds in minutes.
    const double slack = std::min(0.1 * cell, std::max(0.0, 0.5 * cell - item.radius - 1.0));
    item.center_x = (static_cast<double>(item.col) + 0.5) * cell + random.uniform(-slack, slack);
    item.center_y = (static_cast<double>(item.row) + 0.5) * cell + random.uniform(-slack, slack);
    std::array<int, 3> rgb = kColourRgb[static_cast<size_t>(item.colour)];
    for (int& v : rgb) v = std::clamp(v + static_cast<int>(random.below(31)) - 15, 0, 255);
    scene.items.push_back(item);
    tints.push_back(rgb);
  }

  scene.image = blank(size, static_cast<uint8_t>(20 + random.below(61)));
  for (size_t i = 0; i < scene.items.size(); ++i) draw(scene.image, scene.items[i], tints[i]);
  for (uint8_t& v : scene.image.rgb) v = clamp_byte(static_cast<double>(v) + static_cast<double>(random.below(13)) - 6);
  scene.caption = caption_of(scene.items);
  return scene;
}

std::vector<Scene> make_scenes(uint64_t seed, Split split, int64_t first, int64_t count, const SceneOptions& options) {
  VLMGEN_CHECK(first >= 0 && count >= 0, "scene range must start at >= 0 and hold >= 0 scenes, got first {} count {}",
               first, count);
  std::vector<Scene> scenes;
  scenes.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) scenes.push_back(make_scene(seed, split, first + i, options));
  return scenes;
}

Image render_scene(const std::vector<ShapeItem>& items, int64_t image_size, uint8_t background) {
  SceneOptions().image_size(image_size).validate();
  Image image = blank(image_size, background);
  for (const ShapeItem& item : items) {
    check_item(item);
    draw(image, item, kColourRgb[static_cast<size_t>(item.colour)]);
  }
  return image;
}

}  // namespace vlmgen::shapes
