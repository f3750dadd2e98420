#!/usr/bin/env python3
"""Compiles every C++ code block of README.md and docs/*.md, so that the documentation cannot drift from the API.

A block is the text of a ```cpp fence. The line just before the fence may say how to build it:

  <!-- doc-block: body [prelude=NAME] -->     (the default) the block's #include lines go to the top, the rest
                                             becomes the body of a function: a sequence of calls compiles
  <!-- doc-block: file [prelude=NAME] -->    the block is a whole translation unit (definitions at namespace scope)
  <!-- doc-block: program [prelude=NAME] --> a whole program: compiled, linked and run (exit status 0)
  <!-- doc-block: skip REASON -->            not C++ to compile (a signature list, a sketch); the reason is printed

A prelude (tests/docs/preludes/NAME.hpp) declares what a fragment uses but does not define: the tensors, the
executor, the resources. Every block is compiled with each compiler given (g++ and clang++ in the test suite),
-std=c++20 -Wall -Wextra -Werror; `unused` warnings are off, since a fragment shows calls, not a whole loop.

Every block's source starts with #include <memkit/memkit.hpp>, whose parse was most of each compile (alone: g++ 4.8 s,
clang++ 3.0 s). So memkit.hpp is first precompiled once per compiler (WORK_DIR/pch/, with the blocks' flags; g++
9 s, clang++ 5 s of CPU) and every compile of a block starts from it (-include for g++, -include-pch for clang++):
the same text with the same flags, in 1-2.5 s (g++) and 0.4-1.3 s (clang++) a block. The whole check takes 71-75 s
of CPU and 47-49 s of wall time (2026-11-29, the 2-core machine; 174-193 s and 133-166 s without the precompiled
header). Where a compiler cannot build the precompiled header, its blocks are compiled without it and the summary
says why; g++ parses the header itself where it finds the precompiled one unusable. A failing block is still
reported by page and line, with the compiler's message.

Usage: check_doc_blocks.py ROOT WORK_DIR COMPILER [COMPILER...]
"""
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

FENCE = re.compile(r"```(?:cpp|c\+\+)\n(.*?)```", re.S)
MARKER = re.compile(r"<!--\s*doc-block:\s*(\w+)\s*(.*?)\s*-->\s*$")


def blocks(root):
    pages = ["README.md"] + sorted("docs/" + f for f in os.listdir(os.path.join(root, "docs")) if f.endswith(".md"))
    for page in pages:
        text = open(os.path.join(root, page), encoding="utf-8").read()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = MARKER.search(before)
            mode, rest = (marker.group(1), marker.group(2)) if marker else ("body", "")
            yield page, line, mode, rest, match.group(1)


def source_of(root, page, line, mode, rest, code):
    prelude = re.search(r"prelude=(\w+)", rest)
    includes = [l for l in code.splitlines() if l.startswith("#include")]
    body = "\n".join(l for l in code.splitlines() if not l.startswith("#include"))
    head = "#include <memkit/memkit.hpp>\n" + "\n".join(includes) + "\n"
    if prelude:
        head += '#include "%s"\n' % os.path.join(root, "tests/docs/preludes", prelude.group(1) + ".hpp")
    if mode == "body":
        return head + '[[maybe_unused]] static void memkit_doc_block() {\n#line %d "%s"\n' % (line + 1, page) + body + "\n}\n"
    return head + '#line %d "%s"\n' % (line + 1, page) + body + "\n"


FLAGS = ["-std=c++20", "-Wall", "-Wextra", "-Werror", "-Wno-unused", "-Wno-unused-variable", "-Wno-unused-parameter",
         "-Wno-unused-but-set-variable", "-pthread"]


def precompile(root, work, index, compiler):
    """The flags that make `compiler` start from a precompiled memkit.hpp, or [] (and why) where it cannot."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    clang = "clang" in version
    folder = os.path.join(work, "pch", str(index))
    os.makedirs(folder, exist_ok=True)
    header = os.path.join(folder, "memkit_doc_blocks.hpp")
    with open(header, "w", encoding="utf-8") as f:
        f.write("#include <memkit/memkit.hpp>\n")
    # g++ finds header.gch beside the header it is told to -include; clang++ is given the file itself.
    output = header + (".pch" if clang else ".gch")
    r = subprocess.run([compiler, *FLAGS, "-I", os.path.join(root, "include"), "-x", "c++-header", header, "-o", output],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return [], "%s could not precompile memkit.hpp:\n%s" % (os.path.basename(compiler), r.stderr[-2000:])
    return (["-include-pch", output] if clang else ["-include", header]), None


def build(root, work, compilers, pch, index, page, line, mode, rest, code):
    name = "%s:%d" % (page, line)
    source = os.path.join(work, "block_%02d.cpp" % index)
    with open(source, "w", encoding="utf-8") as f:
        f.write(source_of(root, page, line, mode, rest, code))
    problems = []
    for compiler in compilers:
        flags = [*FLAGS, "-I", os.path.join(root, "include"), *pch[compiler]]
        if mode == "program" and compiler == compilers[0]:
            exe = source[:-4]
            r = subprocess.run([compiler, *flags, source, "-o", exe], capture_output=True, text=True)
            if r.returncode == 0:
                r = subprocess.run([exe], capture_output=True, text=True, timeout=300, cwd=work)
                if r.returncode != 0:
                    problems.append("%s: the program exited with %d:\n%s%s" % (name, r.returncode, r.stdout[-2000:], r.stderr[-2000:]))
                continue
        else:
            r = subprocess.run([compiler, *flags, "-fsyntax-only", source], capture_output=True, text=True)
        if r.returncode != 0:
            problems.append("%s (%s, %s):\n%s" % (name, mode, os.path.basename(compiler), r.stderr[-4000:]))
    return name, mode, problems


def main():
    if len(sys.argv) < 4 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2
    root, work, compilers = sys.argv[1], sys.argv[2], sys.argv[3:]
    os.makedirs(work, exist_ok=True)
    found = list(blocks(root))
    skipped = [(p, l, rest) for p, l, mode, rest, _ in found if mode == "skip"]
    bad = [(p, l, mode) for p, l, mode, _, _ in found if mode not in ("body", "file", "program", "skip")]
    for p, l, mode in bad:
        print("%s:%d: unknown doc-block mode '%s'" % (p, l, mode))
    todo = [(i, *b) for i, b in enumerate(found) if b[2] != "skip"]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        precompiled = list(pool.map(lambda ic: precompile(root, work, *ic), enumerate(compilers)))
        pch = {c: flags for c, (flags, _) in zip(compilers, precompiled)}
        results = list(pool.map(lambda t: build(root, work, compilers, pch, *t), todo))
    failures = [p for _, _, problems in results for p in problems]
    for name, mode, problems in results:
        print("%-34s %-8s %s" % (name, mode, "FAILED" if problems else "ok"))
    for p, l, rest in skipped:
        print("%-34s skip     (%s)" % ("%s:%d" % (p, l), rest or "no reason given"))
    for _, why in precompiled:
        if why:
            print("\nwithout a precompiled header: " + why)
    for failure in failures:
        print("\n" + failure)
    print("\n%d C++ blocks in README.md and docs/: %d compiled with %s, %d skipped, %d failed" %
          (len(found), len(todo), " and ".join(os.path.basename(c) for c in compilers), len(skipped), len(failures)))
    missing_reason = [s for s in skipped if not s[2]]
    return 1 if failures or bad or missing_reason else 0


if __name__ == "__main__":
    sys.exit(main())
