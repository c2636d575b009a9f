// Safetensors files and checkpoint folders: every dtype round-trips exactly, the layout written,
// narrow and converting reads, metadata, what save refuses, single-file and sharded checkpoints
// and their errors. Malformed files are in safetensors_malformed_test.cpp.

#include "vlmgen/io/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "safetensors_test_util.h"
#include "vlmgen/error.h"

namespace vlmgen {
namespace {

using safetensors_test::header_length;
using safetensors_test::read_bytes;
using safetensors_test::SafetensorsTest;
using safetensors_test::write_bytes;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::map<std::string, at::Tensor> one_of_each_dtype() {
  at::manual_seed(7);
  std::map<std::string, at::Tensor> t;
  t["f64"] = at::randn({3, 5}, at::kDouble);
  t["f32"] = at::randn({4, 3, 2});
  t["f16"] = at::randn({7}).to(at::kHalf);
  t["bf16"] = at::randn({2, 9}).to(at::kBFloat16);
  t["i64"] =
      at::tensor({std::numeric_limits<int64_t>::min(), int64_t{-1}, int64_t{0}, std::numeric_limits<int64_t>::max()});
  t["i32"] = at::randint(-100000, 100000, {3, 3}, at::kInt);
  t["i16"] = at::randint(-30000, 30000, {5}, at::kShort);
  t["i8"] = at::randint(-128, 128, {2, 2, 2}, at::kChar);
  t["u8"] = at::randint(0, 256, {11}, at::kByte);
  t["bool"] = at::randint(0, 2, {3, 4}, at::kByte).to(at::kBool);
  t["scalar"] = at::scalar_tensor(2.5, at::kFloat);
  t["empty"] = at::empty({0, 3}, at::kFloat);
  return t;
}

TEST_F(SafetensorsTest, RoundTripsEveryDtypeExactly) {
  const auto tensors = one_of_each_dtype();
  const std::string path = file("all.safetensors");
  save_safetensors(path, tensors);

  std::map<std::string, at::Tensor> loaded;
  {
    SafetensorsFile f(path);
    ASSERT_EQ(f.names().size(), tensors.size());
    for (const auto& [name, t] : tensors) loaded[name] = f.tensor(name);
  }  // mapping gone: the loaded tensors must own their memory
  for (const auto& [name, t] : tensors) {
    SCOPED_TRACE(name);
    const at::Tensor& got = loaded.at(name);
    EXPECT_EQ(got.scalar_type(), t.scalar_type());
    EXPECT_EQ(got.sizes(), t.sizes());
    EXPECT_TRUE(got.device().is_cpu());
    EXPECT_TRUE(at::equal(got, t));
  }
}

TEST_F(SafetensorsTest, WritesPaddedHeaderAndSortedData) {
  const auto tensors = one_of_each_dtype();
  const std::string path = file("layout.safetensors");
  save_safetensors(path, tensors);
  const std::string bytes = read_bytes(path);
  const uint64_t n = header_length(bytes);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes[8], '{');

  SafetensorsFile f(path);
  int64_t expected_begin = 0;
  for (const auto& name : f.names()) {  // sorted names, data packed in that order
    const SafetensorsEntry& e = f.entry(name);
    EXPECT_EQ(e.begin, expected_begin) << name;
    expected_begin = e.end;
  }
  EXPECT_EQ(static_cast<uint64_t>(expected_begin), bytes.size() - 8 - n);
}

TEST_F(SafetensorsTest, SavesNonContiguousAndReportsEntries) {
  const at::Tensor base = at::arange(24, at::kFloat).reshape({4, 6});
  const std::string path = file("t.safetensors");
  save_safetensors(path, {{"w", base.t()}});
  SafetensorsFile f(path);
  EXPECT_TRUE(f.contains("w"));
  EXPECT_FALSE(f.contains("v"));
  EXPECT_EQ(f.entry("w").dtype, at::kFloat);
  EXPECT_EQ(f.entry("w").shape, (std::vector<int64_t>{6, 4}));
  EXPECT_TRUE(at::equal(f.tensor("w"), base.t().contiguous()));
}

TEST_F(SafetensorsTest, NarrowReadsTheSameSliceAsTheFullTensor) {
  at::manual_seed(3);
  const std::map<std::string, at::Tensor> tensors = {
      {"f32", at::randn({4, 6, 5})},
      {"bf16", at::randn({6, 4}).to(at::kBFloat16)},
      {"i64", at::arange(30, at::kLong).reshape({2, 3, 5})},
      {"bool", at::randint(0, 2, {5, 3}, at::kByte).to(at::kBool)},
  };
  const std::string path = file("n.safetensors");
  save_safetensors(path, tensors);
  SafetensorsFile f(path);
  int checked = 0;
  for (const auto& [name, full] : tensors) {
    for (int64_t dim = 0; dim < full.dim(); ++dim) {
      const int64_t size = full.size(dim);
      for (int64_t start = 0; start <= size; ++start) {
        for (int64_t length = 0; start + length <= size; ++length) {
          SCOPED_TRACE(fmt::format("{} dim {} start {} length {}", name, dim, start, length));
          const at::Tensor got = f.narrow(name, dim, start, length);
          ASSERT_TRUE(got.is_contiguous());
          ASSERT_TRUE(at::equal(got, full.narrow(dim, start, length)));
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 100);
  // Negative dims count from the end, like at::narrow.
  EXPECT_TRUE(at::equal(f.narrow("f32", -1, 1, 2), tensors.at("f32").narrow(2, 1, 2)));
}

TEST_F(SafetensorsTest, ReadsConvertedToAnotherDtypeEqualTheFileDtypeReadThenConverted) {
  // 1100 x 1300 float32 is 5.7 MB: the conversion goes through the 4 MiB buffer more than once, a
  // piece ending mid-row; column slices are runs of 4 to 5196 bytes gathered into one buffer.
  at::manual_seed(5);
  const std::map<std::string, at::Tensor> tensors = {
      {"big", at::randn({1100, 1300})},
      {"half", at::randn({1300, 1100}).to(at::kHalf)},
      {"small", at::randn({3, 5, 7})},
      {"bool", at::randint(0, 2, {5, 3}, at::kByte).to(at::kBool)},
  };
  const std::string path = file("c.safetensors");
  save_safetensors(path, tensors);
  SafetensorsFile f(path);
  for (const auto& [name, full] : tensors) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) {
      SCOPED_TRACE(fmt::format("{} as {}", name, c10::toString(dtype)));
      const at::Tensor whole = f.tensor_as(name, dtype);
      ASSERT_EQ(whole.scalar_type(), dtype);
      ASSERT_TRUE(at::equal(whole, full.to(dtype)));
      for (int64_t dim = 0; dim < full.dim(); ++dim) {
        const int64_t size = full.size(dim);
        for (auto [start, length] : std::vector<std::pair<int64_t, int64_t>>{{0, size}, {1, size - 2}, {size / 2, 1}}) {
          const at::Tensor got = f.narrow_as(name, dim, start, length, dtype);
          ASSERT_TRUE(got.is_contiguous());
          ASSERT_TRUE(at::equal(got, full.narrow(dim, start, length).to(dtype)))
              << "dim " << dim << " start " << start << " length " << length;
          if (name == "bool") continue;
          // Into memory the caller placed (a weight's place in a loader's arena): the same values.
          at::Tensor into = at::full(got.sizes(), 7, dtype);
          f.narrow_into(name, dim, start, into);
          ASSERT_TRUE(at::equal(into, got)) << "into: dim " << dim << " start " << start << " length " << length;
        }
      }
    }
  }
  // FP8 tensors are read as their bytes only: converting the bytes as numbers is refused.
  const std::string fp8_path = file("f8.safetensors");
  const at::Tensor bytes = at::arange(0, 126, at::kByte).reshape({6, 21});
  save_safetensors(fp8_path, {{"w", bytes}}, {}, {{"w", Fp8Format::kE4M3}});
  SafetensorsFile fp8(fp8_path);
  EXPECT_TRUE(at::equal(fp8.tensor("w"), bytes));
  EXPECT_TRUE(at::equal(fp8.narrow_as("w", 1, 3, 5, at::kByte), bytes.narrow(1, 3, 5)));
  EXPECT_THAT([&] { fp8.tensor_as("w", at::kFloat); },
              ::testing::ThrowsMessage<Error>(AllOf(HasSubstr("FP8 tensor 'w'"), HasSubstr("Float"))));
  EXPECT_THROW(fp8.narrow_as("w", 0, 1, 2, at::kBFloat16), Error);
  at::Tensor fp8_into = at::empty({6, 5}, at::kByte);
  fp8.narrow_into("w", 1, 3, fp8_into);
  EXPECT_TRUE(at::equal(fp8_into, bytes.narrow(1, 3, 5)));

  // A tensor to read into of the wrong shape, past the end, strided or bool: refused, naming it.
  at::Tensor wrong = at::empty({1100, 1299});
  EXPECT_THAT(
      [&] { f.narrow_into("big", 0, 0, wrong); },
      ::testing::ThrowsMessage<Error>(AllOf(HasSubstr("'big'"), HasSubstr("[1100, 1300]"), HasSubstr("[1100, 1299]"))));
  at::Tensor rows = at::empty({10, 1300});
  EXPECT_THAT([&] { f.narrow_into("big", 0, 1095, rows); },
              ::testing::ThrowsMessage<Error>(AllOf(HasSubstr("'big'"), HasSubstr("start 1095 length 10"))));
  at::Tensor strided = at::empty({1300, 1100}).t();
  EXPECT_THAT([&] { f.narrow_into("big", 0, 0, strided); }, ::testing::ThrowsMessage<Error>(HasSubstr("contiguous")));
  at::Tensor flags = at::empty({5, 3}, at::kBool);
  EXPECT_THAT([&] { f.narrow_into("bool", 0, 0, flags); }, ::testing::ThrowsMessage<Error>(HasSubstr("bool")));

  // The pages dropped behind a read come back from the file: reading again gives the same values.
  EXPECT_TRUE(at::equal(f.tensor("big"), tensors.at("big")));
  f.release("big");
  EXPECT_TRUE(at::equal(f.tensor_as("big", at::kBFloat16), tensors.at("big").to(at::kBFloat16)));
}

TEST_F(SafetensorsTest, NarrowOutOfBoundsThrowsWithTheNumbers) {
  const std::string path = file("n.safetensors");
  save_safetensors(path, {{"w", at::zeros({4, 6})}, {"s", at::scalar_tensor(1.0)}});
  SafetensorsFile f(path);
  try {
    f.narrow("w", 1, 4, 3);
    FAIL() << "expected vlmgen::Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("start 4 length 3"));
    EXPECT_THAT(e.what(), HasSubstr("size 6"));
  }
  EXPECT_THROW(f.narrow("w", 2, 0, 1), Error);
  EXPECT_THROW(f.narrow("w", -3, 0, 1), Error);
  EXPECT_THROW(f.narrow("w", 0, -1, 1), Error);
  EXPECT_THROW(f.narrow("w", 0, 1, -1), Error);
  EXPECT_THROW(f.narrow("w", 0, 1, std::numeric_limits<int64_t>::max()), Error);
  EXPECT_THROW(f.narrow("s", 0, 0, 1), Error);
  // The object stays usable after errors.
  EXPECT_TRUE(at::equal(f.narrow("w", 0, 1, 2), at::zeros({2, 6})));
}

TEST_F(SafetensorsTest, KeepsMetadata) {
  const std::string path = file("m.safetensors");
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "a \"quoted\" é"}};
  save_safetensors(path, {{"x", at::ones({2})}}, meta);
  SafetensorsFile f(path);
  EXPECT_EQ(f.metadata(), meta);
  EXPECT_EQ(f.names(), std::vector<std::string>{"x"});  // metadata is not a tensor
}

TEST_F(SafetensorsTest, UnknownNameThrowsNamingIt) {
  const std::string path = file("u.safetensors");
  save_safetensors(path, {{"x", at::ones({2})}});
  SafetensorsFile f(path);
  EXPECT_THAT([&] { f.tensor("model.missing.weight"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("model.missing.weight")));
  EXPECT_THAT([&] { f.entry("nope"); }, ::testing::ThrowsMessage<Error>(HasSubstr("nope")));
}

TEST_F(SafetensorsTest, SaveRejectsWhatItCannotWrite) {
  const std::string path = file("c.safetensors");
  EXPECT_THAT(
      [&] {
        save_safetensors(path, {{"c", at::ones({2}, at::kComplexFloat)}});
      },
      ::testing::ThrowsMessage<Error>(AllOf(HasSubstr("'c'"), HasSubstr("dtype"))));
  EXPECT_THROW(save_safetensors(path, {{"__metadata__", at::ones({2})}}), Error);
  EXPECT_THROW(save_safetensors(path, {{"bad\xff", at::ones({2})}}), Error);  // not UTF-8
  EXPECT_THROW(save_safetensors(path, {{"a", at::ones({2})}}, {{"k", "\xc3"}}), Error);
  EXPECT_THAT(
      [&] {
        save_safetensors(dir_ + "/no/such/dir/x.safetensors", {{"a", at::ones({2})}});
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("no/such/dir")));
}

TEST_F(SafetensorsTest, OpensSingleFileCheckpoint) {
  save_safetensors(file("model.safetensors"), {{"a", at::ones({2})}, {"b", at::zeros({3})}});
  SafetensorsCheckpoint ckpt(dir_);
  EXPECT_EQ(ckpt.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(at::equal(ckpt.tensor("b"), at::zeros({3})));
  EXPECT_THAT([&] { ckpt.tensor("c"); }, ::testing::ThrowsMessage<Error>(HasSubstr("'c'")));
}

TEST_F(SafetensorsTest, OpensShardedCheckpointThroughIndex) {
  at::manual_seed(5);
  const at::Tensor a = at::randn({4, 3});
  const at::Tensor b = at::randn({2}).to(at::kBFloat16);
  const at::Tensor c = at::arange(6, at::kLong);
  save_safetensors(file("model-00001-of-00002.safetensors"), {{"a", a}, {"b", b}});
  save_safetensors(file("model-00002-of-00002.safetensors"), {{"c", c}});
  write_bytes(file("model.safetensors.index.json"), R"({
    "metadata": {"total_size": 100},
    "weight_map": {"a": "model-00001-of-00002.safetensors",
                   "b": "model-00001-of-00002.safetensors",
                   "c": "model-00002-of-00002.safetensors"}})");
  SafetensorsCheckpoint ckpt(dir_);
  EXPECT_EQ(ckpt.names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_TRUE(at::equal(ckpt.tensor("a"), a));
  EXPECT_TRUE(at::equal(ckpt.tensor("b"), b));
  EXPECT_TRUE(at::equal(ckpt.tensor("c"), c));
  EXPECT_TRUE(at::equal(ckpt.narrow("a", 0, 2, 2), a.narrow(0, 2, 2)));
  EXPECT_EQ(ckpt.entry("c").shape, std::vector<int64_t>{6});
  EXPECT_THAT([&] { ckpt.tensor("d"); }, ::testing::ThrowsMessage<Error>(HasSubstr("'d'")));
}

TEST_F(SafetensorsTest, ShardedCheckpointListsWhatIsMissing) {
  save_safetensors(file("s1.safetensors"), {{"a", at::ones({1})}});
  write_bytes(file("model.safetensors.index.json"),
              R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors",
                                 "c": "s3.safetensors"}})");
  try {
    SafetensorsCheckpoint ckpt(dir_);
    FAIL() << "expected vlmgen::Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("s2.safetensors"));
    EXPECT_THAT(e.what(), HasSubstr("s3.safetensors"));
    EXPECT_THAT(e.what(), HasSubstr("2 shard"));
  }
  write_bytes(file("model.safetensors.index.json"),
              R"({"weight_map": {"a": "s1.safetensors", "ghost.weight": "s1.safetensors"}})");
  EXPECT_THAT([&] { SafetensorsCheckpoint ckpt(dir_); }, ::testing::ThrowsMessage<Error>(HasSubstr("ghost.weight")));
  write_bytes(file("model.safetensors.index.json"), R"({"weight_map": {"a": 3}})");
  EXPECT_THROW(SafetensorsCheckpoint ckpt(dir_), Error);
  write_bytes(file("model.safetensors.index.json"), R"({"weight_map": {"a": "../s1.safetensors"}})");
  EXPECT_THROW(SafetensorsCheckpoint ckpt(dir_), Error);
  write_bytes(file("model.safetensors.index.json"), "not json");
  EXPECT_THROW(SafetensorsCheckpoint ckpt(dir_), Error);
}

TEST_F(SafetensorsTest, EmptyDirectoryIsAnError) {
  EXPECT_THAT([&] { SafetensorsCheckpoint ckpt(dir_); },
              ::testing::ThrowsMessage<Error>(HasSubstr("model.safetensors")));
  EXPECT_THAT([&] { SafetensorsFile f(dir_ + "/absent.safetensors"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("absent.safetensors")));
}

}  // namespace
}  // namespace vlmgen
