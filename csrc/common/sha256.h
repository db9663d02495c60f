// SHA-256 (FIPS 180-4), used to authenticate connections with the job secret
// without sending the secret itself.
#pragma once

#include <string>

namespace hvd {

// Returns the 32-byte binary digest of `data`.
std::string Sha256(const std::string& data);

}  // namespace hvd
