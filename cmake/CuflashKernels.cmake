# CUDA part of cuflash: CUTLASS/CuTe headers, sm_90a flags, and the selection of
# generated kernel instantiations (src/instantiations) that this build compiles.

# --- CUTLASS / CuTe headers -------------------------------------------------------
set(CUTLASS_DIR "" CACHE PATH "CUTLASS root or its include/ folder (holding cute/tensor.hpp)")
set(_cutlass_hints)
if(CUTLASS_DIR)
  list(APPEND _cutlass_hints ${CUTLASS_DIR} ${CUTLASS_DIR}/include)
endif()
if(DEFINED ENV{CUTLASS_DIR})
  list(APPEND _cutlass_hints $ENV{CUTLASS_DIR} $ENV{CUTLASS_DIR}/include)
endif()
# A copy of the headers inside the checkout (tools/gpu_check.sh carries it to the GPU machine).
list(APPEND _cutlass_hints ${PROJECT_SOURCE_DIR}/.cutlass/include)
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c
      "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
    OUTPUT_VARIABLE _cutlass_pip_include OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_cutlass_pip_include)
    list(APPEND _cutlass_hints ${_cutlass_pip_include})
  endif()
endif()
find_path(CUFLASH_CUTLASS_INCLUDE_DIR cute/tensor.hpp HINTS ${_cutlass_hints} NO_DEFAULT_PATH)
if(NOT CUFLASH_CUTLASS_INCLUDE_DIR)
  message(FATAL_ERROR
    "cuflash: CUTLASS/CuTe headers not found. Install them with "
    "`pip install --no-deps nvidia-cutlass==4.2.0.0` or pass -DCUTLASS_DIR=<path to cutlass or its include/>, "
    "or configure with -DCUFLASH_ENABLE_CUDA=OFF for a CPU-only build.")
endif()
message(STATUS "cuflash: CUTLASS headers at ${CUFLASH_CUTLASS_INCLUDE_DIR}")

# --- Compiler flags ---------------------------------------------------------------
set(CUFLASH_CUDA_FLAGS
  -gencode=arch=compute_90a,code=sm_90a
  --expt-relaxed-constexpr
  --expt-extended-lambda
  --use_fast_math
  -lineinfo
  -Xcompiler=-Wno-unused-parameter
  -DCUTLASS_ENABLE_GDC_FOR_SM90
  -DNDEBUG)

# --- Kernel selection ---------------------------------------------------------------
if(CUFLASH_KERNEL_SET STREQUAL "ci")
  set(_hdims 128)
  set(_dtypes bf16)
elseif(CUFLASH_KERNEL_SET STREQUAL "all")
  set(_hdims 64 96 128 192 192x128 256)
  set(_dtypes fp16 bf16)
elseif(CUFLASH_KERNEL_SET STREQUAL "custom")
  set(_hdims ${CUFLASH_HDIMS})
  set(_dtypes ${CUFLASH_DTYPES})
else()
  message(FATAL_ERROR "cuflash: CUFLASH_KERNEL_SET must be ci, all or custom (got '${CUFLASH_KERNEL_SET}')")
endif()

file(GLOB _all_instantiations CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/instantiations/*.cu)
set(CUFLASH_SELECTED_INSTANTIATIONS)
foreach(_file ${_all_instantiations})
  get_filename_component(_name ${_file} NAME_WE)
  # Names look like flash_fwd_hdim128_bf16_sm90 or flash_fwd_hdim192x128_fp16_sm90.
  string(REGEX MATCH "_hdim([0-9x]+)_(fp16|bf16)" _match ${_name})
  if(NOT _match)
    list(APPEND CUFLASH_SELECTED_INSTANTIATIONS ${_file})  # not hdim/dtype specific
    continue()
  endif()
  set(_hdim ${CMAKE_MATCH_1})
  set(_dtype ${CMAKE_MATCH_2})
  # CI compiles the paged kernels without split-KV (paged, softcap_paged) and one packed-GQA
  # kernel (the plain one) to keep the 2-core build short.
  if(CUFLASH_KERNEL_SET STREQUAL "ci" AND (_name MATCHES "_paged_split_" OR
     (_name MATCHES "_packgqa_" AND NOT _name MATCHES "_(fp16|bf16)_packgqa_")))
    continue()
  endif()
  # Feature tokens between the dtype and the arch suffix (softcap, split, flex, paged): the file
  # is built only when every one of them is in CUFLASH_FEATURES. Plain kernels have none.
  string(REGEX REPLACE "^flash_(fwd|bwd)_hdim[0-9x]+_(fp16|bf16)_?(.*)_sm90$" "\\3" _features ${_name})
  string(REPLACE "_" ";" _features "${_features}")
  set(_features_built TRUE)
  foreach(_feature ${_features})
    if(NOT _feature IN_LIST CUFLASH_FEATURES)
      set(_features_built FALSE)
    endif()
  endforeach()
  if(NOT _features_built)
    continue()
  endif()
  if(NOT CUFLASH_KERNEL_REGEX STREQUAL "" AND NOT _name MATCHES "${CUFLASH_KERNEL_REGEX}")
    continue()
  endif()
  if(_hdim IN_LIST _hdims AND _dtype IN_LIST _dtypes)
    list(APPEND CUFLASH_SELECTED_INSTANTIATIONS ${_file})
  endif()
endforeach()
list(LENGTH CUFLASH_SELECTED_INSTANTIATIONS _count)
set(CUFLASH_KERNEL_REGEX_NOTE "")
if(NOT CUFLASH_KERNEL_REGEX STREQUAL "")
  set(CUFLASH_KERNEL_REGEX_NOTE "; names matching '${CUFLASH_KERNEL_REGEX}'")
endif()
message(STATUS "cuflash: kernel set '${CUFLASH_KERNEL_SET}' (hdims ${_hdims}; dtypes ${_dtypes}; features ${CUFLASH_FEATURES}${CUFLASH_KERNEL_REGEX_NOTE}): ${_count} instantiation files")

# The list of compiled configurations, for dispatch to report what is missing.
# cuflash_built_kernels.inc: CUFLASH_BUILT(<stem>) for every file; cuflash_built_fwd.inc /
# cuflash_built_bwd.inc: CUFLASH_BUILT_FWD / CUFLASH_BUILT_BWD(<stem>) for the forward /
# backward ones, which src/sm90/dispatch_fwd_sm90.cu / dispatch_bwd_sm90.cu link to.
set(CUFLASH_BUILT_LIST "")
set(CUFLASH_BUILT_FWD_LIST "")
set(CUFLASH_BUILT_BWD_LIST "")
foreach(_file ${CUFLASH_SELECTED_INSTANTIATIONS})
  get_filename_component(_name ${_file} NAME_WE)
  string(APPEND CUFLASH_BUILT_LIST "CUFLASH_BUILT(${_name})\n")
  if(_name MATCHES "^flash_fwd_")
    string(APPEND CUFLASH_BUILT_FWD_LIST "CUFLASH_BUILT_FWD(${_name})\n")
  elseif(_name MATCHES "^flash_bwd_")
    string(APPEND CUFLASH_BUILT_BWD_LIST "CUFLASH_BUILT_BWD(${_name})\n")
  endif()
endforeach()
foreach(_inc cuflash_built_kernels cuflash_built_fwd cuflash_built_bwd)
  if(_inc STREQUAL "cuflash_built_fwd")
    set(_text "${CUFLASH_BUILT_FWD_LIST}")
  elseif(_inc STREQUAL "cuflash_built_bwd")
    set(_text "${CUFLASH_BUILT_BWD_LIST}")
  else()
    set(_text "${CUFLASH_BUILT_LIST}")
  endif()
  file(WRITE ${PROJECT_BINARY_DIR}/generated/${_inc}.inc.tmp "${_text}")
  configure_file(${PROJECT_BINARY_DIR}/generated/${_inc}.inc.tmp ${PROJECT_BINARY_DIR}/generated/${_inc}.inc COPYONLY)
endforeach()

# Tiles whose N extent is not a power-of-two multiple of 32 (forward kBlockN 80, 112, 160; backward
# 80, 40) need WGMMA shapes that CUTLASS declares only with CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED;
# without them the selector falls back to 64x16 atoms, five to seven WGMMAs where one would do.
# src/sm90/mainloop_bwd_sm90.hpp and mainloop_fwd_sm90.hpp check that it is set.
if(CUFLASH_SELECTED_INSTANTIATIONS)
  set_source_files_properties(${CUFLASH_SELECTED_INSTANTIATIONS} PROPERTIES COMPILE_DEFINITIONS CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED)
endif()

file(GLOB CUFLASH_SM90_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/sm90/*.cu)
target_sources(cuflash PRIVATE ${CUFLASH_SM90_SOURCES} ${CUFLASH_SELECTED_INSTANTIATIONS})
target_include_directories(cuflash PRIVATE ${CUFLASH_CUTLASS_INCLUDE_DIR} ${PROJECT_BINARY_DIR}/generated)
target_compile_definitions(cuflash PRIVATE CUFLASH_HAS_CUDA=1
  CUFLASH_KERNEL_SET="${CUFLASH_KERNEL_SET}")
target_compile_options(cuflash PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${CUFLASH_CUDA_FLAGS}>)
target_link_libraries(cuflash PUBLIC CUDA::cudart)
