#include "common/config.h"

#include <cstdlib>
#include <stdexcept>

namespace hvd {
namespace {

bool Parse(const char* s, int64_t* out) {
  try {
    size_t pos = 0;
    long long v = std::stoll(s, &pos);
    if (s[pos] != '\0') return false;
    *out = v;
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

bool Parse(const char* s, double* out) {
  try {
    size_t pos = 0;
    double v = std::stod(s, &pos);
    if (s[pos] != '\0') return false;
    *out = v;
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

bool Parse(const char* s, std::string* out) {
  *out = s;
  return true;
}

// What a knob of C++ type `type` takes, for error messages.
std::string Expected(const std::string& type) {
  if (type == "int64_t") return "an integer";
  if (type == "double") return "a number";
  return "valid";
}

}  // namespace

Config Config::FromEnv(std::string* error) {
  Config c;
#define HVD_READ_KNOB(member, env, type, def, doc)                               \
  if (const char* v = std::getenv(env); v != nullptr && *v != '\0') {            \
    if (!Parse(v, &c.member) && error != nullptr) {                              \
      *error += std::string(error->empty() ? "" : "; ") + env + "='" + v +       \
                "' is not " + Expected(#type) + " (see docs/config.md)";         \
    }                                                                            \
  }
  HVD_KNOBS(HVD_READ_KNOB)
#undef HVD_READ_KNOB
  return c;
}

}  // namespace hvd
