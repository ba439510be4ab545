// The one byte codec of kvtier's persisted and wire formats: storage object headers, block-key hash inputs, the
// transport's peer blob and ipc control messages, the prefill/decode protocol's messages. Private to the
// libraries (scripts/check-layers.py lists who may include it).
//
// Every integer is fixed-width little-endian, whatever the host's byte order: objects written on one machine are
// read on another, and key digests must be equal across hosts. Variable-length fields carry a u32 length (strings,
// raw bytes) or a u32 count (arrays of u64) first.
//
// store_le / load_le read and write one integer at a fixed offset (formats with a fixed layout, the caller
// checked the size). ByteWriter appends; ByteReader reads in order and never past its input: a read that does not
// fit returns false and leaves both the field and the position unchanged, so a parser checks each read (or a
// chain of them) and reports the failure itself. Nothing here allocates beyond what the fields ask for, and a
// reader can bound string lengths so a corrupt length cannot ask for a huge allocation.
#pragma once

#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace kvtier::codec {

template <typename T>
concept CodecInt = std::unsigned_integral<T> && !std::same_as<T, bool>;

template <CodecInt T>
constexpr void store_le(std::byte* p, T v) noexcept {
  for (std::size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xffu);
}

template <CodecInt T>
constexpr T load_le(const std::byte* p) noexcept {
  T v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i)
    v |= static_cast<T>(static_cast<T>(std::to_integer<std::uint8_t>(p[i])) << (8 * i));
  return v;
}

// Appends to `out`: std::string (messages sent as text) or std::vector<std::byte>.
template <typename Out = std::vector<std::byte>>
class ByteWriter {
  static_assert(sizeof(typename Out::value_type) == 1);

 public:
  ByteWriter& u8(std::uint8_t v) { return put(v); }
  ByteWriter& u16(std::uint16_t v) { return put(v); }
  ByteWriter& u32(std::uint32_t v) { return put(v); }
  ByteWriter& u64(std::uint64_t v) { return put(v); }
  // u32 length, then the bytes. Callers keep lengths below 4 GiB (their formats bound them far lower).
  ByteWriter& str(std::string_view s) {
    u32(static_cast<std::uint32_t>(s.size()));
    return raw(s.data(), s.size());
  }
  // u32 count, then each value.
  ByteWriter& u64s(std::span<const std::uint64_t> v) {
    u32(static_cast<std::uint32_t>(v.size()));
    const std::size_t at = grow(v.size() * 8);
    if constexpr (std::endian::native == std::endian::little) {
      if (!v.empty()) std::memcpy(out.data() + at, v.data(), v.size() * 8);  // the same bytes, at memcpy's speed
    } else {
      for (std::size_t i = 0; i < v.size(); ++i) store_le(byte_at(at + 8 * i), v[i]);
    }
    return *this;
  }
  // Bytes as they are: magics, digests in their canonical form, MACs.
  ByteWriter& raw(const void* p, std::size_t n) {
    if (n == 0) return *this;
    const std::size_t at = grow(n);
    std::memcpy(out.data() + at, p, n);
    return *this;
  }
  ByteWriter& raw(std::string_view s) { return raw(s.data(), s.size()); }

  Out out;

 private:
  template <CodecInt T>
  ByteWriter& put(T v) {
    const std::size_t at = grow(sizeof(T));
    store_le(byte_at(at), v);
    return *this;
  }
  std::size_t grow(std::size_t n) {
    const std::size_t at = out.size();
    out.resize(at + n);
    return at;
  }
  std::byte* byte_at(std::size_t i) { return reinterpret_cast<std::byte*>(out.data() + i); }
};

class ByteReader {
 public:
  static constexpr std::size_t kUnbounded = std::numeric_limits<std::size_t>::max();

  // Strings longer than `max_string` bytes are refused (where the input itself is not bounded).
  explicit ByteReader(std::span<const std::byte> in, std::size_t max_string = kUnbounded) noexcept
      : in_(in), max_string_(max_string) {}
  explicit ByteReader(std::string_view in, std::size_t max_string = kUnbounded) noexcept
      : ByteReader(std::as_bytes(std::span<const char>(in.data(), in.size())), max_string) {}

  [[nodiscard]] bool u8(std::uint8_t& v) noexcept { return get(v); }
  [[nodiscard]] bool u16(std::uint16_t& v) noexcept { return get(v); }
  [[nodiscard]] bool u32(std::uint32_t& v) noexcept { return get(v); }
  [[nodiscard]] bool u64(std::uint64_t& v) noexcept { return get(v); }
  // A u32 length, then that many bytes.
  [[nodiscard]] bool str(std::string& s) {
    std::uint32_t n = 0;
    if (!peek_u32(n) || n > max_string_ || n > remaining() - 4) return false;
    s.assign(reinterpret_cast<const char*>(in_.data() + pos_ + 4), n);
    pos_ += 4 + std::size_t{n};
    return true;
  }
  // `n` values (the count came from elsewhere in the message).
  [[nodiscard]] bool u64s(std::vector<std::uint64_t>& v, std::uint32_t n) {
    if (n > remaining() / 8) return false;
    v.resize(n);
    if constexpr (std::endian::native == std::endian::little) {
      if (n != 0) std::memcpy(v.data(), in_.data() + pos_, std::size_t{n} * 8);
    } else {
      for (std::uint32_t i = 0; i < n; ++i) v[i] = load_le<std::uint64_t>(in_.data() + pos_ + 8 * std::size_t{i});
    }
    pos_ += std::size_t{n} * 8;
    return true;
  }
  // A u32 count, then the values.
  [[nodiscard]] bool u64s(std::vector<std::uint64_t>& v) {
    std::uint32_t n = 0;
    if (!peek_u32(n) || n > (remaining() - 4) / 8) return false;
    pos_ += 4;
    return u64s(v, n);
  }
  [[nodiscard]] bool raw(void* p, std::size_t n) noexcept {
    if (n > remaining()) return false;
    if (n != 0) std::memcpy(p, in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  [[nodiscard]] bool skip(std::size_t n) noexcept {
    if (n > remaining()) return false;
    pos_ += n;
    return true;
  }

  // Bytes read so far, and left.
  std::size_t pos() const noexcept { return pos_; }
  std::size_t remaining() const noexcept { return in_.size() - pos_; }
  bool at_end() const noexcept { return pos_ == in_.size(); }

 private:
  template <CodecInt T>
  bool get(T& v) noexcept {
    if (sizeof(T) > remaining()) return false;
    v = load_le<T>(in_.data() + pos_);
    pos_ += sizeof(T);
    return true;
  }
  bool peek_u32(std::uint32_t& v) const noexcept {
    if (remaining() < 4) return false;
    v = load_le<std::uint32_t>(in_.data() + pos_);
    return true;
  }

  std::span<const std::byte> in_;
  std::size_t max_string_;
  std::size_t pos_ = 0;
};

}  // namespace kvtier::codec
