# The check builds: the same sources compiled by clang (-Wall -Wextra -Werror) with sanitizers, as a
# separate CMake build of this project with -DMEMKIT_CHECK_BUILD=...
#   clang-sanitizers  built by the main build (tests/CMakeLists.txt, ExternalProject; MEMKIT_CLANG_CHECKS,
#                     ON by default) and run by its CTest:
#                       - every public header and every host test source through clang's front end
#                         (-fsyntax-only: parsing, templates instantiated, every warning an error);
#                       - the tests that read untrusted input plus the fuzz replay compiled, linked and run
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

# The host test sources that take input from outside (files, JSON, sizes, ranges) and so run under ASan +
# UBSan; with the fuzz targets and their replay driver. Every other host test source is compiled by clang
# with -fsyntax-only below. docs/reliability.md lists what this costs and why the rest is not run here.
# (memory_test is not among them: it asks host_resource for 4 EiB and expects memkit::out_of_memory, and
# ASan's throwing operator new aborts on such a request whatever allocator_may_return_null says.)
set(MEMKIT_SANITIZED_HOST_TESTS
  hostile_input_test checked_math_test quant_safetensors_test peft_adapter_test lora_peft_test bnb_adam_state_test
  adam_state_test tensor_view_test quant_tensor_test budget_models_test)

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

file(GLOB host_tests CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/host/*.cpp)
file(GLOB fuzz_sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz_*.cpp)
set(sanitized_sources)
foreach(name IN LISTS MEMKIT_SANITIZED_HOST_TESTS)
  set(source ${CMAKE_CURRENT_SOURCE_DIR}/host/${name}.cpp)
  if(NOT EXISTS ${source})
    message(FATAL_ERROR "tests/checks.cmake: MEMKIT_SANITIZED_HOST_TESTS names ${name}, which is not in tests/host/")
  endif()
  list(APPEND sanitized_sources ${source})
endforeach()
set(syntax_only_sources ${host_tests})
list(REMOVE_ITEM syntax_only_sources ${sanitized_sources})

# The rest of the host suite through clang's front end, -Werror.
add_library(memkit_host_tests_clang_syntax OBJECT ${syntax_only_sources})
target_link_libraries(memkit_host_tests_clang_syntax PRIVATE memkit::memkit doctest::doctest)
target_include_directories(memkit_host_tests_clang_syntax PRIVATE ${CMAKE_CURRENT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/tools)
target_compile_options(memkit_host_tests_clang_syntax PRIVATE ${MEMKIT_WARNINGS} -fsyntax-only)
target_compile_definitions(memkit_host_tests_clang_syntax PRIVATE MEMKIT_TEST_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
set_target_properties(memkit_host_tests_clang_syntax PROPERTIES CXX_COMPILER_LAUNCHER ${syntax_only_launcher})

# -O0: these tests are light (the whole binary runs in about 19 s of CPU under ASan at -O0), and -O0 compiles
# in about 40% of the time -O1 takes (measured: hostile_input_test 8.9 s vs 23.5 s of CPU); UBSan also sees
# every operation as written. No debug info keeps the build short (ASan and UBSan still name the function
# and file of a report through the symbol table).
set(asan_flags -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
add_executable(memkit_host_tests_asan support/test_main.cpp ${sanitized_sources} ${fuzz_sources})
target_link_libraries(memkit_host_tests_asan PRIVATE memkit::memkit doctest::doctest)
target_include_directories(memkit_host_tests_asan PRIVATE ${CMAKE_CURRENT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/tools)
target_compile_options(memkit_host_tests_asan PRIVATE ${MEMKIT_WARNINGS} ${asan_flags} -O0)
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
