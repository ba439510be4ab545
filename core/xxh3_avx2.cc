// XXH3-64 built for AVX2 (core/xxh3_variants.h); compiled with -mavx2.
#define XXH_NAMESPACE kvtier_avx2_
#define KVTIER_XXH3_VARIANT kXxh3Avx2
#define KVTIER_XXH3_VARIANT_NAME "avx2"
#include "core/xxh3_variant.inc"
