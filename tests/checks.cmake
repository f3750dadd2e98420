# The check builds: the same sources compiled by clang (-Wall -Wextra -Werror) with sanitizers, as a
# separate CMake build of this project with -DMEMKIT_CHECK_BUILD=...
#   clang-sanitizers  built by the main build (tests/CMakeLists.txt, ExternalProject; MEMKIT_CLANG_CHECKS,
#                     ON by default) and run by its CTest:
#                       - every public header through clang's front end (-fsyntax-only, -Werror);
#                       - the whole host suite plus the fuzz replay compiled (-Werror), linked and run
#                         under AddressSanitizer + UndefinedBehaviorSanitizer (memkit_host_tests_asan);
#                       - the threaded optimizer tests under ThreadSanitizer (memkit_adam_tests_tsan).
#   libfuzzer         built by `./dev.sh fuzz`: one libFuzzer binary per fuzz target (tests/fuzz/).
find_package(doctest REQUIRED)

if(MEMKIT_CHECK_BUILD STREQUAL "libfuzzer")
  add_subdirectory(fuzz)
  return()
endif()
if(NOT MEMKIT_CHECK_BUILD STREQUAL "clang-sanitizers")
  message(FATAL_ERROR "MEMKIT_CHECK_BUILD must be clang-sanitizers or libfuzzer, not '${MEMKIT_CHECK_BUILD}'")
endif()

# A -fsyntax-only compile writes no object file; this launcher creates an empty one when clang succeeds, so
# the syntax checks are not redone on every build.
set(syntax_only_launcher ${CMAKE_CURRENT_SOURCE_DIR}/support/syntax_only.sh)

# Every public header through clang's front end, in one source that includes them all (each header on its
# own is the g++ check's job, tests/CMakeLists.txt: the same text and the same libstdc++ under both
# compilers; one source instead of 54 saves about 70 s of CPU, measured).
file(GLOB_RECURSE headers CONFIGURE_DEPENDS RELATIVE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/include/memkit/*.hpp)
set(every_header_includes)
foreach(header IN LISTS headers)
  string(APPEND every_header_includes "#include \"${header}\"\n")
endforeach()
set(every_header_source ${CMAKE_CURRENT_BINARY_DIR}/every_public_header.cpp)
file(CONFIGURE OUTPUT ${every_header_source} CONTENT "${every_header_includes}")
add_library(memkit_headers_clang OBJECT ${every_header_source})
target_link_libraries(memkit_headers_clang PRIVATE memkit::memkit)
target_compile_options(memkit_headers_clang PRIVATE ${MEMKIT_WARNINGS} -fsyntax-only)
set_target_properties(memkit_headers_clang PROPERTIES CXX_COMPILER_LAUNCHER ${syntax_only_launcher})

# The whole host suite (every tests/host source, the fuzz targets and their replay driver) built by clang with
# -Werror and run under AddressSanitizer + UndefinedBehaviorSanitizer. Adapted, not left out: the cases that
# run at full size (doctest suite "scale": accuracy of the 8-/4-bit optimizers over long runs, attention at seq
# 8192, a realistic vocabulary) are excluded by test_main.cpp under MEMKIT_TEST_SANITIZED and counted in its
# output (the same code runs at small sizes in the other cases; memkit.host runs them in full), and
# memory_test's 4 EiB request is compiled out (ASan's operator new aborts on it whatever
# allocator_may_return_null says).
# -O0, except the compute-heavy sources (tests/CMakeLists.txt, MEMKIT_COMPUTE_HEAVY_HOST_TESTS) at -O1: -O0
# compiles in about a third of the time -O1 takes (measured: bnb_adam_state_test 14.5 s vs 42.7 s of CPU under
# ASan) and UBSan sees every operation as written; the heavy sources' small cases run for minutes at -O0 under
# ASan (adam_fast_path's thread cases 12-18 s each, measured). No debug info keeps the build short (ASan and
# UBSan still name the function and file of a report through the symbol table).
file(GLOB host_tests CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/host/*.cpp)
file(GLOB fuzz_sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz_*.cpp)
set(asan_flags -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
add_executable(memkit_host_tests_asan support/test_main.cpp ${host_tests} ${fuzz_sources})
target_link_libraries(memkit_host_tests_asan PRIVATE memkit::memkit doctest::doctest)
target_include_directories(memkit_host_tests_asan PRIVATE ${CMAKE_CURRENT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/tools)
target_compile_options(memkit_host_tests_asan PRIVATE ${MEMKIT_WARNINGS} ${asan_flags} -O0)
# attention_flash_test stays at -O0 here: under ASan that costs less CPU in all (compile + run, measured
# 2026-11-27: 7 + 21 s at -O0 vs 23 + 9 s at -O1); the other heavy sources cost less at -O1 (adam_fast_path 56 vs
# 105 s, linalg_gemm 58 vs 128, loss 66 vs 74, adam_accuracy 24 vs 25). In the g++ suite its seq-8192 case needs -O2.
set(asan_optimized_sources ${MEMKIT_COMPUTE_HEAVY_HOST_TEST_SOURCES})
list(FILTER asan_optimized_sources EXCLUDE REGEX "/attention_flash_test\\.cpp$")
set_source_files_properties(${asan_optimized_sources} TARGET_DIRECTORY memkit_host_tests_asan
  PROPERTIES COMPILE_OPTIONS -O1)
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
