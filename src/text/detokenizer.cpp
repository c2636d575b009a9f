#include "vlmgen/text/detokenizer.h"

#include "utf8.h"

namespace vlmgen {

StreamingDetokenizer::StreamingDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string StreamingDetokenizer::push(int64_t id) {
  std::string out;
  if (!tokenizer_.has_token(id)) {  // as Tokenizer::decode: what is held, then U+FFFD
    detail::flush_fallback_run(out, run_);
    detail::append_utf8_lossy(out, pending_, true);
    pending_.clear();
    out.append("\xEF\xBF\xBD");
    return out;
  }
  if (skip_special_tokens_ && tokenizer_.is_special(id)) return out;
  if (tokenizer_.is_fallback_byte(id)) {  // held until the run ends: a later byte may spoil it
    detail::append_utf8_lossy(out, pending_, true);
    pending_.clear();
    run_.append(tokenizer_.token_bytes(id));
    return out;
  }
  detail::flush_fallback_run(out, run_);
  pending_.append(tokenizer_.token_bytes(id));
  const size_t used = detail::append_utf8_lossy(out, pending_, false);
  pending_.erase(0, used);
  return out;
}

std::string StreamingDetokenizer::finish() {
  std::string out;
  detail::flush_fallback_run(out, run_);
  detail::append_utf8_lossy(out, pending_, true);
  pending_.clear();
  return out;
}

}  // namespace vlmgen
