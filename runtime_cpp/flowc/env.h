// The FLOWC_* environment variables the runtime reads, and the one strict reader for them.
//
// Every variable is in kVariables with the values it takes (docs/runtime.md, "Environment
// variables", lists the same). An unset variable and an empty one are the same: the default.
// Anything else must be exactly one of the accepted forms: decimal digits only (no sign, no
// spaces, no hexadecimal, no exponent), inside the variable's range; flags are 0 or 1. Any
// other value is an error naming the variable, the value and what it takes:
//
//   FLOWC_SIM_STACK_KB='99999999999999999999': expected a whole number of KiB from 64 to 1048576
//
//   flowc::Status st = flowc::env::check_all();   // every variable (a model's create() does this)
//   bool on = false;
//   st = flowc::env::flag("FLOWC_STATS", &on);     // unset: false
//   int64_t kb = 64;
//   st = flowc::env::integer("FLOWC_SIM_STACK_KB", &kb);  // unset: kb keeps its default
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "flowc/status.h"

namespace flowc {
namespace env {

enum class Kind {
  kFlag,     // 0 or 1
  kInteger,  // decimal digits, lo..hi
  kSeconds,  // decimal digits with an optional fraction ("30", "2.5", ".5"), lo..hi
  kOrder,    // forward, reverse or shuffle:SEED (SEED: decimal digits, 0 .. 2^64-1)
  kPath,     // a path (any text)
};

struct Variable {
  const char* name;
  Kind kind;
  double lo, hi;     // kInteger and kSeconds
  const char* what;  // what a valid value is, for messages
};

// clang-format off
constexpr Variable kVariables[] = {
    {"FLOWC_TIMEOUT_S", Kind::kSeconds, 0.001, 31536000,
     "a decimal number of seconds from 0.001 to 31536000 (365 days), such as 30 or 2.5"},
    {"FLOWC_TRACE", Kind::kPath, 0, 0, "a file path"},
    {"FLOWC_COMM_LOG", Kind::kPath, 0, 0, "a path prefix"},
    {"FLOWC_STATS", Kind::kFlag, 0, 1, "0 or 1"},
    {"FLOWC_TUNE", Kind::kFlag, 0, 1, "0 or 1"},
    {"FLOWC_CONV_UNFUSED", Kind::kFlag, 0, 1, "0 or 1"},
    {"FLOWC_DROP_EVENT", Kind::kInteger, 0, 2147483647, "an event number from 0 to 2147483647"},
    {"FLOWC_SIM_ORDER", Kind::kOrder, 0, 0,
     "forward, reverse or shuffle:SEED (SEED a whole number from 0 to 18446744073709551615)"},
    {"FLOWC_SIM_STATS", Kind::kFlag, 0, 1, "0 or 1"},
    {"FLOWC_SIM_FIBERS", Kind::kFlag, 0, 1, "0 or 1"},
    {"FLOWC_SIM_STACK_KB", Kind::kInteger, 64, 1048576,
     "a whole number of KiB from 64 to 1048576 (1 GiB)"},
    {"FLOWC_SIM_REFUSE_FUSED_CONV", Kind::kFlag, 0, 1, "0 or 1"},
};
// clang-format on

// The order FLOWC_SIM_ORDER names.
struct SimOrder {
  enum Which { kForward, kReverse, kShuffle } which = kForward;
  uint64_t seed = 0;
};

namespace detail {

inline const Variable* find(const char* name) {
  for (const Variable& v : kVariables) {
    if (std::strcmp(v.name, name) == 0) return &v;
  }
  return nullptr;
}

// NAME='value', the value's bytes outside printable ASCII (and the quote) as \xNN escapes, so
// no value can move a terminal's cursor.
inline std::string shown(const char* name, const char* value) {
  std::string s = std::string(name) + "='";
  char buf[8];
  for (const char* c = value; *c != '\0'; ++c) {
    const unsigned char u = static_cast<unsigned char>(*c);
    if (u >= 0x20 && u < 0x7f && u != '\'' && u != '\\') {
      s += *c;
    } else {
      std::snprintf(buf, sizeof buf, "\\x%02x", unsigned(u));
      s += buf;
    }
  }
  return s + "'";
}

inline Status invalid(const Variable& v, const char* value) {
  return InvalidArgument(shown(v.name, value) + ": expected " + v.what);
}

// Decimal digits only, without overflow: false for anything else.
inline bool digits(const char* s, uint64_t* out) {
  if (*s == '\0') return false;
  uint64_t n = 0;
  for (; *s != '\0'; ++s) {
    if (*s < '0' || *s > '9') return false;
    const uint64_t d = uint64_t(*s - '0');
    if (n > (UINT64_MAX - d) / 10) return false;
    n = n * 10 + d;
  }
  *out = n;
  return true;
}

// "30", "2.5", "30." or ".5": digits with at most one '.', at least one digit.
inline bool decimal(const char* s, double* out) {
  int ndigits = 0, dots = 0;
  for (const char* c = s; *c != '\0'; ++c) {
    if (*c >= '0' && *c <= '9') {
      ++ndigits;
    } else if (*c == '.' && dots == 0) {
      ++dots;
    } else {
      return false;
    }
  }
  if (ndigits == 0) return false;
  // Only digits and one '.' reach strtod: no locale, sign, hexadecimal or exponent form.
  *out = std::strtod(s, nullptr);
  return true;
}

// The variable's value, or nullptr when it is unset or empty.
inline const char* raw(const Variable& v) {
  const char* s = std::getenv(v.name);
  return s != nullptr && *s != '\0' ? s : nullptr;
}

inline Status unknown(const char* name) {
  return InvalidArgument(std::string("internal error: ") + name +
                         " is not a FLOWC_* variable of flowc/env.h");
}

}  // namespace detail

// The variable's value, or nullptr when it is unset or empty (for kPath variables).
inline const char* path(const char* name) {
  const Variable* v = detail::find(name);
  return v != nullptr ? detail::raw(*v) : nullptr;
}

// A 0/1 flag; unset or empty: false.
inline Status flag(const char* name, bool* out) {
  const Variable* v = detail::find(name);
  if (v == nullptr || v->kind != Kind::kFlag) return detail::unknown(name);
  *out = false;
  const char* s = detail::raw(*v);
  if (s == nullptr) return Status::Ok();
  if (std::strcmp(s, "0") != 0 && std::strcmp(s, "1") != 0) return detail::invalid(*v, s);
  *out = s[0] == '1';
  return Status::Ok();
}

// A whole number in the variable's range; unset or empty: *out is left as it is.
inline Status integer(const char* name, int64_t* out) {
  const Variable* v = detail::find(name);
  if (v == nullptr || v->kind != Kind::kInteger) return detail::unknown(name);
  const char* s = detail::raw(*v);
  if (s == nullptr) return Status::Ok();
  uint64_t n = 0;
  if (!detail::digits(s, &n) || double(n) < v->lo || double(n) > v->hi) return detail::invalid(*v, s);
  *out = int64_t(n);
  return Status::Ok();
}

// A number of seconds in the variable's range; unset or empty: *out is left as it is.
inline Status seconds(const char* name, double* out) {
  const Variable* v = detail::find(name);
  if (v == nullptr || v->kind != Kind::kSeconds) return detail::unknown(name);
  const char* s = detail::raw(*v);
  if (s == nullptr) return Status::Ok();
  double t = 0;
  if (!detail::decimal(s, &t) || t < v->lo || t > v->hi) return detail::invalid(*v, s);
  *out = t;
  return Status::Ok();
}

// FLOWC_SIM_ORDER; unset or empty: forward.
inline Status sim_order(SimOrder* out) {
  const Variable* v = detail::find("FLOWC_SIM_ORDER");
  *out = SimOrder();
  const char* s = v != nullptr ? detail::raw(*v) : nullptr;
  if (s == nullptr) return Status::Ok();
  if (std::strcmp(s, "forward") == 0) return Status::Ok();
  if (std::strcmp(s, "reverse") == 0) {
    out->which = SimOrder::kReverse;
    return Status::Ok();
  }
  if (std::strncmp(s, "shuffle:", 8) == 0 && detail::digits(s + 8, &out->seed)) {
    out->which = SimOrder::kShuffle;
    return Status::Ok();
  }
  *out = SimOrder();
  return detail::invalid(*v, s);
}

// Checks every variable of kVariables: the first one set to a value it does not take is the
// error.
inline Status check_all() {
  for (const Variable& v : kVariables) {
    Status st;
    bool b = false;
    int64_t i = 0;
    double d = 0;
    SimOrder o;
    switch (v.kind) {
      case Kind::kFlag:
        st = flag(v.name, &b);
        break;
      case Kind::kInteger:
        st = integer(v.name, &i);
        break;
      case Kind::kSeconds:
        st = seconds(v.name, &d);
        break;
      case Kind::kOrder:
        st = sim_order(&o);
        break;
      case Kind::kPath:
        break;
    }
    if (!st.ok()) return st;
  }
  return Status::Ok();
}

}  // namespace env
}  // namespace flowc
