# Finds vlmgen's dependencies; shared by the build and (through find_dependency) the package config.
include(GNUInstallDirs)

find_package(Torch REQUIRED)
find_package(fmt REQUIRED)
find_package(Threads REQUIRED)

# Used by the compiled library only (privately).
find_package(nlohmann_json 3.10 REQUIRED)
find_path(VLMGEN_STB_INCLUDE_DIR stb_image.h PATH_SUFFIXES stb REQUIRED)
