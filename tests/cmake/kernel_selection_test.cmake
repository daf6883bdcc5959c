cmake_minimum_required(VERSION 3.24)
# Configures cuflash with a given kernel set and feature list (no build) and checks which
# instantiations the generated list holds: guards the selection rules of CuflashKernels.cmake.
#   cmake -DSOURCE_DIR=... -DWORK_DIR=... -P kernel_selection_test.cmake
# An optional sixth argument is a CUFLASH_KERNEL_REGEX.
function(expect_selection kernel_set features expected_count must_have must_not_have)
  set(build_dir ${WORK_DIR}/${kernel_set}_${expected_count})
  file(REMOVE_RECURSE ${build_dir})
  set(regex "")
  if(ARGC GREATER 5)
    set(regex "${ARGV5}")
  endif()
  execute_process(
    COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${build_dir} -DCUFLASH_KERNEL_SET=${kernel_set}
            "-DCUFLASH_FEATURES=${features}" "-DCUFLASH_KERNEL_REGEX=${regex}" -DCUFLASH_BUILD_TESTS=OFF
            -DCUFLASH_BUILD_EXAMPLES=OFF
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "configure failed (${kernel_set}, '${features}'):\n${out}\n${err}")
  endif()
  file(STRINGS ${build_dir}/generated/cuflash_built_kernels.inc lines)
  list(LENGTH lines count)
  if(NOT count EQUAL expected_count)
    message(FATAL_ERROR "${kernel_set}, features '${features}': expected ${expected_count} kernels, got ${count}: ${lines}")
  endif()
  foreach(stem ${must_have})
    if(NOT "CUFLASH_BUILT(${stem})" IN_LIST lines)
      message(FATAL_ERROR "${kernel_set}, features '${features}': ${stem} missing from ${lines}")
    endif()
  endforeach()
  foreach(stem ${must_not_have})
    if("CUFLASH_BUILT(${stem})" IN_LIST lines)
      message(FATAL_ERROR "${kernel_set}, features '${features}': ${stem} should not be built")
    endif()
  endforeach()
endfunction()

# ci: hdim128 bf16, every feature but the paged split-KV ones.
expect_selection(ci "softcap;split;flex;paged" 11
  "flash_fwd_hdim128_bf16_sm90;flash_fwd_hdim128_bf16_softcap_split_sm90;flash_bwd_hdim128_bf16_sm90;flash_fwd_hdim128_bf16_flex_split_sm90;flash_fwd_hdim128_bf16_softcap_paged_sm90;flash_fwd_hdim128_bf16_flex_paged_sm90"
  "flash_fwd_hdim128_bf16_paged_split_sm90;flash_fwd_hdim128_bf16_softcap_paged_split_sm90;flash_fwd_hdim128_bf16_flex_paged_split_sm90;flash_fwd_hdim64_bf16_sm90;flash_fwd_hdim128_fp16_sm90")
# packgqa in ci: the plain packed kernel only.
expect_selection(ci "softcap;split;flex;paged;packgqa" 12 "flash_fwd_hdim128_bf16_packgqa_sm90"
  "flash_fwd_hdim128_bf16_split_packgqa_sm90;flash_fwd_hdim128_bf16_paged_packgqa_sm90;flash_fwd_hdim128_bf16_flex_packgqa_sm90")
# The flex packed kernels need both features.
expect_selection(custom "flex;packgqa" 6 "flash_fwd_hdim128_bf16_flex_packgqa_sm90;flash_fwd_hdim128_bf16_packgqa_sm90"
  "flash_fwd_hdim128_bf16_flex_split_packgqa_sm90;flash_fwd_hdim128_bf16_flex_paged_packgqa_sm90")
# No features: the plain forward and backward kernels only.
expect_selection(ci "" 2 "flash_fwd_hdim128_bf16_sm90;flash_bwd_hdim128_bf16_sm90"
  "flash_fwd_hdim128_bf16_softcap_sm90;flash_bwd_hdim128_bf16_flex_sm90")
# A file with two features needs both.
expect_selection(custom "split" 3 "flash_fwd_hdim128_bf16_split_sm90"
  "flash_fwd_hdim128_bf16_softcap_split_sm90;flash_fwd_hdim128_bf16_paged_split_sm90")
# CUFLASH_KERNEL_REGEX narrows a set to the names it matches.
expect_selection(ci "softcap;split;flex;paged" 1 "flash_bwd_hdim128_bf16_sm90"
  "flash_fwd_hdim128_bf16_sm90;flash_fwd_hdim128_bf16_softcap_sm90" "^flash_bwd_hdim128_bf16_sm90$")
