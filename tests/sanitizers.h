// Which sanitizer a test binary is built with, for the few tests that size their work by it.
// GCC defines __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__; clang (CI's asan and tsan presets use clang-14)
// defines neither and answers __has_feature instead, so a test that checks only the GCC macros runs its
// full-size work under clang's sanitizers.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define KVTIER_TEST_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#define KVTIER_TEST_TSAN 1
#endif
#if defined(__has_feature)
#if __has_feature(address_sanitizer) && !defined(KVTIER_TEST_ASAN)
#define KVTIER_TEST_ASAN 1
#endif
#if __has_feature(thread_sanitizer) && !defined(KVTIER_TEST_TSAN)
#define KVTIER_TEST_TSAN 1
#endif
#endif
