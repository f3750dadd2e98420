"""bench/gpu/measure.py's longctx step without a GPU (#31): its parser on the lines train_llama --max-seq-search
prints (the host run of CTest memkit.example.train_llama_max_seq_smollm2, 2026-11-29: the device prints the same
lines), and the results.md table it builds from them. Run by tests/tools/gpu_script.cmake."""
import pathlib
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu"))
import measure  # noqa: E402

LINES = [
    "built the model and its optimizer once for the search in 0.5 s: tracked 56.39 MiB (peak 57.87 MiB)",
    "longest sequence under 96 MiB (batch 1, accumulation 1): 755 tokens trains a step (5 one-step runs); "
    "memory_budget's memkit runtime predicts 750 (-0.66%)",
    "at 755 tokens: 156 tokens/s (one step, 4.8 s), tracked peak 95.96 MiB (memory_budget 96.23 MiB, +0.28%; cap "
    "96.00 MiB); the loss's chunk 172 tokens (memory_budget 172); checkpoints in host memory (1.66 MiB, memory_budget "
    "1.66 MiB)",
    "memory_budget's breakdown at its peak (backward): weights 56.08 MiB gradients 318.00 KiB optimizer_state "
    "180.69 KiB activations 20.57 MiB workspace 19.08 MiB",
    "check: ok   memory_budget's longest sequence within 2% of the one found",
    "check: ok   memory_budget's peak at that length within 2% of the tracked one",
    "check: ok   the tracked peak is under the cap",
]


def expect(ok, what):
    if not ok:
        raise SystemExit(f"measure_longctx_check: FAIL: {what}")


p = measure.parse_longctx(LINES)
expect(p == {"found": 755, "runs": 5, "predicted": 750, "prediction_error_pct": -0.66, "tokens_per_s": 156,
             "step_seconds": 4.8, "tracked_peak": "95.96 MiB", "budget_peak": "96.23 MiB", "peak_error_pct": 0.28,
             "build_seconds": 0.5, "checks": "ok"}, f"parsed {p}")
failed = measure.parse_longctx(LINES[:-1] + ["check: FAIL the tracked peak is under the cap"])
expect(failed["checks"] == "1 of 3 failed", f"a failed check: {failed['checks']}")
empty = measure.parse_longctx(["train_llama: error: something"])
expect(empty["found"] is None and empty["checks"] is None, f"no search lines: {empty}")

# transformers + PEFT + SDPA's side: bench/peers/memory_grid.py's "longest" entries (the shape its search writes:
# caps in GiB, tries as [tokens, "ok", seconds] or [tokens, "oom"]), looked up by the cap in MiB.
grid = {"longest": [{"model": "llama-3.1-8b", "method": "qlora", "cap_gib": 8, "longest_tokens": 4096,
                     "granularity": 512, "complete": True,
                     "tries": [[65536, "oom"], [4096, "ok", 2.0], [8192, "oom"], [6144, "oom"], [5120, "oom"],
                               [4608, "oom"]]},
                    {"model": "llama-3.1-8b", "method": "qlora", "cap_gib": 24, "longest_tokens": 0,
                     "granularity": 512, "complete": False, "tries": []}]}
peer = measure.peer_longest(grid, 8192)
expect(peer == {"tokens": 4096, "complete": True, "granularity": 512, "tokens_per_s": 2048}, f"peer at 8 GiB: {peer}")
expect(measure.peer_longest(grid, 24576)["complete"] is False, "a search cut short")
expect(measure.peer_longest(grid, 49152) is None and measure.peer_longest(None, 8192) is None, "no entry")
expect(measure.peer_cell(peer) == "4,096 (2,048)", measure.peer_cell(peer))
expect(measure.peer_cell(measure.peer_longest(grid, 24576)) == "0, search cut short", "cut short cell")
expect(measure.peer_cell({"skipped": "not enough of the budget left"}) == "skipped: not enough of the budget left", "skip")

# The table: a run at one of Unsloth's caps (the lines above relabelled), a cap without a published figure, a skip.
at_24g = [l.replace("under 96 MiB", "under 24576 MiB") for l in LINES]
rows = [{"cap_mib": 24576, "status": 0, "lines": at_24g, "parsed": measure.parse_longctx(at_24g), "peer": peer},
        {"cap_mib": 96, "status": 1, "lines": [], "parsed": empty},
        {"cap_mib": 81920, "skipped": "not enough of the budget left"}]
table = measure.longctx_table(rows)
expect(table[0].startswith("| cap | Unsloth (published) | memkit, longest found |"), table[0])
expect(table[2] == "| 24576 MiB | 78,475 | 755 | 0.01x | 156 | 750 | -0.66% | 5 | ok | 4,096 (2,048) |", table[2])
expect(table[3] == "| 96 MiB | - | - | - | - | - | - | - | exit 1 | not run |", table[3])
expect(table[4] == "| 81920 MiB | 342,733 | skipped: not enough of the budget left | - | - | - | - | - | - | - |", table[4])
print("measure_longctx_check: ok")
