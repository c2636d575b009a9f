#pragma once

// Typed look-ups of config.json fields over an ordered list of scopes (text_config, then the top
// level, ...), with messages that name the field where it was found. Private to src/models.

#include <cmath>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "../io/json_parse.h"
#include "vlmgen/error.h"

namespace vlmgen::detail {

using Json = nlohmann::json;

// One object to look fields up in, and how to name it in messages ("text_config.").
struct Scope {
  const Json* object;
  std::string prefix;
};

inline const Json* find_in(const Scope& scope, const char* key) {
  auto it = scope.object->find(key);
  if (it == scope.object->end() || it->is_null()) return nullptr;
  return &*it;
}

// First scope holding `key`; `where` receives the field's full name for messages.
inline const Json* find_first(const std::vector<Scope>& scopes, const char* key, std::string* where) {
  for (const auto& scope : scopes) {
    if (const Json* v = find_in(scope, key)) {
      *where = scope.prefix + key;
      return v;
    }
  }
  return nullptr;
}

inline std::string scope_list(const std::vector<Scope>& scopes) {
  std::string out;
  for (const auto& scope : scopes) {
    if (!out.empty()) out += " or ";
    out += scope.prefix.empty() ? std::string("the top level") : scope.prefix.substr(0, scope.prefix.size() - 1);
  }
  return out;
}

inline int64_t as_int(const Json& v, const std::string& field, bool allow_integral_float = false) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    VLMGEN_CHECK(u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                 "config field '{}' is {}, beyond the int64 range", field, u);
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (allow_integral_float && v.is_number_float()) {
    const double d = v.get<double>();
    VLMGEN_CHECK(std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e18,
                 "config field '{}' must be a whole number, got {}", field, d);
    return static_cast<int64_t>(d);
  }
  VLMGEN_FAIL("config field '{}' must be an integer, got JSON {} ({})", field, v.type_name(), detail::json_excerpt(v));
}

inline double as_double(const Json& v, const std::string& field) {
  VLMGEN_CHECK(v.is_number(), "config field '{}' must be a number, got JSON {} ({})", field, v.type_name(),
               detail::json_excerpt(v));
  return v.get<double>();
}

inline bool as_bool(const Json& v, const std::string& field) {
  VLMGEN_CHECK(v.is_boolean(), "config field '{}' must be a boolean, got JSON {} ({})", field, v.type_name(),
               detail::json_excerpt(v));
  return v.get<bool>();
}

inline std::string as_string(const Json& v, const std::string& field) {
  VLMGEN_CHECK(v.is_string(), "config field '{}' must be a string, got JSON {} ({})", field, v.type_name(),
               detail::json_excerpt(v));
  return v.get<std::string>();
}

// Typed look-ups over an ordered list of scopes; messages name the field where it was found.
class FieldReader {
 public:
  explicit FieldReader(std::vector<Scope> scopes) : scopes_(std::move(scopes)) {}

  /// The first scope's value for `key` (nullptr when absent); `field` gets its full name.
  const Json* find(const char* key, std::string* field) const { return find_first(scopes_, key, field); }

  int64_t required_int(const char* key) const {
    std::string field;
    const Json* v = find(key, &field);
    VLMGEN_CHECK(v != nullptr, "config is missing required field '{}' (looked in {})", key, scope_list(scopes_));
    return as_int(*v, field);
  }
  int64_t int_or(const char* key, int64_t fallback, bool allow_integral_float = false) const {
    std::string field;
    const Json* v = find(key, &field);
    return v ? as_int(*v, field, allow_integral_float) : fallback;
  }
  double double_or(const char* key, double fallback) const {
    std::string field;
    const Json* v = find(key, &field);
    return v ? as_double(*v, field) : fallback;
  }
  bool bool_or(const char* key, bool fallback) const {
    std::string field;
    const Json* v = find(key, &field);
    return v ? as_bool(*v, field) : fallback;
  }
  std::string string_or(const char* key, const std::string& fallback) const {
    std::string field;
    const Json* v = find(key, &field);
    return v ? as_string(*v, field) : fallback;
  }
  /// An array of integers, or `fallback` when absent.
  std::vector<int64_t> int_list_or(const char* key, const std::vector<int64_t>& fallback) const {
    std::string field;
    const Json* v = find(key, &field);
    if (v == nullptr) return fallback;
    VLMGEN_CHECK(v->is_array(), "config field '{}' must be an array of integers, got JSON {} ({})", field,
                 v->type_name(), detail::json_excerpt(*v));
    VLMGEN_CHECK(v->size() <= 4096, "config field '{}' has {} entries, expected at most 4096", field, v->size());
    std::vector<int64_t> out;
    for (size_t i = 0; i < v->size(); ++i) out.push_back(as_int((*v)[i], fmt::format("{}[{}]", field, i)));
    return out;
  }
  /// The same quantity under two spellings (in_chans / in_channels); they must agree if both set.
  int64_t aliased_int_or(const char* key, const char* alias, int64_t fallback) const {
    std::string key_field;
    std::string alias_field;
    const Json* a = find(key, &key_field);
    const Json* b = find(alias, &alias_field);
    if (a && b) {
      const int64_t va = as_int(*a, key_field);
      const int64_t vb = as_int(*b, alias_field);
      VLMGEN_CHECK(va == vb, "config fields '{}' ({}) and '{}' ({}) disagree", key_field, va, alias_field, vb);
      return va;
    }
    if (a) return as_int(*a, key_field);
    if (b) return as_int(*b, alias_field);
    return fallback;
  }

 private:
  std::vector<Scope> scopes_;
};

}  // namespace vlmgen::detail
