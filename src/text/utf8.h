#pragma once

// UTF-8 checks shared by the tokenizer and the detokenizer (private to the library).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace vlmgen::detail {

/// Length of the valid UTF-8 sequence starting at `s[i]` (1..4), or 0 when the bytes there are
/// not one (a stray continuation byte, an overlong form, a surrogate, beyond U+10FFFF, or cut
/// short by the end of `s`). `*valid_prefix` (when given) gets the length of the longest prefix
/// that is a valid start of a sequence: the "maximal subpart" that one U+FFFD replaces.
inline size_t utf8_sequence_at(std::string_view s, size_t i, size_t* valid_prefix = nullptr) {
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t lead = byte(i);
  if (valid_prefix) *valid_prefix = 0;
  if (lead < 0x80) {
    if (valid_prefix) *valid_prefix = 1;
    return 1;
  }
  size_t need = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    need = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    need = 3;
    if (lead == 0xE0) lo = 0xA0;
    if (lead == 0xED) hi = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    need = 4;
    if (lead == 0xF0) lo = 0x90;
    if (lead == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  size_t k = 1;
  for (; k < need && i + k < s.size(); ++k) {
    const uint8_t b = byte(i + k);
    const uint8_t min = k == 1 ? lo : 0x80, max = k == 1 ? hi : 0xBF;
    if (b < min || b > max) break;
  }
  if (valid_prefix) *valid_prefix = k;
  return k == need ? need : 0;
}

/// Offset of the first byte of `s` that does not belong to valid UTF-8, if any.
inline std::optional<size_t> find_invalid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = utf8_sequence_at(s, i);
    if (n == 0) return i;
    i += n;
  }
  return std::nullopt;
}

/// Appends `bytes` to `out` as UTF-8, each maximal invalid subsequence replaced by U+FFFD.
/// Unless `final`, a valid but unfinished sequence at the end is left out. Returns the number
/// of bytes consumed (all of them when `final`).
inline size_t append_utf8_lossy(std::string& out, std::string_view bytes, bool final) {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  size_t i = 0;
  while (i < bytes.size()) {
    size_t prefix = 0;
    const size_t n = utf8_sequence_at(bytes, i, &prefix);
    if (n > 0) {
      out.append(bytes.data() + i, n);
      i += n;
      continue;
    }
    if (prefix > 0 && i + prefix == bytes.size() && !final) break;  // may still be completed
    out.append(kReplacement);
    i += prefix > 0 ? prefix : 1;
  }
  return i;
}

/// Appends a run of byte-fallback tokens' bytes (one byte per token; Tokenizer::is_fallback_byte)
/// as HF's ByteFallback decoder does: the bytes when the whole run is valid UTF-8, else one
/// U+FFFD per token, and empties it.
inline void flush_fallback_run(std::string& out, std::string& run) {
  if (run.empty()) return;
  if (!find_invalid_utf8(run)) {
    out.append(run);
  } else {
    for (size_t i = 0; i < run.size(); ++i) out.append("\xEF\xBF\xBD");
  }
  run.clear();
}

/// Whether every byte of `s` is ASCII.
inline bool is_ascii(std::string_view s) {
  for (char c : s) {
    if (static_cast<uint8_t>(c) >= 0x80) return false;
  }
  return true;
}

}  // namespace vlmgen::detail
