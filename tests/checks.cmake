# The check builds: the same sources compiled by clang (-Wall -Wextra -Werror) with sanitizers, as a
# separate CMake build of this project with -DMEMKIT_CHECK_BUILD=...
#   clang-sanitizers  built by the main build (tests/CMakeLists.txt, ExternalProject) and run by its CTest:
#                     every public header on its own; the host suite plus the fuzz replay under
#                     AddressSanitizer + UndefinedBehaviorSanitizer; the threaded optimizer tests under
#                     ThreadSanitizer.
#   libfuzzer         built by `./dev.sh fuzz`: one libFuzzer binary per fuzz target (tests/fuzz/).
find_package(doctest REQUIRED)

if(MEMKIT_CHECK_BUILD STREQUAL "libfuzzer")
  add_subdirectory(fuzz)
  return()
endif()
if(NOT MEMKIT_CHECK_BUILD STREQUAL "clang-sanitizers")
  message(FATAL_ERROR "MEMKIT_CHECK_BUILD must be clang-sanitizers or libfuzzer, not '${MEMKIT_CHECK_BUILD}'")
endif()

# Every public header compiles on its own under clang too.
file(GLOB_RECURSE headers RELATIVE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/include/memkit/*.hpp)
set(header_sources)
foreach(header IN LISTS headers)
  string(MAKE_C_IDENTIFIER ${header} stem)
  set(source ${CMAKE_CURRENT_BINARY_DIR}/self_contained/${stem}.cpp)
  file(CONFIGURE OUTPUT ${source} CONTENT "#include \"${header}\"\n#include \"${header}\"\n")
  list(APPEND header_sources ${source})
endforeach()
add_library(memkit_self_contained_clang OBJECT ${header_sources})
target_link_libraries(memkit_self_contained_clang PRIVATE memkit::memkit)
target_compile_options(memkit_self_contained_clang PRIVATE ${MEMKIT_WARNINGS} -fsyntax-only)

# -O1 keeps the sanitized suite fast enough to run; no debug info keeps the build short (ASan and UBSan
# still name the function and file of a report through the symbol table).
set(asan_flags -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
file(GLOB host_tests CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/host/*.cpp)
file(GLOB fuzz_sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz_*.cpp)
add_executable(memkit_host_tests_asan support/test_main.cpp ${host_tests} ${fuzz_sources})
target_link_libraries(memkit_host_tests_asan PRIVATE memkit::memkit doctest::doctest)
target_include_directories(memkit_host_tests_asan PRIVATE ${CMAKE_CURRENT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/tools)
target_compile_options(memkit_host_tests_asan PRIVATE ${MEMKIT_WARNINGS} ${asan_flags} -O1)
target_link_options(memkit_host_tests_asan PRIVATE ${asan_flags})
target_compile_definitions(memkit_host_tests_asan PRIVATE MEMKIT_TEST_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
  MEMKIT_TEST_SANITIZED=1)

# The optimizer's multi-threaded host step (adam_options::host_threads) under ThreadSanitizer.
add_executable(memkit_adam_tests_tsan support/test_main.cpp host/adam_fast_path_test.cpp)
target_link_libraries(memkit_adam_tests_tsan PRIVATE memkit::memkit doctest::doctest)
target_include_directories(memkit_adam_tests_tsan PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_compile_options(memkit_adam_tests_tsan PRIVATE ${MEMKIT_WARNINGS} -fsanitize=thread -O1)
target_link_options(memkit_adam_tests_tsan PRIVATE -fsanitize=thread)
target_compile_definitions(memkit_adam_tests_tsan PRIVATE MEMKIT_TEST_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
  MEMKIT_TEST_SANITIZED=1)
