# Finds vlmgen's dependencies; shared by the build and (through find_dependency) the package config.
include(GNUInstallDirs)

find_package(Torch REQUIRED)
find_package(fmt REQUIRED)
find_package(Threads REQUIRED)

# Used by the compiled library only (privately).
find_package(nlohmann_json 3.10 REQUIRED)
find_path(VLMGEN_STB_INCLUDE_DIR stb_image.h PATH_SUFFIXES stb REQUIRED)

# The tokenizer (src/text): PCRE2 for the pre-tokenizer regexes, utf8proc for NFC. Private.
find_package(PkgConfig REQUIRED)
pkg_check_modules(VLMGEN_PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
pkg_check_modules(VLMGEN_UTF8PROC REQUIRED IMPORTED_TARGET libutf8proc)
