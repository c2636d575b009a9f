// Malformed safetensors files: the numbers each error message carries, and hundreds of mutated
// headers (flipped bytes, truncations, odd length fields, JSON edits) that must either load
// consistently or throw vlmgen::Error, nothing else.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "safetensors_test_util.h"
#include "vlmgen/error.h"
#include "vlmgen/io/safetensors.h"

namespace vlmgen {
namespace {

using safetensors_test::header_length;
using safetensors_test::read_bytes;
using safetensors_test::SafetensorsTest;
using safetensors_test::write_bytes;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::string length_field(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// A file made of `header` JSON text and `data_bytes` bytes of data section.
std::string raw_file(const std::string& header, size_t data_bytes) {
  return length_field(header.size()) + header + std::string(data_bytes, '\x01');
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
