// XXH3-64 built for AVX-512 (core/xxh3_variants.h); compiled with -mavx512f.
#define XXH_NAMESPACE kvtier_avx512_
#define KVTIER_XXH3_VARIANT kXxh3Avx512
#define KVTIER_XXH3_VARIANT_NAME "avx512"
#include "core/xxh3_variant.inc"
