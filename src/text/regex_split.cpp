#define PCRE2_CODE_UNIT_WIDTH 8
#include "regex_split.h"

#include <pcre2.h>

#include "utf8.h"
#include "vlmgen/error.h"
#include "vlmgen/io/json.h"

namespace vlmgen::detail {

namespace {

// Unicode White_Space, as the inside of a character class.
constexpr std::string_view kWhiteSpace =
    "\\t\\n\\x0B\\f\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  const int n = pcre2_get_error_message(code, buffer, sizeof(buffer));
  return n < 0 ? fmt::format("PCRE2 error {}", code) : std::string(reinterpret_cast<const char*>(buffer));
}

}  // namespace

std::string with_unicode_whitespace(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 64);
  bool in_class = false;
  size_t i = 0;
  while (i < pattern.size()) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char next = pattern[i + 1];
      if (next == 's') {
        if (in_class) {
          out.append(kWhiteSpace);
        } else {
          out.append("[").append(kWhiteSpace).append("]");
        }
      } else if (next == 'S') {
        VLMGEN_CHECK(!in_class, "the pre-tokenizer regex {} has \\S inside a character class, which is not supported",
                     quote_excerpt(pattern));
        out.append("[^").append(kWhiteSpace).append("]");
      } else {
        VLMGEN_CHECK(next != 'Q', "the pre-tokenizer regex {} quotes with \\Q...\\E, which is not supported",
                     quote_excerpt(pattern));
        out.append(pattern.substr(i, 2));
      }
      i += 2;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      ++i;
      if (i < pattern.size() && pattern[i] == '^') out.push_back(pattern[i++]);
      if (i < pattern.size() && pattern[i] == ']') out.push_back(pattern[i++]);  // a literal ']'
      continue;
    }
    if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
      const size_t end = pattern.find(":]", i + 2);
      if (end != std::string_view::npos) {
        out.append(pattern.substr(i, end + 2 - i));
        i = end + 2;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out.push_back(c);
    ++i;
  }
  return out;
}

struct RegexSplitter::State {
  pcre2_code* code = nullptr;
  bool jit = false;
  std::string what;
  ~State() { pcre2_code_free(code); }
};

RegexSplitter::RegexSplitter(std::string_view pattern, const std::string& what) : state_(std::make_unique<State>()) {
  state_->what = what;
  const std::string rewritten = with_unicode_whitespace(pattern);
  int error = 0;
  PCRE2_SIZE offset = 0;
  state_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten.data()), rewritten.size(), PCRE2_UTF | PCRE2_UCP,
                               &error, &offset, nullptr);
  VLMGEN_CHECK(state_->code != nullptr, "{}: the regex {} does not compile: {} at offset {}", what,
               quote_excerpt(pattern), pcre2_message(error), offset);
  state_->jit = pcre2_jit_compile(state_->code, PCRE2_JIT_COMPLETE) == 0;
}

RegexSplitter::~RegexSplitter() = default;

void RegexSplitter::split(std::string_view text, std::vector<std::string_view>& out) const {
  struct MatchData {
    pcre2_match_data* data;
    pcre2_match_context* context = nullptr;
    pcre2_jit_stack* stack = nullptr;
    ~MatchData() {
      pcre2_match_data_free(data);
      pcre2_match_context_free(context);
      pcre2_jit_stack_free(stack);
    }
  } md{pcre2_match_data_create_from_pattern(state_->code, nullptr)};
  VLMGEN_CHECK(md.data != nullptr, "{}: out of memory for regex match data", state_->what);
  const auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const size_t size = text.size();
  bool jit = state_->jit;
  size_t start = 0, last = 0;
  while (start <= size) {
    int rc = jit ? pcre2_jit_match(state_->code, subject, size, start, 0, md.data, md.context)
                 : pcre2_match(state_->code, subject, size, start, PCRE2_NO_UTF_CHECK, md.data, md.context);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT && md.stack == nullptr) {
      // A long run (whitespace before a look-ahead, say) outgrew the default 32 KiB JIT stack.
      md.stack = pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, nullptr);
      md.context = pcre2_match_context_create(nullptr);
      VLMGEN_CHECK(md.stack != nullptr && md.context != nullptr, "{}: out of memory for the regex stack", state_->what);
      pcre2_jit_stack_assign(md.context, nullptr, md.stack);
      continue;
    }
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      jit = false;  // the interpreter keeps its backtracking state on the heap
      continue;
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    VLMGEN_CHECK(rc >= 0, "{}: matching the pre-tokenizer regex failed at byte {} of {}: {}", state_->what, start, size,
                 pcre2_message(rc));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(md.data);
    const size_t begin = ovector[0], end = ovector[1];
    if (end == begin) {  // an empty match is no piece; step over one character
      if (begin >= size) break;
      const size_t n = utf8_sequence_at(text, begin);
      start = begin + (n > 0 ? n : 1);
      continue;
    }
    if (begin > last) out.push_back(text.substr(last, begin - last));
    out.push_back(text.substr(begin, end - begin));
    last = start = end;
  }
  if (last < size) out.push_back(text.substr(last));
}

}  // namespace vlmgen::detail
