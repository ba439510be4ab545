// The translation unit that builds tests/test_pch.h's precompiled header.
