// Fixed-width fields and length-prefixed strings for the transport's wire and metadata formats (the peer blob,
// the ipc backend's control messages). Fields are in host byte order: both ends of every kvtier transport run
// on little-endian x86-64 or aarch64 and check a version and a checksum or a socket peer first.
//
// ByteReader never reads past its input: every read returns false instead, and leaves the field unchanged.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

namespace kvtier::transport::detail {

// Appends to `out`: std::string or std::vector<std::byte>.
template <typename Out>
class ByteWriter {
 public:
  void u8(std::uint8_t v) { raw(&v, 1); }
  void u32(std::uint32_t v) { raw(&v, 4); }
  void u64(std::uint64_t v) { raw(&v, 8); }
  // u32 length, then the bytes.
  void str(std::string_view s) {
    u32(static_cast<std::uint32_t>(s.size()));
    raw(s.data(), s.size());
  }
  void raw(const void* p, std::size_t n) {
    const auto* b = static_cast<const typename Out::value_type*>(p);
    // append, not insert at the end, for a string: GCC 12 at -O3 reports a false -Wrestrict overlap inside
    // basic_string::insert (GCC bug 105651).
    if constexpr (std::is_same_v<Out, std::string>)
      out.append(b, n);
    else
      out.insert(out.end(), b, b + n);
  }
  Out out;
};

class ByteReader {
 public:
  // Strings longer than `max_string` bytes are refused (a corrupt length cannot ask for a huge allocation
  // where the input itself is not bounded).
  explicit ByteReader(std::span<const std::byte> in, std::size_t max_string = kUnbounded)
      : in_(in), max_string_(max_string) {}
  explicit ByteReader(std::string_view in, std::size_t max_string = kUnbounded)
      : ByteReader(std::as_bytes(std::span<const char>(in.data(), in.size())), max_string) {}

  bool u8(std::uint8_t& v) { return raw(&v, 1); }
  bool u32(std::uint32_t& v) { return raw(&v, 4); }
  bool u64(std::uint64_t& v) { return raw(&v, 8); }
  bool str(std::string& s) {
    const std::size_t start = pos_;
    std::uint32_t n = 0;
    if (!u32(n) || n > max_string_ || n > in_.size() - pos_) {
      pos_ = start;
      return false;
    }
    s.assign(reinterpret_cast<const char*>(in_.data() + pos_), n);
    pos_ += n;
    return true;
  }
  bool raw(void* p, std::size_t n) {
    if (n > in_.size() - pos_) return false;
    std::memcpy(p, in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  // Bytes read so far.
  std::size_t pos() const { return pos_; }

 private:
  static constexpr std::size_t kUnbounded = std::numeric_limits<std::size_t>::max();
  std::span<const std::byte> in_;
  std::size_t max_string_;
  std::size_t pos_ = 0;
};

}  // namespace kvtier::transport::detail
