# cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DWORK_DIR=... -DCXX=... -DC=... -DCXX_FLAGS=... -DLINKER_FLAGS=...
#       -DVERSION=... -P tests/install/run.cmake
# Installs the build into WORK_DIR/prefix, configures and builds tests/install/consumer against it (same compilers and
# sanitizer flags as the build), and runs its programs. Any failure is fatal, with the step's output.
file(REMOVE_RECURSE ${WORK_DIR})
function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  message(STATUS "${what}: ok")
endfunction()
step("install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
step("configure the consumer" ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/install/consumer -B ${WORK_DIR}/build -G Ninja
     -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_C_COMPILER=${C}
     "-DCMAKE_CXX_FLAGS=${CXX_FLAGS} -DKVTIER_EXPECTED_VERSION=\\\"${VERSION}\\\"" "-DCMAKE_EXE_LINKER_FLAGS=${LINKER_FLAGS}"
     -DKVTIER_EXAMPLES_DIR=${SOURCE_DIR}/examples)
step("build the consumer" ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
step("run consumer_version" ${WORK_DIR}/build/consumer_version)
step("run consumer_offload_and_reload" ${WORK_DIR}/build/consumer_offload_and_reload --host)
