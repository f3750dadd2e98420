// io/files.hpp: path_exists and create_directories (POSIX, in place of <filesystem>), read_text_file.
#include <doctest/doctest.h>
#include <memkit/io/files.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <unistd.h>

TEST_CASE("io::create_directories: mkdir -p, idempotent, refuses a file in the way; path_exists") {
  char pattern[] = "/tmp/memkit_io_files_XXXXXX";
  const char* made = ::mkdtemp(pattern);
  REQUIRE(made != nullptr);
  const std::string root = made;
  const std::string nested = root + "/a/b/c";
  CHECK_FALSE(memkit::io::path_exists(nested));
  CHECK(memkit::io::create_directories(nested).empty());
  CHECK(memkit::io::path_exists(nested));
  CHECK(memkit::io::create_directories(nested).empty());         // again: nothing to do
  CHECK(memkit::io::create_directories(nested + "/").empty());   // a trailing slash
  const std::string file = root + "/a/file";
  std::FILE* f = std::fopen(file.c_str(), "wb");
  REQUIRE(f != nullptr);
  std::fputs("memkit", f);
  std::fclose(f);
  CHECK(memkit::io::path_exists(file));
  CHECK(memkit::io::read_text_file(file, "test") == "memkit");
  CHECK_FALSE(memkit::io::create_directories(file).empty());          // a file, not a directory
  CHECK_FALSE(memkit::io::create_directories(file + "/below").empty());  // a file in the way
  CHECK_FALSE(memkit::io::create_directories("").empty());
  CHECK_THROWS_AS(memkit::io::read_text_file(root + "/missing", "test"), memkit::error);
  for (const std::string& p : {file, nested, root + "/a/b", root + "/a", root}) ::rmdir(p.c_str()), std::remove(p.c_str());
  CHECK_FALSE(memkit::io::path_exists(root));
}
