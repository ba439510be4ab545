#include "core/xxh3.h"

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include <initializer_list>
#include <new>

#include "core/xxh3_variants.h"

namespace kvtier::detail {
namespace {

static_assert(sizeof(XXH3_state_t) <= 640 && alignof(XXH3_state_t) <= 64, "Xxh3::state_ holds an XXH3_state_t");

void library_reset(XXH3_state_s* state) noexcept { (void)XXH3_64bits_reset(state); }
void library_update(XXH3_state_s* state, const void* data, std::size_t bytes) noexcept {
  (void)XXH3_64bits_update(state, data, bytes);
}
std::uint64_t library_digest(const XXH3_state_s* state) noexcept { return XXH3_64bits_digest(state); }
std::uint64_t library_oneshot(const void* data, std::size_t bytes) noexcept { return XXH3_64bits(data, bytes); }

const Xxh3Functions kLibrary = {"library", library_reset, library_update, library_digest, library_oneshot};

// The build of a path, or null where this CPU (or this build) lacks its instruction set.
const Xxh3Functions* build_of(Xxh3::Path path) noexcept {
  switch (path) {
    case Xxh3::Path::kPortable: return &kLibrary;
#if defined(KVTIER_XXH3_VARIANTS)
    case Xxh3::Path::kAvx2: return __builtin_cpu_supports("avx2") ? &kXxh3Avx2 : nullptr;
    case Xxh3::Path::kAvx512: return __builtin_cpu_supports("avx512f") ? &kXxh3Avx512 : nullptr;
#endif
    default: return nullptr;
  }
}

const Xxh3Functions& best() noexcept {
  static const Xxh3Functions* const chosen = [] {
    for (Xxh3::Path path : {Xxh3::Path::kAvx512, Xxh3::Path::kAvx2})
      if (const Xxh3Functions* f = build_of(path)) return f;
    return &kLibrary;
  }();
  return *chosen;
}

}  // namespace

bool xxh3_has_path(Xxh3::Path path) noexcept { return path == Xxh3::Path::kBest || build_of(path) != nullptr; }

const char* xxh3_best_path_name() noexcept { return best().name; }

Xxh3::Xxh3(Path path) noexcept {
  const Xxh3Functions* f = path == Path::kBest ? &best() : build_of(path);
  functions_ = f != nullptr ? f : &kLibrary;
  new (state_) XXH3_state_t;
  reset();
}

void Xxh3::reset() noexcept { functions_->reset(reinterpret_cast<XXH3_state_t*>(state_)); }

void Xxh3::update(const void* data, std::size_t bytes) noexcept {
  functions_->update(reinterpret_cast<XXH3_state_t*>(state_), data, bytes);
}

std::uint64_t Xxh3::digest() const noexcept {
  return functions_->digest(reinterpret_cast<const XXH3_state_t*>(state_));
}

std::uint64_t xxh3_64(const void* data, std::size_t bytes) noexcept { return best().oneshot(data, bytes); }

}  // namespace kvtier::detail
