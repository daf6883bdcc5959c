# `cmake --install` gives a find_package(cuflash) config package.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS cuflash EXPORT cuflashTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/cuflash DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# Kernel templates for users who compile their own score_mod / mask_mod functors.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/src/sm90/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/cuflash/sm90
  FILES_MATCHING PATTERN "*.hpp")
install(EXPORT cuflashTargets NAMESPACE cuflash:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/cuflash)

set(CUFLASH_CONFIG_HAS_CUDA ${CUFLASH_HAS_CUDA})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/cuflashConfig.cmake.in
  ${PROJECT_BINARY_DIR}/cuflashConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/cuflash)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/cuflashConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/cuflashConfig.cmake ${PROJECT_BINARY_DIR}/cuflashConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/cuflash)
