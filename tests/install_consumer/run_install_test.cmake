# CTest driver: installs the cuflash build tree into a fresh prefix, then configures, builds
# and runs tests/install_consumer against it.
#   cmake -DCUFLASH_BUILD_DIR=... -DCONSUMER_SOURCE_DIR=... -DWORK_DIR=... [-DGENERATOR=...]
#         [-DCXX_COMPILER=...] [-DCONFIG=...] -P run_install_test.cmake
foreach(_var CUFLASH_BUILD_DIR CONSUMER_SOURCE_DIR WORK_DIR)
  if(NOT ${_var})
    message(FATAL_ERROR "run_install_test.cmake: ${_var} is not set")
  endif()
endforeach()
if(NOT CONFIG)
  set(CONFIG Release)
endif()

set(_prefix ${WORK_DIR}/prefix)
set(_build ${WORK_DIR}/build)
file(REMOVE_RECURSE ${WORK_DIR})

execute_process(COMMAND ${CMAKE_COMMAND} --install ${CUFLASH_BUILD_DIR} --prefix ${_prefix} --config ${CONFIG}
  COMMAND_ERROR_IS_FATAL ANY)

set(_configure ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${_build}
  -DCMAKE_PREFIX_PATH=${_prefix} -DCMAKE_BUILD_TYPE=${CONFIG})
if(GENERATOR)
  list(APPEND _configure -G ${GENERATOR})
endif()
if(CXX_COMPILER)
  list(APPEND _configure -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
endif()
execute_process(COMMAND ${_configure} COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND ${CMAKE_COMMAND} --build ${_build} --config ${CONFIG} COMMAND_ERROR_IS_FATAL ANY)

find_program(_consumer consumer PATHS ${_build} ${_build}/${CONFIG} NO_DEFAULT_PATH REQUIRED)
execute_process(COMMAND ${_consumer} COMMAND_ERROR_IS_FATAL ANY)
