# `cmake --install <build> --prefix <dir>` puts the C++ library where another CMake project finds it:
#   find_package(kvtier 0.1 CONFIG REQUIRED)
#   target_link_libraries(app PRIVATE kvtier::kvtier)
# The static libraries of kvtier's subsystems, the public headers (include/kvtier; kvtier/version.h names the
# version), and a package configuration that finds the third-party libraries they link the way this build found
# them (pkg-config modules, fmt's package, the CUDA toolkit where the build had CUDA). The libraries carry their compile definitions
# (KVTIER_STATUS_CHECKED where the build set it), so a program always matches the library it links.
include(CMakePackageConfigHelpers)

file(STRINGS ${PROJECT_SOURCE_DIR}/include/kvtier/version.h _kvtier_version_line
     REGEX "^#define KVTIER_VERSION_STRING ")
if(NOT _kvtier_version_line STREQUAL "#define KVTIER_VERSION_STRING \"${PROJECT_VERSION}\"")
  message(FATAL_ERROR "include/kvtier/version.h says '${_kvtier_version_line}', project() says ${PROJECT_VERSION}: "
                      "change both")
endif()

get_property(_kvtier_installed GLOBAL PROPERTY KVTIER_INSTALLED_LIBRARIES)
set(_kvtier_exported kvtier kvtier_fmt ${_kvtier_installed})
if(KVTIER_STATIC_DEPS)
  # The archives' own interface targets (absolute paths of this machine's archives).
  foreach(dep uring hiredis xxhash sodium numa ucx)
    list(APPEND _kvtier_exported kvtier_dep_${dep})
  endforeach()
endif()
install(TARGETS ${_kvtier_exported} EXPORT kvtierTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# kvtier/testing/ belongs to the test doubles (kvtier_testing), which are not installed.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/kvtier DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        PATTERN testing EXCLUDE)
install(EXPORT kvtierTargets NAMESPACE kvtier:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvtier)

set(KVTIER_CONFIG_CUDA ${KVTIER_CUDA})
set(KVTIER_CONFIG_STATIC_DEPS ${KVTIER_STATIC_DEPS})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/kvtierConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/kvtierConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvtier)
# 0.x: a minor version may change the API (Semantic Versioning), so only the same minor version is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/kvtierConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/kvtierConfig.cmake ${PROJECT_BINARY_DIR}/kvtierConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvtier)
