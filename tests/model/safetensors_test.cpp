#include "vlmgen/io/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "vlmgen/error.h"

namespace vlmgen {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// A fresh directory per test so parallel ctest runs do not share files.
class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "vlmgen_safetensors_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    // Best effort; files are small and live under the test temp dir.
    for (const auto& f : created_) ::unlink(f.c_str());
    ::rmdir(dir_.c_str());
  }
  std::string file(const std::string& name) {
    created_.push_back(dir_ + "/" + name);
    return created_.back();
  }

  std::string dir_;
  std::vector<std::string> created_;
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

uint64_t header_length(const std::string& bytes) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  return n;
}

std::string length_field(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// A file made of `header` JSON text and `data_bytes` bytes of data section.
std::string raw_file(const std::string& header, size_t data_bytes) {
  return length_field(header.size()) + header + std::string(data_bytes, '\x01');
}

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

// Specific malformed headers and the numbers their messages must carry.
TEST_F(SafetensorsTest, ErrorMessagesCarryTheNumbers) {
  const std::string path = file("bad.safetensors");
  auto message_for = [&](const std::string& bytes) -> std::string {
    write_bytes(path, bytes);
    try {
      SafetensorsFile f(path);
    } catch (const Error& e) {
      return e.what();
    }
    return "<no error>";
  };

  EXPECT_THAT(message_for("abc"), HasSubstr("3 bytes"));
  const std::string tiny_header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::string bytes = raw_file(tiny_header, 8);
  bytes.replace(0, 8, length_field(1000));
  EXPECT_THAT(message_for(bytes), AllOf(HasSubstr("1000"), HasSubstr(path)));
  EXPECT_THAT(message_for(raw_file(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 24)),
              AllOf(HasSubstr("24 bytes"), HasSubstr("[0, 20]")));
  EXPECT_THAT(message_for(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4)),
              AllOf(HasSubstr("[0, 8]"), HasSubstr("4 bytes")));
  EXPECT_THAT(message_for(raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8)), HasSubstr("-2"));
  EXPECT_THAT(message_for(raw_file(R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", 8)), HasSubstr("'Q4'"));
  EXPECT_THAT(message_for(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8)),
              HasSubstr("[8, 0]"));
  EXPECT_THAT(message_for(raw_file(R"({"a":{"dtype":"F32","shape":[2]}})", 8)), HasSubstr("data_offsets"));
  EXPECT_THAT(message_for(raw_file(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,1]}})", 1)),
              HasSubstr("overflows"));
  EXPECT_THAT(message_for(raw_file("[1,2]", 0)), HasSubstr("array"));
  EXPECT_THAT(message_for(raw_file("{\"a\":", 0)), HasSubstr("not valid JSON"));
  // A BOOL byte other than 0/1 opens fine (bytes are not read eagerly) but fails on read.
  const std::string bool_header = R"({"a":{"dtype":"BOOL","shape":[1],"data_offsets":[0,1]}})";
  EXPECT_EQ(message_for(length_field(bool_header.size()) + bool_header + "\x02"), "<no error>");
  SafetensorsFile f(path);
  EXPECT_THAT([&] { f.tensor("a"); }, ::testing::ThrowsMessage<Error>(HasSubstr("byte 2")));
}

// Loads `path` as far as possible. Returns true when it loaded; vlmgen::Error is the only
// acceptable failure.
bool load_everything(const std::string& path, std::string* failure) {
  try {
    SafetensorsFile f(path);
    for (const auto& name : f.names()) {
      const SafetensorsEntry& e = f.entry(name);
      at::Tensor t;
      try {
        t = f.tensor(name);
      } catch (const Error&) {
        continue;  // e.g. a BOOL tensor with bytes other than 0/1
      }
      if (static_cast<int64_t>(t.nbytes()) != e.end - e.begin) {
        *failure = fmt::format("tensor '{}' has {} bytes, offsets say {}", name, t.nbytes(), e.end - e.begin);
        return true;
      }
      if (t.dim() > 0 && !at::equal(f.narrow(name, 0, 0, t.size(0)), t)) {
        *failure = fmt::format("narrow of the full '{}' differs from tensor()", name);
      }
    }
    return true;
  } catch (const Error&) {
    return false;
  } catch (const std::exception& e) {
    *failure = fmt::format("non-vlmgen exception: {}", e.what());
    return false;
  } catch (...) {
    *failure = "unknown exception";
    return false;
  }
}

TEST_F(SafetensorsTest, MalformedHeadersThrowVlmgenErrorOrLoadConsistently) {
  const std::string good_path = file("good.safetensors");
  save_safetensors(good_path,
                   {{"a.weight", at::arange(12, at::kFloat).reshape({3, 4})},
                    {"b.bias", at::arange(6, at::kLong)},
                    {"c.mask", at::ones({5}, at::kBool)}},
                   {{"format", "pt"}});
  const std::string good = read_bytes(good_path);
  const uint64_t n = header_length(good);
  const std::string header = good.substr(8, n);
  const size_t data_size = good.size() - 8 - n;

  std::vector<std::string> mutants;
  std::mt19937 rng(12345);
  // Random flips of 1-3 header bytes (including the length field).
  for (int i = 0; i < 150; ++i) {
    std::string m = good;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k) {
      const size_t pos = rng() % (8 + n);
      m[pos] = static_cast<char>(m[pos] ^ (1 + rng() % 255));
    }
    mutants.push_back(m);
  }
  // Printable replacements inside the JSON keep it parseable more often, reaching deeper checks.
  const std::string alphabet = "0123456789-[]{},:\"e.FIUB ";
  for (int i = 0; i < 60; ++i) {
    std::string m = good;
    m[8 + rng() % n] = alphabet[rng() % alphabet.size()];
    mutants.push_back(m);
  }
  // Truncations.
  for (size_t len = 0; len < good.size(); len += 5) mutants.push_back(good.substr(0, len));
  // Header length field set to odd values.
  for (uint64_t len : {uint64_t{0}, uint64_t{1}, uint64_t{2}, uint64_t{7}, n - 1, n + 1, n + 8,
                       uint64_t{good.size() - 8}, uint64_t{good.size() - 7}, uint64_t{100'000'001}, uint64_t{1} << 32,
                       uint64_t{1} << 63, std::numeric_limits<uint64_t>::max()}) {
    mutants.push_back(length_field(len) + good.substr(8));
  }
  // JSON edits.
  const std::vector<std::string> entries = {
      R"("x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]})",
      R"("x":{"dtype":"F32","shape":[1],"data_offsets":[0,99999999999]})",
      R"("x":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551615,0]})",
      R"("x":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]})",
      R"("x":{"dtype":"F32","shape":[1],"data_offsets":[4,0]})",
      R"("x":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]})",
      R"("x":{"dtype":"F32","shape":[1],"data_offsets":[0.0,4.0]})",
      R"("x":{"dtype":"F32","shape":[1],"data_offsets":"0,4"})",
      R"("x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]})",
      R"("x":{"dtype":"F16","shape":[1],"data_offsets":[0,4]})",
      R"("x":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]})",
      R"("x":{"dtype":"U32","shape":[1],"data_offsets":[0,4]})",
      R"("x":{"dtype":"f32","shape":[1],"data_offsets":[0,4]})",
      R"("x":{"dtype":32,"shape":[1],"data_offsets":[0,4]})",
      R"("x":{"dtype":"F32","shape":"1","data_offsets":[0,4]})",
      R"("x":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]})",
      R"("x":{"dtype":"F32","shape":[[1]],"data_offsets":[0,4]})",
      R"("x":{"dtype":"F32","shape":[9223372036854775807],"data_offsets":[0,4]})",
      R"("x":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]})",
      R"("x":{"dtype":"F32","shape":[3037000500,3037000500],"data_offsets":[0,4]})",
      R"("x":{"dtype":"F32","shape":[0,9223372036854775807,2],"data_offsets":[0,0]})",
      R"("x":{"dtype":"F32","shape":[0],"data_offsets":[0,0]})",
      R"("x":{"dtype":"F32","shape":[],"data_offsets":[0,4]})",
      R"("x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"y":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})",
      R"("x":{"shape":[1],"data_offsets":[0,4]})",
      R"("x":{"dtype":"F32","data_offsets":[0,4]})",
      R"("x":{"dtype":"F32","shape":[1]})",
      R"("x":[1,2,3])",
      R"("x":null)",
      R"("__metadata__":{"k":1})",
      R"("__metadata__":[1])",
      R"("__metadata__":{"k":"v"},"__metadata__":{"k":"w"})",
  };
  for (const auto& e : entries) {
    mutants.push_back(raw_file("{" + e + "}", data_size));
    mutants.push_back(raw_file(header.substr(0, header.rfind('}')) + "," + e + "}", data_size));
  }
  for (const std::string& h :
       {std::string(""), std::string("null"), std::string("42"), std::string("\"str\""), std::string("{}"),
        std::string("[]"), std::string(1000, '['), std::string("{\"a\":\xff}")}) {
    mutants.push_back(raw_file(h, data_size));
  }
  // Padding the header with whitespace keeps the file valid (the data stays packed), so some
  // mutants must load: a reader that refuses everything would fail the count below.
  for (size_t pad = 1; pad <= 12; ++pad) {
    const std::string padded = header + std::string(pad, ' ');
    mutants.push_back(length_field(padded.size()) + padded + good.substr(8 + n));
  }
  ASSERT_GE(mutants.size(), 300u);

  const std::string path = file("mutant.safetensors");
  int loaded = 0;
  int rejected = 0;
  for (size_t i = 0; i < mutants.size(); ++i) {
    write_bytes(path, mutants[i]);
    std::string failure;
    (load_everything(path, &failure) ? loaded : rejected)++;
    EXPECT_TRUE(failure.empty()) << "mutant " << i << ": " << failure;
  }
  // Both outcomes must occur, or the mutations did not exercise anything.
  EXPECT_GT(loaded, 10);
  EXPECT_GT(rejected, 100);
  RecordProperty("loaded", loaded);
  RecordProperty("rejected", rejected);
}

}  // namespace
}  // namespace vlmgen
