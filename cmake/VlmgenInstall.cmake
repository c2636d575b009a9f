include(CMakePackageConfigHelpers)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/vlmgen DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS vlmgen_core vlmgen EXPORT vlmgenTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(EXPORT vlmgenTargets NAMESPACE vlmgen:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/vlmgen)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/vlmgenConfig.cmake.in
  ${PROJECT_BINARY_DIR}/vlmgenConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/vlmgen)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/vlmgenConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/vlmgenConfig.cmake ${PROJECT_BINARY_DIR}/vlmgenConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/vlmgen)
