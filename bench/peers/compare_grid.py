"""memkit-budget's predictions next to the peaks bench/peers/memory_grid.py measured (#33).

For each measured row it runs memkit-budget with the flags that describe the run (the PyTorch runtime: bf16
weights; LoRA adapters and their AdamW state in fp32, as PEFT makes them; transformers' fp32 upcast of the
logits; SDPA's flash kernel) and prints a Markdown table of allocated / reserved / device, predicted against
measured, with the relative errors and their medians; the longest rows compare memkit-budget --max-seq under
the cap (its reserved figure: the per-process memory fraction caps what the caching allocator reserves) with
the bisected length. Standard library only.

    python3 bench/peers/compare_grid.py tests/data/budget_measured/h200-2026-11-28.json --budget build/tools/memkit-budget

--annotate (once, after a GPU visit) writes each row's id and memkit_flags into the grid file, for memkit-budget's
"nearest measured run" line. --check DOC (CTest memkit.budget_measured.grid) fails unless DOC holds this table as printed (a model change that
moves a prediction must regenerate it), the medians meet #33's targets (allocated <= 2%, reserved <= 8%), and
every row outside the per-row targets (allocated within 5%, reserved within 8%) is named by its id
(model/method/optimizer/sequence/checkpointing, e.g. qwen3-0.6b/lora/fused/512/none) in DOC outside the table.
"""
import argparse
import json
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def flags(row):
    """The memkit-budget flags that describe a grid row, less --config and --seq."""
    fp32 = row.get("dtype", "bf16") == "fp32"
    f = ["--batch", str(row["batch"]), "--checkpointing", row["checkpointing"],
         "--attention", "flash", "--logits", "fp32", "--precision", "fp32" if fp32 else "bf16"]
    if row["method"] in ("lora", "qlora"):  # PEFT's fp32 adapters; QLoRA: bitsandbytes NF4, double quantization
        f += ["--method", row["method"], "--lora-rank", "16", "--lora-targets", "q,k,v,o,gate,up,down",
              "--optimizer", "adamw", "--fp32-adapters"]
    elif "8bit" in row["optimizer"].lower():
        f += ["--method", "full", "--optimizer", "adamw8bit"]
    else:
        f += ["--method", "full", "--optimizer", "adamw" if fp32 else "adamw-bf16"]
    f += ["--optimizer-impl", "foreach" if "foreach" in row["optimizer"] else "fused"]
    return f


def predict(budget, row, seq):
    command = [budget, "--config", str(ROOT / row["config"])] + flags(row) + ["--seq", str(seq), "--json", "--measured", "none"]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    d = json.loads(out.stdout)
    peak = {m: max(phase[m] for phase in d["figures"].values()) for m in ("allocated", "reserved", "device")}
    return peak, d["trainable_parameters"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("grid")
    parser.add_argument("--budget", default=str(ROOT / "build/tools/memkit-budget"))
    parser.add_argument("--check", metavar="DOC", help="fail unless DOC is current and every miss is named there")
    parser.add_argument("--annotate", action="store_true",
                        help="write each measured row's id and memkit_flags into the grid file (what memkit-budget's "
                             "nearest-measured-run line reads), then compare")
    args = parser.parse_args()
    lines = []
    print = lambda line="": lines.append(line)  # noqa: E731 -- collected, then printed or checked
    grid = json.loads(pathlib.Path(args.grid).read_text())
    if args.annotate:
        for row in grid["rows"]:
            if "oom" not in row and row.get("allocated"):
                row["id"] = row_id(row)
                row["memkit_flags"] = flags(row) + ["--seq", str(row["sequence"])]
        pathlib.Path(args.grid).write_text(json.dumps(grid, indent=1) + "\n")
    print(f"Measured: {grid['device']}, torch {grid['versions']['torch']}, transformers {grid['versions']['transformers']}, "
          f"peft {grid['versions']['peft']}, {grid['date']} ({args.grid}).\n")
    print("| model | method | optimizer | seq | ckpt | allocated GiB measured / predicted | error | reserved error | device error |")
    print("|---|---|---|---|---|---|---|---|---|")
    errors = {"allocated": [], "reserved": [], "device": []}
    outside = []  # rows outside the per-row targets
    for row in grid["rows"]:
        if "oom" in row or not row.get("allocated"):
            continue
        peak, trainable = predict(args.budget, row, row["sequence"])
        err = {m: peak[m] / row[m] - 1 for m in errors}
        for m in errors:
            errors[m].append(err[m])
        if abs(err["allocated"]) > 0.05 or abs(err["reserved"]) > 0.08:
            outside.append((row_id(row), err["allocated"], err["reserved"]))
        note = "" if trainable == row["trainable_parameters"] else f" (trainable {trainable:,} vs {row['trainable_parameters']:,})"
        precision = "" if row.get("dtype", "bf16") == "bf16" else f" {row['dtype']}"
        print(f"| {row['model']} | {row['method']}{precision}{note} | {row['optimizer'].split()[-1]} | {row['sequence']} | {row['checkpointing']} | "
              f"{row['allocated'] / 2**30:.2f} / {peak['allocated'] / 2**30:.2f} | {err['allocated']:+.1%} | "
              f"{err['reserved']:+.1%} | {err['device']:+.1%} |")
    print()
    for m, e in errors.items():
        if e:
            print(f"- {m}: median |error| {statistics.median(abs(x) for x in e):.1%}, worst {max(e, key=abs):+.1%} over {len(e)} rows")
    for row in grid.get("longest", []):
        cap_gib = row["cap_gib"]
        low, high = 256, 262144
        # memkit-budget's prediction: the longest sequence whose reserved peak fits the cap.
        # torch.cuda.set_per_process_memory_fraction caps what the caching allocator reserves (an allocation
        # that would take reserved past fraction x total fails); the CUDA context is outside it.
        while high - low > 256:
            mid = (low + high) // 2
            peak, _ = predict(args.budget, dict(row, batch=1), mid)
            if peak["reserved"] <= cap_gib * 2**30:
                low = mid
            else:
                high = mid
        # The bisection says the longest lies in [longest, longest + granularity): the error is against that range.
        first, last = row["longest_tokens"], row["longest_tokens"] + row["granularity"] - 1
        error = 0.0 if first <= low <= last else (low / first - 1 if low < first else low / last - 1)
        print(f"- longest sequence, {row['model']} {row['method']} (checkpointing) under {cap_gib} GiB: measured "
              f"{first}-{last} tokens, memkit-budget {low} ({error:+.0%})")
    text = "\n".join(lines)
    if not args.check:
        sys.stdout.write(text + "\n")
        return 0
    doc = pathlib.Path(args.check).read_text()
    problems = []
    table = text.split("\n\n", 1)[1]  # after the "Measured: ..." line, whose path argument may differ
    if table not in doc:
        problems.append(f"the measured-grid table is not current; regenerate it with\n  python3 bench/peers/compare_grid.py "
                        f"{args.grid} --budget build/tools/memkit-budget\nexpected:\n{table}")
    outside_table = doc.replace(table, "")
    for metric, target in (("allocated", 0.02), ("reserved", 0.08)):
        median = statistics.median(abs(x) for x in errors[metric])
        if median > target:
            problems.append(f"{metric}: median |error| {median:.1%} is over #33's {target:.0%}")
    for rid, alloc, res in outside:
        if rid not in outside_table:
            problems.append(f"{rid}: allocated {alloc:+.1%}, reserved {res:+.1%} is outside the targets (5% / 8%) and "
                            f"not named in {args.check}")
    for p in problems:
        sys.stderr.write(p + "\n")
    sys.stdout.write(f"{args.check}: measured grid {'NOT ' if problems else ''}current: {len(errors['allocated'])} rows, "
                     f"{len(outside)} outside the per-row targets, all named\n" if not problems else "")
    return 1 if problems else 0


def row_id(row):
    method = row["method"] + ("" if row.get("dtype", "bf16") == "bf16" else "-" + row["dtype"])
    return "/".join([row["model"], method, row["optimizer"].split()[-1], str(row["sequence"]), row["checkpointing"]])


if __name__ == "__main__":
    sys.exit(main())
