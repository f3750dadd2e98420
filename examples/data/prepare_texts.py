#!/usr/bin/env python3
"""Makes the two training texts of the main example (examples/train_llama.cpp) from public-domain sources.

  shakespeare.txt  stage 1 (pretraining): the first ~300 KB of Andrej Karpathy's "tiny shakespeare",
                   a concatenation of passages from Shakespeare's plays (public domain), taken from
                   https://github.com/karpathy/char-rnn  data/tinyshakespeare/input.txt
                   (commit 6f9487a, git blob 7dcb3a2d4cc3b48b6283dd46870bfeb78f88aac9, 1115394 bytes).
  austen.txt       stage 2 (QLoRA fine-tuning): the first ~300 KB of the novel's text of Jane Austen's
                   "Pride and Prejudice" (1813, public domain), Project Gutenberg eBook #1342, taken from
                   https://github.com/gutenbergbooks/1342  1342-0.txt
                   (commit 041e520, git blob b944ed41285c8bef7d6d39b2a53fbd6c0a3f75f3, 737944 bytes),
                   from "Chapter I." on, without the illustration captions, in plain ASCII.

The byte-level tokenizer sees ASCII only: curly quotes become straight ones, dashes "--", and the
underscores Gutenberg uses for italics are dropped. Both texts are cut at a paragraph end.

  python3 prepare_texts.py SHAKESPEARE_INPUT_TXT AUSTEN_1342_0_TXT   (writes next to this script)
"""
import pathlib
import re
import sys

LIMIT = 300_000


def cut(text: str) -> str:
    if len(text) <= LIMIT:
        return text
    end = text.rfind("\n\n", 0, LIMIT)
    return text[: end + 1]


def to_ascii(text: str) -> str:
    table = {"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2014": "--", "\u2013": "-",
             "\u00b7": "", "\u00e9": "e", "\u00ea": "e", "\u00e0": "a", "\u00e8": "e", "\u00a0": " "}
    text = "".join(table.get(c, c) for c in text)
    return text.encode("ascii", "ignore").decode("ascii")


def austen(raw: str) -> str:
    start = raw.index("Chapter I.]")
    body = raw[start + len("Chapter I.]"):]
    # Illustration blocks: "[Illustration: ...]" spanning lines, possibly with one nested [...].
    body = re.sub(r"\[Illustration(?::(?:[^\[\]]|\[[^\[\]]*\])*)?\]", "", body)
    body = body.replace("_", "")
    body = to_ascii(body)
    body = re.sub(r"[ \t]+\n", "\n", body)
    body = re.sub(r"\n{3,}", "\n\n", body).lstrip("\n")
    return cut(body)


def main() -> None:
    here = pathlib.Path(__file__).resolve().parent
    shakespeare = pathlib.Path(sys.argv[1]).read_text(encoding="utf-8")
    (here / "shakespeare.txt").write_text(cut(to_ascii(shakespeare)), encoding="ascii")
    (here / "austen.txt").write_text(austen(pathlib.Path(sys.argv[2]).read_text(encoding="utf-8")), encoding="ascii")


if __name__ == "__main__":
    main()
