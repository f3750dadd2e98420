// The tools' main(): runs the tool and turns any exception into one line on stderr ("NAME: error: ...", its
// newlines folded so a script reads it as one line) and exit status 2.
#pragma once

#include <cstdio>
#include <exception>
#include <string>

namespace memkit_tools {

template <class Run>
int main_reporting_errors(const char* tool, Run run, int argc, char** argv) noexcept {
  try {
    return run(argc, argv);
  } catch (const std::exception& failure) {
    std::string message = failure.what();
    for (char& c : message)
      if (c == '\n') c = ' ';
    std::fprintf(stderr, "%s: error: %s\n", tool, message.c_str());
    return 2;
  }
}

}  // namespace memkit_tools
