// Registry, series and the Prometheus text exposition (format 0.0.4).
#include "kvtier/metrics/registry.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <variant>

#include "kvtier/core/enum_names.h"

namespace kvtier::metrics {

namespace detail {
std::size_t this_thread_shard() noexcept {
  static std::atomic<std::size_t> next{0};
  thread_local const std::size_t shard = next.fetch_add(1, std::memory_order_relaxed) % kShards;
  return shard;
}
}  // namespace detail

std::uint64_t Counter::value() const noexcept {
  std::uint64_t v = 0;
  for (const Shard& s : shards_) v += s.v.load(std::memory_order_relaxed);
  return v;
}

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)) {
  for (Shard& s : shards_) {
    s.buckets = std::make_unique<std::atomic<std::uint64_t>[]>(bounds_.size() + 1);
    for (std::size_t i = 0; i <= bounds_.size(); ++i) s.buckets[i].store(0, std::memory_order_relaxed);
  }
}

void Histogram::observe(double v) noexcept {
  // First bound >= v (Prometheus buckets are "less than or equal"); NaN lands in +Inf.
  std::size_t i = static_cast<std::size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  if (std::isnan(v)) i = bounds_.size();
  Shard& s = shards_[detail::this_thread_shard()];
  s.buckets[i].fetch_add(1, std::memory_order_relaxed);
  s.sum.fetch_add(v, std::memory_order_relaxed);
  s.count.fetch_add(1, std::memory_order_relaxed);
}

std::vector<std::uint64_t> Histogram::bucket_counts() const {
  std::vector<std::uint64_t> out(bounds_.size() + 1, 0);
  for (const Shard& s : shards_)
    for (std::size_t i = 0; i < out.size(); ++i) out[i] += s.buckets[i].load(std::memory_order_relaxed);
  return out;
}

std::uint64_t Histogram::count() const noexcept {
  std::uint64_t c = 0;
  for (const Shard& s : shards_) c += s.count.load(std::memory_order_relaxed);
  return c;
}

double Histogram::sum() const noexcept {
  double v = 0;
  for (const Shard& s : shards_) v += s.sum.load(std::memory_order_relaxed);
  return v;
}

std::vector<double> latency_buckets_seconds() { return exponential_buckets(1e-6, 2.0, 25).value(); }

Result<std::vector<double>> exponential_buckets(double start, double factor, int count) {
  if (!(start > 0) || !std::isfinite(start))
    return InvalidArgument(fmt::format("exponential_buckets: start {} is not a positive finite number", start));
  if (!(factor > 1) || !std::isfinite(factor))
    return InvalidArgument(fmt::format("exponential_buckets: factor {} is not > 1", factor));
  if (count < 1 || count > 64)
    return InvalidArgument(fmt::format("exponential_buckets: count {} not in [1, 64]", count));
  std::vector<double> b;
  double v = start;
  for (int i = 0; i < count; ++i, v *= factor) b.push_back(v);
  return b;
}

constexpr EnumName<MetricType> kMetricTypeEntries[] = {
    {MetricType::kCounter, "counter"},
    {MetricType::kGauge, "gauge"},
    {MetricType::kHistogram, "histogram"},
};
constexpr auto kMetricTypeNames = enum_table("metric type", kMetricTypeEntries, "untyped");
std::string_view metric_type_name(MetricType t) noexcept { return kMetricTypeNames.name(t); }

// ---- text helpers ---------------------------------------------------------------

namespace {
bool name_char(char c, bool first, bool colon) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_') return true;
  if (colon && c == ':') return true;
  return !first && c >= '0' && c <= '9';
}
}  // namespace

bool valid_metric_name(std::string_view name) noexcept {
  if (name.empty()) return false;
  for (std::size_t i = 0; i < name.size(); ++i)
    if (!name_char(name[i], i == 0, true)) return false;
  return true;
}

bool valid_label_name(std::string_view name) noexcept {
  if (name.empty() || name.starts_with("__")) return false;  // names starting with __ are reserved
  for (std::size_t i = 0; i < name.size(); ++i)
    if (!name_char(name[i], i == 0, false)) return false;
  return true;
}

std::string escape_label_value(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

std::string escape_help(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  // Integral values print without exponent or fraction up to 2^53 (counters stay readable).
  if (v == std::floor(v) && std::fabs(v) < 9007199254740992.0) return fmt::format("{}", static_cast<std::int64_t>(v));
  return fmt::format("{}", v);
}

// ---- registry -------------------------------------------------------------------

struct Registry::Family {
  std::string name, help;
  MetricType type;
  std::vector<std::string> label_names;
  std::vector<double> bounds;
  // Keyed by the label values in label_names order.
  std::map<std::vector<std::string>,
           std::variant<std::unique_ptr<Counter>, std::unique_ptr<Gauge>, std::unique_ptr<Histogram>>>
      series;
};

Registry::Registry() = default;
Registry::~Registry() = default;

Result<Registry::Family*> Registry::family(std::string_view name, std::string_view help, MetricType type,
                                           const Labels& labels, std::span<const double> bounds) {
  if (!valid_metric_name(name))
    return InvalidArgument(fmt::format("metric name '{}' is not [a-zA-Z_:][a-zA-Z0-9_:]*", name));
  for (std::size_t i = 0; i < labels.size(); ++i) {
    if (!valid_label_name(labels[i].first))
      return InvalidArgument(fmt::format("metric {}: label name '{}' is not [a-zA-Z_][a-zA-Z0-9_]* (or starts with __)",
                                         name, labels[i].first));
    if (type == MetricType::kHistogram && labels[i].first == "le")
      return InvalidArgument(fmt::format("metric {}: label name 'le' is reserved for histogram buckets", name));
    for (std::size_t j = 0; j < i; ++j)
      if (labels[j].first == labels[i].first)
        return InvalidArgument(fmt::format("metric {}: label '{}' given twice", name, labels[i].first));
  }
  if (type == MetricType::kHistogram) {
    for (std::size_t i = 0; i < bounds.size(); ++i) {
      if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1])))
        return InvalidArgument(fmt::format(
            "histogram {}: bucket bound {} at index {} is not finite and above the previous one", name, bounds[i], i));
    }
  }
  auto it = families_.find(name);
  if (it == families_.end()) {
    auto f = std::make_unique<Family>();
    f->name = std::string(name);
    f->help = std::string(help);
    f->type = type;
    for (const auto& [k, v] : labels) f->label_names.push_back(k);
    f->bounds.assign(bounds.begin(), bounds.end());
    it = families_.emplace(f->name, std::move(f)).first;
  }
  Family* f = it->second.get();
  if (f->type != type)
    return InvalidArgument(
        fmt::format("metric {} is a {}, asked for as a {}", name, metric_type_name(f->type), metric_type_name(type)));
  if (f->help != help)
    return InvalidArgument(fmt::format("metric {}: help text differs from its first registration", name));
  bool same_names = f->label_names.size() == labels.size();
  for (std::size_t i = 0; same_names && i < labels.size(); ++i) same_names = f->label_names[i] == labels[i].first;
  if (!same_names) {
    std::string want;
    for (const auto& n : f->label_names) want += (want.empty() ? "" : ",") + n;
    return InvalidArgument(fmt::format("metric {}: labels must be named ({}) in that order", name, want));
  }
  if (type == MetricType::kHistogram && !std::equal(f->bounds.begin(), f->bounds.end(), bounds.begin(), bounds.end()))
    return InvalidArgument(fmt::format("histogram {}: bucket bounds differ from its first registration", name));
  return f;
}

namespace {
std::vector<std::string> values_of(const Labels& labels) {
  std::vector<std::string> v;
  v.reserve(labels.size());
  for (const auto& [k, val] : labels) v.push_back(val);
  return v;
}
}  // namespace

Result<Counter*> Registry::counter(std::string_view name, std::string_view help, const Labels& labels) {
  std::lock_guard lk(mu_);
  KVTIER_ASSIGN_OR_RETURN(Family * f, family(name, help, MetricType::kCounter, labels, {}));
  auto& slot = f->series[values_of(labels)];
  if (!std::holds_alternative<std::unique_ptr<Counter>>(slot) || !std::get<std::unique_ptr<Counter>>(slot))
    slot = std::make_unique<Counter>();
  return std::get<std::unique_ptr<Counter>>(slot).get();
}

Result<Gauge*> Registry::gauge(std::string_view name, std::string_view help, const Labels& labels) {
  std::lock_guard lk(mu_);
  KVTIER_ASSIGN_OR_RETURN(Family * f, family(name, help, MetricType::kGauge, labels, {}));
  auto& slot = f->series[values_of(labels)];
  if (!std::holds_alternative<std::unique_ptr<Gauge>>(slot)) slot = std::make_unique<Gauge>();
  return std::get<std::unique_ptr<Gauge>>(slot).get();
}

Result<Histogram*> Registry::histogram(std::string_view name, std::string_view help, std::span<const double> bounds,
                                       const Labels& labels) {
  std::lock_guard lk(mu_);
  KVTIER_ASSIGN_OR_RETURN(Family * f, family(name, help, MetricType::kHistogram, labels, bounds));
  auto& slot = f->series[values_of(labels)];
  if (!std::holds_alternative<std::unique_ptr<Histogram>>(slot))
    slot = std::make_unique<Histogram>(std::vector<double>(bounds.begin(), bounds.end()));
  return std::get<std::unique_ptr<Histogram>>(slot).get();
}

std::uint64_t Registry::add_collect_hook(std::function<void()> hook) {
  std::lock_guard lk(mu_);
  hooks_.emplace_back(next_hook_, std::move(hook));
  return next_hook_++;
}

void Registry::remove_collect_hook(std::uint64_t id) {
  std::lock_guard lk(mu_);
  std::erase_if(hooks_, [id](const auto& h) { return h.first == id; });
}

void Registry::run_hooks() const {
  for (const auto& [id, h] : hooks_)
    if (h) h();
}

std::vector<FamilySnapshot> Registry::snapshot() const {
  std::lock_guard lk(mu_);
  run_hooks();
  std::vector<FamilySnapshot> out;
  out.reserve(families_.size());
  for (const auto& [name, f] : families_) {
    FamilySnapshot fs;
    fs.name = f->name;
    fs.help = f->help;
    fs.type = f->type;
    fs.bounds = f->bounds;
    for (const auto& [values, metric] : f->series) {
      FamilySnapshot::Series s;
      for (std::size_t i = 0; i < values.size(); ++i) s.labels.emplace_back(f->label_names[i], values[i]);
      if (auto* c = std::get_if<std::unique_ptr<Counter>>(&metric)) {
        s.value = static_cast<double>((*c)->value());
      } else if (auto* g = std::get_if<std::unique_ptr<Gauge>>(&metric)) {
        s.value = (*g)->value();
      } else {
        const Histogram& h = *std::get<std::unique_ptr<Histogram>>(metric);
        std::vector<std::uint64_t> counts = h.bucket_counts();
        std::uint64_t cum = 0;
        for (std::uint64_t c : counts) s.buckets.push_back(cum += c);
        // Count from the buckets so that the +Inf bucket equals _count in every scrape.
        s.count = cum;
        s.sum = h.sum();
      }
      fs.series.push_back(std::move(s));
    }
    out.push_back(std::move(fs));
  }
  return out;
}

namespace {
std::string label_text(const Labels& labels, std::string_view extra_name = {}, std::string_view extra_value = {}) {
  if (labels.empty() && extra_name.empty()) return {};
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : labels) {
    out += fmt::format("{}{}=\"{}\"", first ? "" : ",", k, escape_label_value(v));
    first = false;
  }
  if (!extra_name.empty()) out += fmt::format("{}{}=\"{}\"", first ? "" : ",", extra_name, extra_value);
  return out + "}";
}
}  // namespace

std::string Registry::expose() const {
  std::string out;
  for (const FamilySnapshot& f : snapshot()) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", f.name, escape_help(f.help), f.name, metric_type_name(f.type));
    for (const auto& s : f.series) {
      if (f.type != MetricType::kHistogram) {
        out += fmt::format("{}{} {}\n", f.name, label_text(s.labels), format_value(s.value));
        continue;
      }
      for (std::size_t i = 0; i < s.buckets.size(); ++i) {
        std::string le = i < f.bounds.size() ? format_value(f.bounds[i]) : "+Inf";
        out += fmt::format("{}_bucket{} {}\n", f.name, label_text(s.labels, "le", le), s.buckets[i]);
      }
      out += fmt::format("{}_sum{} {}\n", f.name, label_text(s.labels), format_value(s.sum));
      out += fmt::format("{}_count{} {}\n", f.name, label_text(s.labels), s.count);
    }
  }
  return out;
}

Registry& default_registry() {
  static Registry* r = new Registry();  // never destroyed: threads may still update series at exit
  return *r;
}

}  // namespace kvtier::metrics
