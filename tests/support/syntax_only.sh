#!/bin/sh
# Compiler launcher for -fsyntax-only targets (tests/checks.cmake): runs the compile command it is given and,
# when it succeeds, creates the empty object file named by -o, which a syntax-only compile never writes, so
# the build tool sees the check as done and does not repeat it until a source or header changes.
out=
prev=
for arg in "$@"; do
  [ "$prev" = "-o" ] && out=$arg
  prev=$arg
done
"$@" || exit
[ -z "$out" ] || : >"$out"
