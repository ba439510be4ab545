// vLLM's KV event schema as msgpack: a minimal encoder for the types the schema uses (arrays, strings,
// integers, float64, bin, nil) and a decoder that accepts exactly those.
#include "kvtier/metrics/kv_events.h"

#include <fmt/format.h>

#include <bit>
#include <chrono>
#include <cstring>
#include <limits>
#include <memory>

#include "kvtier/core/enum_names.h"

namespace kvtier::metrics {

constexpr EnumName<Medium> kMediumEntries[] = {
    {Medium::kGpu, "GPU"},
    {Medium::kCpu, "CPU"},
    {Medium::kDisk, "DISK"},
    {Medium::kRemote, "REMOTE"},
};
constexpr auto kMediumNames = enum_table("medium", kMediumEntries, "GPU");
std::string_view medium_name(Medium m) noexcept { return kMediumNames.name(m); }

Result<Medium> parse_medium(std::string_view name) { return kMediumNames.parse(name); }

double unix_time_now() noexcept {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

namespace {

// ---- encoder ------------------------------------------------------------------
class Writer {
 public:
  std::string out;
  void be(std::uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; --i) out += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  void nil() { out += '\xc0'; }
  void array(std::size_t n) {
    if (n < 16) {
      out += static_cast<char>(0x90 | n);
    } else if (n <= 0xffff) {
      out += '\xdc';
      be(n, 2);
    } else {
      out += '\xdd';
      be(n, 4);
    }
  }
  void str(std::string_view s) {
    if (s.size() < 32) {
      out += static_cast<char>(0xa0 | s.size());
    } else if (s.size() <= 0xff) {
      out += '\xd9';
      be(s.size(), 1);
    } else {
      out += '\xda';
      be(s.size(), 2);
    }
    out += s;
  }
  void bin(const void* p, std::size_t n) {
    out += '\xc4';
    be(n, 1);
    out.append(static_cast<const char*>(p), n);
  }
  void uint(std::uint64_t v) {
    if (v < 128) {
      out += static_cast<char>(v);
    } else if (v <= 0xff) {
      out += '\xcc';
      be(v, 1);
    } else if (v <= 0xffff) {
      out += '\xcd';
      be(v, 2);
    } else if (v <= 0xffffffffu) {
      out += '\xce';
      be(v, 4);
    } else {
      out += '\xcf';
      be(v, 8);
    }
  }
  void sint(std::int64_t v) {
    if (v >= 0) return uint(static_cast<std::uint64_t>(v));
    if (v >= -32) {
      out += static_cast<char>(v);
    } else if (v >= INT8_MIN) {
      out += '\xd0';
      be(static_cast<std::uint8_t>(v), 1);
    } else if (v >= INT16_MIN) {
      out += '\xd1';
      be(static_cast<std::uint16_t>(v), 2);
    } else if (v >= INT32_MIN) {
      out += '\xd2';
      be(static_cast<std::uint32_t>(v), 4);
    } else {
      out += '\xd3';
      be(static_cast<std::uint64_t>(v), 8);
    }
  }
  void f64(double v) {
    out += '\xcb';
    be(std::bit_cast<std::uint64_t>(v), 8);
  }
  void hash(const BlockHash& h) {
    unsigned char b[16];
    for (int i = 0; i < 8; ++i) {
      b[i] = static_cast<unsigned char>(h.hi >> (56 - 8 * i));
      b[8 + i] = static_cast<unsigned char>(h.lo >> (56 - 8 * i));
    }
    bin(b, 16);
  }
  void medium(const std::optional<Medium>& m) {
    if (m)
      str(medium_name(*m));
    else
      nil();
  }
};

// ---- decoder ------------------------------------------------------------------
struct Value {
  enum Kind { kNil, kInt, kFloat, kStr, kBin, kArray } kind = kNil;
  std::int64_t i = 0;
  double f = 0;
  std::string s;  // str or bin
  std::vector<Value> items;
};

class Reader {
 public:
  explicit Reader(std::string_view b) : b_(b) {}
  Result<Value> value(int depth = 0) {
    if (depth > 8) return err("nesting deeper than the schema");
    KVTIER_ASSIGN_OR_RETURN(std::uint64_t t, be(1));
    Value v;
    if (t < 0x80) return num(static_cast<std::int64_t>(t));
    if (t >= 0xe0) return num(static_cast<std::int8_t>(t));
    if ((t & 0xf0) == 0x90) return arr(t & 0x0f, depth);
    if ((t & 0xe0) == 0xa0) return bytes(t & 0x1f, Value::kStr);
    switch (t) {
      case 0xc0: return v;
      case 0xc4: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(1));
        return bytes(n, Value::kBin);
      }
      case 0xc5: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(2));
        return bytes(n, Value::kBin);
      }
      case 0xd9: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(1));
        return bytes(n, Value::kStr);
      }
      case 0xda: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(2));
        return bytes(n, Value::kStr);
      }
      case 0xdc: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(2));
        return arr(n, depth);
      }
      case 0xdd: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(4));
        return arr(n, depth);
      }
      case 0xcc: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(1));
        return num(static_cast<std::int64_t>(n));
      }
      case 0xcd: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(2));
        return num(static_cast<std::int64_t>(n));
      }
      case 0xce: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(4));
        return num(static_cast<std::int64_t>(n));
      }
      case 0xcf: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(8));
        // Every integer field of the schema fits 63 bits: a larger one is refused, not wrapped negative.
        if (n > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
          return err(fmt::format("unsigned integer {} is above 2**63 - 1", n));
        return num(static_cast<std::int64_t>(n));
      }
      case 0xd0: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(1));
        return num(static_cast<std::int8_t>(n));
      }
      case 0xd1: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(2));
        return num(static_cast<std::int16_t>(n));
      }
      case 0xd2: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(4));
        return num(static_cast<std::int32_t>(n));
      }
      case 0xd3: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(8));
        return num(static_cast<std::int64_t>(n));
      }
      case 0xca: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(4));
        v.kind = Value::kFloat;
        v.f = std::bit_cast<float>(static_cast<std::uint32_t>(n));
        return v;
      }
      case 0xcb: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(8));
        v.kind = Value::kFloat;
        v.f = std::bit_cast<double>(n);
        return v;
      }
    }
    return err(fmt::format("msgpack type byte 0x{:02x} is not used by the schema", t));
  }
  bool done() const { return pos_ == b_.size(); }
  std::size_t pos() const { return pos_; }
  Status err(std::string what) const { return DataLoss(fmt::format("kv event batch at byte {}: {}", pos_, what)); }

 private:
  Result<std::uint64_t> be(int n) {
    if (b_.size() - pos_ < static_cast<std::size_t>(n)) return err("truncated");
    std::uint64_t v = 0;
    for (int i = 0; i < n; ++i) v = (v << 8) | static_cast<unsigned char>(b_[pos_++]);
    return v;
  }
  Result<Value> num(std::int64_t i) {
    Value v;
    v.kind = Value::kInt;
    v.i = i;
    return v;
  }
  Result<Value> bytes(std::uint64_t n, Value::Kind k) {
    if (b_.size() - pos_ < n) return err("truncated string");
    Value v;
    v.kind = k;
    v.s.assign(b_.data() + pos_, n);
    pos_ += n;
    return v;
  }
  Result<Value> arr(std::uint64_t n, int depth) {
    if (n > b_.size() - pos_) return err(fmt::format("array of {} items is longer than the rest", n));
    Value v;
    v.kind = Value::kArray;
    v.items.reserve(n);
    for (std::uint64_t i = 0; i < n; ++i) {
      KVTIER_ASSIGN_OR_RETURN(Value x, value(depth + 1));
      v.items.push_back(std::move(x));
    }
    return v;
  }
  std::string_view b_;
  std::size_t pos_ = 0;
};

Status bad(std::string what) { return DataLoss(fmt::format("kv event batch: {}", what)); }

Result<BlockHash> to_hash(const Value& v) {
  if (v.kind == Value::kBin && v.s.size() == 16) {
    BlockHash h;
    for (int i = 0; i < 8; ++i) {
      h.hi = (h.hi << 8) | static_cast<unsigned char>(v.s[i]);
      h.lo = (h.lo << 8) | static_cast<unsigned char>(v.s[8 + i]);
    }
    return h;
  }
  if (v.kind == Value::kInt) return BlockHash{0, static_cast<std::uint64_t>(v.i)};  // vLLM's int hashes
  return bad("a block hash is neither 16 bytes nor an integer");
}

Result<std::vector<BlockHash>> to_hashes(const Value& v) {
  if (v.kind != Value::kArray) return bad("block_hashes is not an array");
  std::vector<BlockHash> out;
  for (const Value& x : v.items) {
    KVTIER_ASSIGN_OR_RETURN(BlockHash h, to_hash(x));
    out.push_back(h);
  }
  return out;
}

Result<std::optional<Medium>> to_medium(const Value& v) {
  if (v.kind == Value::kNil) return std::optional<Medium>{};
  if (v.kind != Value::kStr) return bad("medium is not a string");
  auto m = parse_medium(v.s);
  if (!m.ok()) return bad(fmt::format("medium '{}' is none of GPU, CPU, DISK, REMOTE", v.s));
  return std::optional<Medium>{*m};
}

Result<KvEvent> to_event(const Value& v) {
  if (v.kind != Value::kArray || v.items.empty() || v.items[0].kind != Value::kStr)
    return bad("an event is not a tagged array");
  const std::string& tag = v.items[0].s;
  const auto& it = v.items;
  if (tag == "BlockStored") {
    if (it.size() < 6) return bad(fmt::format("BlockStored has {} fields, wants at least 6", it.size()));
    BlockStored e;
    KVTIER_ASSIGN_OR_RETURN(e.block_hashes, to_hashes(it[1]));
    if (it[2].kind != Value::kNil) {
      KVTIER_ASSIGN_OR_RETURN(BlockHash p, to_hash(it[2]));
      e.parent_block_hash = p;
    }
    if (it[3].kind != Value::kArray) return bad("token_ids is not an array");
    for (const Value& t : it[3].items) {
      if (t.kind != Value::kInt) return bad("a token id is not an integer");
      e.token_ids.push_back(t.i);
    }
    if (it[4].kind != Value::kInt || it[4].i < 0 || it[4].i > std::numeric_limits<std::uint32_t>::max())
      return bad("block_size is not an integer in [0, 2**32 - 1]");
    e.block_size = static_cast<std::uint32_t>(it[4].i);
    if (it[5].kind == Value::kInt)
      e.lora_id = it[5].i;
    else if (it[5].kind != Value::kNil)
      return bad("lora_id is not an integer or nil");
    if (it.size() > 6) {
      KVTIER_ASSIGN_OR_RETURN(e.medium, to_medium(it[6]));
    }
    return KvEvent{std::move(e)};
  }
  if (tag == "BlockRemoved") {
    if (it.size() < 2) return bad("BlockRemoved without block_hashes");
    BlockRemoved e;
    KVTIER_ASSIGN_OR_RETURN(e.block_hashes, to_hashes(it[1]));
    if (it.size() > 2) {
      KVTIER_ASSIGN_OR_RETURN(e.medium, to_medium(it[2]));
    }
    return KvEvent{std::move(e)};
  }
  if (tag == "AllBlocksCleared") return KvEvent{AllBlocksCleared{}};
  return bad(fmt::format("unknown event tag '{}'", tag));
}

}  // namespace

std::string encode_msgpack(const EventBatch& batch) {
  Writer w;
  w.array(batch.data_parallel_rank ? 3 : 2);  // omit_defaults: a None rank is left out
  w.f64(batch.ts);
  w.array(batch.events.size());
  for (const KvEvent& ev : batch.events) {
    if (const auto* s = std::get_if<BlockStored>(&ev)) {
      w.array(7);
      w.str("BlockStored");
      w.array(s->block_hashes.size());
      for (const BlockHash& h : s->block_hashes) w.hash(h);
      if (s->parent_block_hash)
        w.hash(*s->parent_block_hash);
      else
        w.nil();
      w.array(s->token_ids.size());
      for (std::int64_t t : s->token_ids) w.sint(t);
      w.uint(s->block_size);
      if (s->lora_id)
        w.sint(*s->lora_id);
      else
        w.nil();
      w.medium(s->medium);
    } else if (const auto* r = std::get_if<BlockRemoved>(&ev)) {
      w.array(3);
      w.str("BlockRemoved");
      w.array(r->block_hashes.size());
      for (const BlockHash& h : r->block_hashes) w.hash(h);
      w.medium(r->medium);
    } else {
      w.array(1);
      w.str("AllBlocksCleared");
    }
  }
  if (batch.data_parallel_rank) w.sint(*batch.data_parallel_rank);
  return std::move(w.out);
}

Result<EventBatch> decode_msgpack(std::string_view bytes) {
  Reader r(bytes);
  KVTIER_ASSIGN_OR_RETURN(Value v, r.value());
  if (!r.done()) return r.err("trailing bytes after the batch");
  if (v.kind != Value::kArray || v.items.size() < 2 || v.items.size() > 3)
    return bad("a batch is not an array [ts, events, rank?]");
  EventBatch b;
  if (v.items[0].kind == Value::kFloat)
    b.ts = v.items[0].f;
  else if (v.items[0].kind == Value::kInt)
    b.ts = static_cast<double>(v.items[0].i);
  else
    return bad("ts is not a number");
  if (v.items[1].kind != Value::kArray) return bad("events is not an array");
  for (const Value& e : v.items[1].items) {
    KVTIER_ASSIGN_OR_RETURN(KvEvent ev, to_event(e));
    b.events.push_back(std::move(ev));
  }
  if (v.items.size() == 3) {
    if (v.items[2].kind == Value::kInt)
      b.data_parallel_rank = v.items[2].i;
    else if (v.items[2].kind != Value::kNil)
      return bad("data_parallel_rank is not an integer");
  }
  return b;
}

}  // namespace kvtier::metrics
