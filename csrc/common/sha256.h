// SHA-256 (FIPS 180-4), and HMAC-SHA256 with it, used to authenticate connections
// with the job secret without sending the secret itself.
#pragma once

#include <string>

namespace hvd {

// Returns the 32-byte binary digest of `data`.
std::string Sha256(const std::string& data);

// HMAC-SHA256 (RFC 2104) of `message` under `key`: the 32-byte binary tag.
std::string HmacSha256(const std::string& key, const std::string& message);

// Lower-case hexadecimal of `bytes` (two characters a byte): digests in names and logs.
std::string Hex(const std::string& bytes);

}  // namespace hvd
