// The version of kvtier these headers belong to. CMakeLists.txt's project(kvtier VERSION ...) says the same
// (cmake/kvtier_install.cmake refuses to configure when they differ).
#pragma once

#define KVTIER_VERSION_MAJOR 0
#define KVTIER_VERSION_MINOR 1
#define KVTIER_VERSION_PATCH 0
#define KVTIER_VERSION_STRING "0.1.0"
