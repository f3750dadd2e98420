#!/usr/bin/env python3
"""Tokenizes text files with a Hugging Face tokenizer into a memkit token file.

    python3 tools/tokenize.py --tokenizer DIR_OR_HUB_NAME_OR_TOKENIZER_JSON --out FILE [--bos] [--eos] \
        INPUT.txt [INPUT2.txt ...]

--tokenizer is a directory holding a saved tokenizer (tokenizer.json, tokenizer_config.json, ...) or a hub
name, both loaded with transformers.AutoTokenizer.from_pretrained, or the path of a tokenizer.json file,
wrapped with transformers.PreTrainedTokenizerFast. Each input is read as UTF-8 and encoded whole, without
special tokens; --bos prepends the tokenizer's bos id to each file's ids and --eos appends its eos id, so
documents stay separated. The ids of all inputs, in order, are written to --out, and one summary line is
printed.

The format (read by memkit::models::read_token_file, include/memkit/models/tokens.hpp), little-endian:

    offset  size  field
         0     8  magic b"MKTOKENS"
         8     4  uint32 version = 1
        12     4  uint32 token_width: 2 when vocab_size <= 65536, else 4
        16     4  uint32 vocab_size = len(tokenizer) (base vocabulary plus added tokens)
        20     4  uint32 reserved = 0
        24     8  uint64 count
        32        count ids, uint16 or uint32

vocab_size is the tokenizer's, which may be below a model config's vocab_size (padded embeddings): every id
is still below both.
"""
import os
import sys

# This file's name shadows the standard library's tokenize module, which transformers imports (through
# inspect and linecache): take this file's directory off the module path before anything imports it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import argparse  # noqa: E402
import array  # noqa: E402
import struct  # noqa: E402

MAGIC = b"MKTOKENS"
VERSION = 1
MAX_VOCAB = 2**31 - 1  # memkit returns ids as int32


def load_tokenizer(name):
    # Imported here so --help works without transformers installed.
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if os.path.isfile(name) and name.endswith(".json"):
        return PreTrainedTokenizerFast(tokenizer_file=name)
    return AutoTokenizer.from_pretrained(name)


def special_id(tokenizer, which):
    token_id = getattr(tokenizer, which + "_token_id")
    if token_id is None:
        # A bare tokenizer.json names no bos/eos; a directory's tokenizer_config.json does.
        sys.exit(f"tokenize.py: --{which} given, but the tokenizer has no {which} token "
                 f"(a tokenizer.json alone names none; pass its directory with a tokenizer_config.json)")
    return token_id


def write_token_file(path, vocab_size, ids):
    if not 1 <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} is outside 1..{MAX_VOCAB}")
    if not ids:
        raise ValueError("no tokens (a token file holds at least one)")
    for index, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"token {index} is id {token_id}, outside [0, {vocab_size})")
    width = 2 if vocab_size <= 65536 else 4
    body = array.array("H" if width == 2 else "I", ids)
    if body.itemsize != width:  # 'I' is 4 bytes on every platform CPython supports, but check
        body = array.array("L" if width == 4 else "H", ids)
        assert body.itemsize == width
    if sys.byteorder != "little":
        body.byteswap()
    header = MAGIC + struct.pack("<IIIIQ", VERSION, width, vocab_size, 0, len(ids))
    # Written beside the target and renamed, so a failed run never leaves a half-written file at --out.
    temporary = path + ".tmp"
    with open(temporary, "wb") as out:
        out.write(header)
        body.tofile(out)
    os.replace(temporary, path)
    return width


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="directory, hub name, or tokenizer.json path")
    parser.add_argument("--out", required=True, help="token file to write")
    parser.add_argument("--bos", action="store_true", help="prepend the bos id to each input's ids")
    parser.add_argument("--eos", action="store_true", help="append the eos id to each input's ids")
    parser.add_argument("inputs", nargs="+", help="UTF-8 text files")
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.tokenizer)
    bos = special_id(tokenizer, "bos") if args.bos else None
    eos = special_id(tokenizer, "eos") if args.eos else None
    ids = []
    for name in args.inputs:
        with open(name, encoding="utf-8", newline="") as f:  # newline="": keep the text's own line ends
            text = f.read()
        if bos is not None:
            ids.append(bos)
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        if eos is not None:
            ids.append(eos)

    vocab_size = len(tokenizer)
    try:
        width = write_token_file(args.out, vocab_size, ids)
    except ValueError as e:
        sys.exit(f"tokenize.py: cannot write '{args.out}': {e}")
    print(f"{args.out}: {len(ids)} tokens, vocab {vocab_size}, width {width} bytes")


if __name__ == "__main__":
    main()
