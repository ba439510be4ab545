// vLLM's KV event schema as msgpack: a minimal encoder for the types the schema uses (arrays, maps, strings,
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
    {Medium::kGpu, "GPU"},       {Medium::kCpu, "CPU"},      {Medium::kDisk, "DISK"},
    {Medium::kRemote, "REMOTE"}, {Medium::kDisk, "STORAGE"},  // vLLM's name of storage (its locality says local or
                                                              // remote)
};
constexpr auto kMediumNames = enum_table("medium", kMediumEntries, "GPU");
std::string_view medium_name(Medium m) noexcept { return kMediumNames.name(m); }

Result<Medium> parse_medium(std::string_view name) { return kMediumNames.parse(name); }

constexpr EnumName<EventEncoding> kEncodingEntries[] = {
    {EventEncoding::kMap, "map"},
    {EventEncoding::kArray, "array"},
};
constexpr auto kEncodingNames = enum_table("kv event encoding", kEncodingEntries, "map");
std::string_view event_encoding_name(EventEncoding e) noexcept { return kEncodingNames.name(e); }
Result<EventEncoding> parse_event_encoding(std::string_view name) { return kEncodingNames.parse(name); }

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
  void map(std::size_t n, bool wide = false) {  // the schema's maps are small
    if (n < 16 && !wide) {
      out += static_cast<char>(0x80 | n);
    } else {
      out += '\xde';
      be(n, 2);
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
  // vLLM's medium of the map encoding, and its locality (storage only).
  static std::string_view vllm_medium(Medium m) {
    return m == Medium::kGpu ? "GPU" : m == Medium::kCpu ? "CPU" : "STORAGE";
  }
  static bool has_locality(const std::optional<Medium>& m) {
    return m && (*m == Medium::kDisk || *m == Medium::kRemote);
  }
  void vllm_medium_field(const std::optional<Medium>& m) {
    str("medium");
    if (m)
      str(vllm_medium(*m));
    else
      nil();
  }
  void locality_field(const std::optional<Medium>& m) {  // after the fields without defaults, as msgspec orders
    if (!has_locality(m)) return;
    str("locality");
    str(*m == Medium::kRemote ? "REMOTE" : "LOCAL");
  }
};

// ---- decoder ------------------------------------------------------------------
struct Value {
  // kUint: an unsigned integer above 2**63 - 1 (in u); smaller integers are kInt.
  enum Kind { kNil, kBool, kInt, kUint, kFloat, kStr, kBin, kArray, kMap } kind = kNil;
  std::int64_t i = 0;  // int, or bool as 0 / 1
  std::uint64_t u = 0;
  double f = 0;
  std::string s;                  // str or bin
  std::vector<Value> items;       // array; a map's values
  std::vector<std::string> keys;  // a map's keys (strings), one per value in items
  const Value* field(std::string_view name) const;
};

const Value* Value::field(std::string_view name) const {
  for (std::size_t i = 0; i < keys.size(); ++i)
    if (keys[i] == name) return &items[i];
  return nullptr;
}

class Reader {
 public:
  explicit Reader(std::string_view b) : b_(b) {}
  Result<Value> value(int depth = 0) {
    if (depth > 8) return err("nesting deeper than the schema");
    KVTIER_ASSIGN_OR_RETURN(std::uint64_t t, be(1));
    Value v;
    if (t < 0x80) return num(static_cast<std::int64_t>(t));
    if (t >= 0xe0) return num(static_cast<std::int8_t>(t));
    if ((t & 0xf0) == 0x80) return map(t & 0x0f, depth);
    if ((t & 0xf0) == 0x90) return arr(t & 0x0f, depth);
    if ((t & 0xe0) == 0xa0) return bytes(t & 0x1f, Value::kStr);
    switch (t) {
      case 0xc0: return v;
      case 0xc2:
      case 0xc3:
        v.kind = Value::kBool;
        v.i = t == 0xc3;
        return v;
      case 0xde: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(2));
        return map(n, depth);
      }
      case 0xdf: {
        KVTIER_ASSIGN_OR_RETURN(std::uint64_t n, be(4));
        return map(n, depth);
      }
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
        // vLLM's integer block hashes use all 64 bits; the fields that are int64 refuse a larger value themselves.
        if (n > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
          v.kind = Value::kUint;
          v.u = n;
          return v;
        }
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
    v.kind = Value::kArray;  // grown item by item: a header's count is not trusted for an allocation
    for (std::uint64_t i = 0; i < n; ++i) {
      KVTIER_ASSIGN_OR_RETURN(Value x, value(depth + 1));
      v.items.push_back(std::move(x));
    }
    return v;
  }
  Result<Value> map(std::uint64_t n, int depth) {
    if (n > (b_.size() - pos_) / 2) return err(fmt::format("map of {} entries is longer than the rest", n));
    Value v;
    v.kind = Value::kMap;
    for (std::uint64_t i = 0; i < n; ++i) {
      KVTIER_ASSIGN_OR_RETURN(Value key, value(depth + 1));
      if (key.kind != Value::kStr) return err("a map key is not a string");
      KVTIER_ASSIGN_OR_RETURN(Value x, value(depth + 1));
      v.keys.push_back(std::move(key.s));
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
  // vLLM's int hashes (64 bits: the default of VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), negative ones as msgpack wrote
  // them (two's complement).
  if (v.kind == Value::kInt) return BlockHash{0, static_cast<std::uint64_t>(v.i)};
  if (v.kind == Value::kUint) return BlockHash{0, v.u};
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

// `locality` (map events only): vLLM's LOCAL or REMOTE for its STORAGE medium. Absent, nil or another string (the
// schema's type is any string; None means unspecified): local storage, kDisk, rather than a batch refused whole.
Result<std::optional<Medium>> to_medium(const Value& v, const Value* locality) {
  if (v.kind == Value::kNil) return std::optional<Medium>{};
  if (v.kind != Value::kStr) return bad("medium is not a string");
  auto m = parse_medium(v.s);
  if (!m.ok()) return bad(fmt::format("medium '{}' is none of {}", shown_value(v.s), kMediumNames.accepted()));
  if (v.s == "STORAGE" && locality != nullptr && locality->kind == Value::kStr && locality->s == "REMOTE")
    return std::optional<Medium>{Medium::kRemote};
  return std::optional<Medium>{*m};
}

// An event's fields, found by position (array form) or by name (map form); null where absent.
struct EventFields {
  std::string_view tag;
  const Value* block_hashes = nullptr;
  const Value* parent_block_hash = nullptr;
  const Value* token_ids = nullptr;
  const Value* block_size = nullptr;
  const Value* lora_id = nullptr;
  const Value* medium = nullptr;
  const Value* locality = nullptr;
};

Result<EventFields> fields_of(const Value& v) {
  EventFields f;
  auto at = [&](std::size_t i) { return i < v.items.size() ? &v.items[i] : nullptr; };
  if (v.kind == Value::kMap) {
    const Value* type = v.field("type");
    if (type == nullptr || type->kind != Value::kStr) return bad("an event map has no string \"type\"");
    f.tag = type->s;
    f.block_hashes = v.field("block_hashes");
    f.parent_block_hash = v.field("parent_block_hash");
    f.token_ids = v.field("token_ids");
    f.block_size = v.field("block_size");
    f.lora_id = v.field("lora_id");
    f.medium = v.field("medium");
    f.locality = v.field("locality");
    return f;
  }
  if (v.kind != Value::kArray || v.items.empty() || v.items[0].kind != Value::kStr)
    return bad("an event is neither a tagged map nor a tagged array");
  f.tag = v.items[0].s;
  f.block_hashes = at(1);
  if (f.tag == "BlockStored") {
    f.parent_block_hash = at(2);
    f.token_ids = at(3);
    f.block_size = at(4);
    f.lora_id = at(5);
    f.medium = at(6);
  } else if (f.tag == "BlockRemoved") {
    f.medium = at(2);
  }
  return f;
}

// Both forms ask for the same fields: BlockStored's hashes, parent, token ids, block size and lora id (its medium
// may be left out, as the array form of the earliest releases did), BlockRemoved's hashes.
Result<KvEvent> to_event(const Value& v) {
  KVTIER_ASSIGN_OR_RETURN(EventFields f, fields_of(v));
  static const Value kNilValue;
  const Value& medium = f.medium != nullptr ? *f.medium : kNilValue;
  if (f.tag == "BlockStored") {
    if (f.block_hashes == nullptr || f.parent_block_hash == nullptr || f.token_ids == nullptr ||
        f.block_size == nullptr || f.lora_id == nullptr)
      return bad("BlockStored without one of block_hashes, parent_block_hash, token_ids, block_size, lora_id");
    BlockStored e;
    KVTIER_ASSIGN_OR_RETURN(e.block_hashes, to_hashes(*f.block_hashes));
    if (f.parent_block_hash->kind != Value::kNil) {
      KVTIER_ASSIGN_OR_RETURN(BlockHash p, to_hash(*f.parent_block_hash));
      e.parent_block_hash = p;
    }
    if (f.token_ids->kind != Value::kArray) return bad("token_ids is not an array");
    for (const Value& t : f.token_ids->items) {
      if (t.kind != Value::kInt) return bad("a token id is not an integer in [-2**63, 2**63 - 1]");
      e.token_ids.push_back(t.i);
    }
    if (f.block_size->kind != Value::kInt || f.block_size->i < 0 ||
        f.block_size->i > std::numeric_limits<std::uint32_t>::max())
      return bad("block_size is not an integer in [0, 2**32 - 1]");
    e.block_size = static_cast<std::uint32_t>(f.block_size->i);
    if (f.lora_id->kind == Value::kInt)
      e.lora_id = f.lora_id->i;
    else if (f.lora_id->kind != Value::kNil)
      return bad("lora_id is not an integer in [-2**63, 2**63 - 1] or nil");
    KVTIER_ASSIGN_OR_RETURN(e.medium, to_medium(medium, f.locality));
    return KvEvent{std::move(e)};
  }
  if (f.tag == "BlockRemoved") {
    if (f.block_hashes == nullptr) return bad("BlockRemoved without block_hashes");
    BlockRemoved e;
    KVTIER_ASSIGN_OR_RETURN(e.block_hashes, to_hashes(*f.block_hashes));
    KVTIER_ASSIGN_OR_RETURN(e.medium, to_medium(medium, f.locality));
    return KvEvent{std::move(e)};
  }
  if (f.tag == "AllBlocksCleared") return KvEvent{AllBlocksCleared{}};
  return bad(fmt::format("unknown event tag '{}'", shown_value(f.tag)));
}

}  // namespace

std::string encode_msgpack(const EventBatch& batch, EventEncoding encoding) {
  const bool as_map = encoding == EventEncoding::kMap;
  Writer w;
  // msgspec writes every field of the array_like batch, a None rank as nil (omit_defaults does not apply to
  // arrays), in both forms.
  w.array(3);
  w.f64(batch.ts);
  w.array(batch.events.size());
  for (const KvEvent& ev : batch.events) {
    if (const auto* s = std::get_if<BlockStored>(&ev)) {
      if (as_map) {
        // msgspec writes the tag first, then the fields in their order; defaults left out (omit_defaults),
        // fields without a default (lora_id, medium, lora_name) always written. Its header is sized for every
        // field the struct has (16 with the tag in vLLM 0.34): a map16 header whatever the count.
        w.map(8 + (Writer::has_locality(s->medium) ? 1 : 0), /*wide=*/true);
        w.str("type");
      } else {
        w.array(7);
      }
      w.str("BlockStored");
      if (as_map) w.str("block_hashes");
      w.array(s->block_hashes.size());
      for (const BlockHash& h : s->block_hashes) w.hash(h);
      if (as_map) w.str("parent_block_hash");
      if (s->parent_block_hash)
        w.hash(*s->parent_block_hash);
      else
        w.nil();
      if (as_map) w.str("token_ids");
      w.array(s->token_ids.size());
      for (std::int64_t t : s->token_ids) w.sint(t);
      if (as_map) w.str("block_size");
      w.uint(s->block_size);
      if (as_map) w.str("lora_id");
      if (s->lora_id)
        w.sint(*s->lora_id);
      else
        w.nil();
      if (as_map) {
        w.vllm_medium_field(s->medium);
        w.str("lora_name");
        w.nil();
        w.locality_field(s->medium);
      } else {
        w.medium(s->medium);
      }
    } else if (const auto* r = std::get_if<BlockRemoved>(&ev)) {
      if (as_map) {
        w.map(3 + (Writer::has_locality(r->medium) ? 1 : 0));
        w.str("type");
        w.str("BlockRemoved");
        w.str("block_hashes");
      } else {
        w.array(3);
        w.str("BlockRemoved");
      }
      w.array(r->block_hashes.size());
      for (const BlockHash& h : r->block_hashes) w.hash(h);
      if (as_map) {
        w.vllm_medium_field(r->medium);
        w.locality_field(r->medium);
      } else {
        w.medium(r->medium);
      }
    } else if (as_map) {
      w.map(1);
      w.str("type");
      w.str("AllBlocksCleared");
    } else {
      w.array(1);
      w.str("AllBlocksCleared");
    }
  }
  if (batch.data_parallel_rank)
    w.sint(*batch.data_parallel_rank);
  else
    w.nil();
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
  else if (v.items[0].kind == Value::kUint)
    b.ts = static_cast<double>(v.items[0].u);
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
      return bad("data_parallel_rank is not an integer in [-2**63, 2**63 - 1]");
  }
  return b;
}

}  // namespace kvtier::metrics
