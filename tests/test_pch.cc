// The translation unit that builds tests/test_pch.h's precompiled header; the
// executable it makes (GoogleTest's main, no tests) is not run.
