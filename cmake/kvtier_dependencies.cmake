# Third-party libraries, found the way C++ projects find them: pkg-config modules (liburing, hiredis,
# libxxhash, libsodium, ucx, numa) and fmt's CMake package. Each becomes one target, kvtier::dep::<name>,
# that the subsystems link; no library path is written down here.
#
# KVTIER_STATIC_DEPS=ON links the static archives (lib<name>.a, looked up in the directories pkg-config
# reports, then the compiler's) so that binaries run on machines without these packages (the GPU machine's
# image). A shared object cannot take archives that were not built position-independent (Debian's
# libsodium.a and libnuma.a are not), so the Python extension is built with shared libraries and the wheel
# carries them (scripts/build-wheel.sh: auditwheel repair).

option(KVTIER_STATIC_DEPS "Link liburing, hiredis, xxhash, libsodium, UCX, libnuma and fmt statically" OFF)

find_package(PkgConfig REQUIRED)

# kvtier_pkg_dependency(<name> <pkg-config module>)
# Defines kvtier::dep::<name>: the module's include directories and compile flags, and its libraries,
# shared or (KVTIER_STATIC_DEPS) static.
function(kvtier_pkg_dependency name module)
  set(prefix KVTIER_PKG_${name})
  pkg_check_modules(${prefix} REQUIRED IMPORTED_TARGET GLOBAL ${module})
  if(NOT KVTIER_STATIC_DEPS)
    add_library(kvtier::dep::${name} ALIAS PkgConfig::${prefix})
    return()
  endif()
  add_library(kvtier_dep_${name} INTERFACE)
  target_include_directories(kvtier_dep_${name} SYSTEM INTERFACE ${${prefix}_INCLUDE_DIRS})
  target_compile_options(kvtier_dep_${name} INTERFACE ${${prefix}_CFLAGS_OTHER})
  set(archives "")
  foreach(lib IN LISTS ${prefix}_LIBRARIES)
    # ${prefix}_LIBRARIES holds names (uring, ucp, ...) as pkg-config's -l flags give them.
    string(MAKE_C_IDENTIFIER "KVTIER_ARCHIVE_${lib}" var)
    find_library(${var} NAMES lib${lib}.a HINTS ${${prefix}_LIBRARY_DIRS})
    if(NOT ${var})
      message(FATAL_ERROR "KVTIER_STATIC_DEPS: no static archive lib${lib}.a for pkg-config module '${module}' "
                          "(searched ${${prefix}_LIBRARY_DIRS} and the default paths); install its -dev package "
                          "or configure with -DKVTIER_STATIC_DEPS=OFF")
    endif()
    list(APPEND archives ${${var}})
  endforeach()
  set_property(TARGET kvtier_dep_${name} PROPERTY KVTIER_ARCHIVES "${archives}")
  target_link_libraries(kvtier_dep_${name} INTERFACE ${archives})
  add_library(kvtier::dep::${name} ALIAS kvtier_dep_${name})
endfunction()

kvtier_pkg_dependency(uring liburing)
kvtier_pkg_dependency(hiredis hiredis)
kvtier_pkg_dependency(xxhash libxxhash)
kvtier_pkg_dependency(sodium libsodium)
kvtier_pkg_dependency(numa numa)

# UCX: ucp, uct and ucs (the transport itself) apart from ucm (its memory hooks), because a static link
# must take the first three whole: UCX registers its components and global options from constructors in
# objects nothing references by symbol. ucm must not be taken whole: its mmap/munmap/madvise would then
# interpose on glibc for the whole binary.
pkg_check_modules(KVTIER_PKG_ucx REQUIRED IMPORTED_TARGET GLOBAL ucx)
if(NOT KVTIER_STATIC_DEPS)
  add_library(kvtier::dep::ucx ALIAS PkgConfig::KVTIER_PKG_ucx)
else()
  set(_kvtier_ucx_whole "")
  foreach(lib ucp uct ucs ucm)
    find_library(KVTIER_ARCHIVE_${lib} NAMES lib${lib}.a HINTS ${KVTIER_PKG_ucx_LIBRARY_DIRS})
    if(NOT KVTIER_ARCHIVE_${lib})
      message(FATAL_ERROR "KVTIER_STATIC_DEPS: no static archive lib${lib}.a for UCX (searched "
                          "${KVTIER_PKG_ucx_LIBRARY_DIRS}); install libucx-dev or use -DKVTIER_STATIC_DEPS=OFF")
    endif()
    if(NOT lib STREQUAL "ucm")
      list(APPEND _kvtier_ucx_whole ${KVTIER_ARCHIVE_${lib}})
    endif()
  endforeach()
  add_library(kvtier_dep_ucx INTERFACE)
  target_include_directories(kvtier_dep_ucx SYSTEM INTERFACE ${KVTIER_PKG_ucx_INCLUDE_DIRS})
  target_link_libraries(kvtier_dep_ucx INTERFACE "$<LINK_LIBRARY:WHOLE_ARCHIVE,${_kvtier_ucx_whole}>"
                                                 ${KVTIER_ARCHIVE_ucm} ${CMAKE_DL_LIBS} rt)
  add_library(kvtier::dep::ucx ALIAS kvtier_dep_ucx)
endif()

# fmt: the shared library from its CMake package; for static binaries its static archive where the
# distribution has one, else fmt header-only (Debian ships no libfmt.a; every file that formats then
# compiles fmt's implementation too, which costs the gpu preset compile time, not run time).
find_package(fmt CONFIG REQUIRED)
add_library(kvtier_fmt INTERFACE)
if(NOT KVTIER_STATIC_DEPS)
  target_link_libraries(kvtier_fmt INTERFACE fmt::fmt)
else()
  find_library(KVTIER_ARCHIVE_fmt NAMES libfmt.a)
  if(KVTIER_ARCHIVE_fmt)
    get_target_property(_kvtier_fmt_includes fmt::fmt INTERFACE_INCLUDE_DIRECTORIES)
    target_include_directories(kvtier_fmt SYSTEM INTERFACE ${_kvtier_fmt_includes})
    target_link_libraries(kvtier_fmt INTERFACE ${KVTIER_ARCHIVE_fmt})
  else()
    target_link_libraries(kvtier_fmt INTERFACE fmt::fmt-header-only)
  endif()
endif()
