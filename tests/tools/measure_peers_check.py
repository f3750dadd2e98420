"""#30's carried peers without a GPU: gpu_peers.py's loss rows take bench/loss_cuda.cu's shapes, measure.py pairs
Liger's rows with memkit's fused loss and tabulates them against torch's materialized step (and leaves runs from
before Liger untouched), and bench/gpu/peer_wheels.py unpacks a carried wheel, puts one that imports on the path
and skips one that does not, with one record each. The figures below are made up to exercise the code: none is a
measurement. Run by tests/tools/gpu_script.cmake."""
import json
import pathlib
import sys
import tempfile
import zipfile

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
sys.path.insert(0, str(ROOT / "bench" / "peers"))
import gpu_peers  # noqa: E402
from error_line import error_line  # noqa: E402
import measure  # noqa: E402
import peer_wheels  # noqa: E402


def expect(ok, what):
    if not ok:
        raise SystemExit(f"measure_peers_check: FAIL: {what}")


# The peers' skipped reasons: one line, cut to the limit, and an empty message gives the type alone.
expect(error_line(RuntimeError("no kernel\nsecond line"), 4) == "RuntimeError: no k", "error_line: first line, cut")
expect(error_line(RuntimeError()) == "RuntimeError", "error_line: an empty message")

# The loss shapes come from bench/loss_cuda.cu (one place).
cases = gpu_peers.loss_cases()
expect(cases == [("llama2_7b", 8192, 4096, 32000), ("llama3_8b", 8192, 4096, 128256)], f"loss cases: {cases}")

# A run from before Liger: no pairs, no table.
legacy = [{"group": "loss", "name": "materialized_ce/llama2_7b", "ms": 10.0, "peak_MiB": 1500.0},
          {"group": "loss", "name": "liger_flce", "skipped": "liger_kernel not installed"}]
memkit = {"loss": [{"name": "loss_bf16/llama2_7b/fused/manual_time", "ms": 12.0, "peak_workspace_MiB": 32.0},
                   {"name": "loss_bf16/llama2_7b/fused_eighth/manual_time", "ms": 11.0, "peak_workspace_MiB": 125.0},
                   {"name": "loss_bf16/llama2_7b/frozen_head_eighth/manual_time", "ms": 6.0}]}
expect(not measure.liger_recorded(legacy) and measure.loss_table(memkit, legacy) == [], "a legacy run got Liger rows")
expect(not any("liger" in p["peer"] for p in measure.side_by_side(memkit, legacy)), "a legacy run got Liger pairs")

# Liger measured: pairs with memkit's fused rows, and the table against the materialized step.
peers = [{"group": "loss", "name": "materialized_ce/llama2_7b", "ms": 10.0, "peak_MiB": 1500.0, "grads_MiB": 250.0,
          "loss": 10.4},
         {"group": "loss", "name": "liger_flce/llama2_7b", "ms": 20.0, "peak_MiB": 500.0, "grads_MiB": 250.0, "loss": 10.4},
         {"group": "loss", "name": "liger_flce_fp32_accum/llama2_7b", "skipped": "OutOfMemoryError: made up"}]
pairs = [p for p in measure.side_by_side(memkit, peers) if "liger" in p["peer"]]
got = {(p["memkit"], p["peer"]): (p["memkit_ms"], p["peer_ms"], p.get("ratio"), p["peer_skipped"]) for p in pairs}
expect(got.get(("memkit fused_eighth", "liger flce")) == (11.0, 20.0, 0.55, None), f"fused_eighth vs liger: {got}")
expect(got.get(("memkit fused", "liger flce, fp32 accumulation")) == (12.0, None, None, "OutOfMemoryError: made up"),
       f"a skipped Liger row: {got}")
table = {r["implementation"]: r for r in measure.loss_table(memkit, peers) if r["case"] == "llama2_7b"}
expect(set(table) == {"memkit fused", "memkit fused_eighth", "torch materialized", "liger flce",
                      "liger flce, fp32 accumulation"}, f"table rows: {sorted(table)}")
expect(table["liger flce"]["MiB"] == 250.0 and table["liger flce"]["memory_vs_materialized"] == 0.2
       and table["liger flce"]["time_vs_materialized"] == 2.0, f"liger row: {table['liger flce']}")
expect(table["memkit fused_eighth"]["memory_vs_materialized"] == 0.1, f"memkit row: {table['memkit fused_eighth']}")
expect("skipped" in table["liger flce, fp32 accumulation"], "the skipped Liger row is not reported as skipped")
# Liger missing in a new run: its one skipped row is reported for every head, never dropped.
missing = peers[:1] + [{"group": "loss", "name": "liger_flce", "skipped": "liger_kernel does not import here (x)"}]
rows = [r for r in measure.loss_table(memkit, missing) if r["implementation"].startswith("liger")]
expect(len(rows) == 4 and all(r["skipped"].startswith("liger_kernel does not import") for r in rows),
       f"missing Liger: {rows}")

with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    report = {"date": "d", "command": "c", "device": {}, "binaries": "b", "commit": {}, "steps": [], "seconds": 1,
              "benchmarks": memkit, "peers": peers, "side_by_side": [], "loss_peers": measure.loss_table(memkit, peers),
              "peer_wheels": [{"peer": "liger-kernel", "version": "0", "source": "carried wheel x.whl"},
                              {"peer": "bitsandbytes", "skipped": "made up"}]}
    measure.write_report(tmp, report)
    md = (tmp / "results.md").read_text()
    expect("| llama2_7b | liger flce | 20 | 2 | 250 | 0.2 | 10.4 |" in md, "the Liger table row in results.md")
    expect("- peer packages: liger-kernel 0 (carried wheel x.whl); bitsandbytes skipped (made up)" in md,
           "the peer packages line in results.md")

    # Carried wheels: one that imports goes on the path, one that raises is skipped; both recorded.
    wheels = tmp / "wheels"
    wheels.mkdir()
    for name, body in (("good_peer", "VALUE = 1\n"), ("bad_peer", "raise ImportError('made up')\n")):
        with zipfile.ZipFile(wheels / f"{name}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"{name}/__init__.py", body)
            z.writestr(f"{name}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    records, paths = peer_wheels.install(wheels, tmp / "site")
    by = {r["peer"]: r for r in records}
    expect(by.get("good-peer", {}).get("version") == "1.0" and by["good-peer"]["source"].startswith("carried wheel"),
           f"good wheel: {json.dumps(records)}")
    expect("does not import" in by.get("bad-peer", {}).get("skipped", ""), f"bad wheel: {json.dumps(records)}")
    expect(paths == [str(tmp / "site" / "good-peer")], f"PYTHONPATH folders: {paths}")
    expect(all("version" in by[p] or "skipped" in by[p] for p in ("liger-kernel", "bitsandbytes")),
           f"a peer without a record: {json.dumps(records)}")
print("measure_peers_check: ok")
