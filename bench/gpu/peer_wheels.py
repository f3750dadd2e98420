"""The PyTorch peers memkit carries to a GPU machine as wheels (issue #30), and their installation there.

A GPU machine may have torch, transformers and peft but no package registry, and a visit carries at most 64 MiB
of files (the CUDA binaries of build-gpu/carry/ are about 15 MiB of it). So:

  stage DIR    (./dev.sh gpu-build, on a machine with a registry) downloads the newest linux x86_64 wheels of the
               peers below with `python3 -m pip download` into DIR (build-gpu/carry/wheels/), slims bitsandbytes'
               to the CUDA 13 libraries (the full wheel is 43 MB: a library for every CUDA and ROCm release), and
               keeps only what fits under --carry-limit counted over DIR's parent (the binaries included).
               No network: one line, nothing staged, exit 0.
  install DIR SITE  (bench/gpu/measure.py, at the start of a GPU run) unpacks each wheel of DIR into SITE/<name>
               (wheels are zips: no pip needed), imports it with this python in a child process, and returns one
               record per peer: its version and folder, or why it is skipped. A peer the machine already has is
               not overridden (its own build matches its torch); a wheel that fails to import is skipped, not put
               on PYTHONPATH.

flash-attn is not carried: PyPI has only its source (building it takes hours of nvcc); its prebuilt wheels are
GitHub release files, one per torch / CUDA / python / C++ ABI (docs/cuda.md, "The carried peers").
Standard library only.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor

sys.dont_write_bytecode = True

# (distribution on PyPI, the module whose import proves the peer usable, what the peer is for)
PEERS = [
    ("liger-kernel", "liger_kernel.transformers", "LigerFusedLinearCrossEntropyLoss: the loss rows"),
    ("bitsandbytes", "bitsandbytes", "4-bit dequantize / matmul / GEMV, 8-bit AdamW"),
]
# bitsandbytes' libraries kept: CPU and CUDA 13.x (the GPU machine's torch was 2.11.0+cu130 on its last visit,
# docs/gpu/). MEMKIT_GPU_BNB_CUDA="128" (say) keeps CUDA 12.8's instead (the CUDA 12 ones are 21-27 MB unpacked).
BNB_CUDA_DEFAULT = "130 132"
CARRY_LIMIT_MIB = 60


def tree_bytes(path):
    return sum(p.stat().st_size for p in pathlib.Path(path).rglob("*") if p.is_file())


def slim_bitsandbytes(wheel, keep_cuda):
    """Rewrites the wheel without the native libraries other than libbitsandbytes_cpu and the CUDA versions in
    keep_cuda; RECORD keeps listing what was dropped (pip is not used to install it; measure.py unzips it)."""
    keep = {"libbitsandbytes_cpu.so"} | {f"libbitsandbytes_cuda{v}.so" for v in keep_cuda}
    slim = wheel.with_name(wheel.name + ".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        dropped = 0
        for info in src.infolist():
            name = info.filename.rsplit("/", 1)[-1]
            if name.startswith("libbitsandbytes_") and name.endswith(".so") and name not in keep:
                dropped += 1
                continue
            dst.writestr(info, src.read(info))
    before = wheel.stat().st_size
    slim.replace(wheel)
    return before, dropped


def stage(dest, carry_limit_mib, python_version, pip):
    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    keep_cuda = os.environ.get("MEMKIT_GPU_BNB_CUDA", BNB_CUDA_DEFAULT).split()
    staged, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for dist, _, _ in PEERS:
            cmd = pip + ["download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
                         "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
                         "manylinux_2_24_x86_64", "--platform", "any", "-d", tmp, dist]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired) as e:
                proc = None
                why = str(e)
            else:
                why = (proc.stderr.strip().splitlines() or ["?"])[-1]
            wheels = sorted(pathlib.Path(tmp).glob(dist.replace("-", "_") + "-*.whl"))
            if proc is None or proc.returncode != 0 or not wheels:
                failed.append(f"{dist}: {why[:160]}")
                continue
            wheel = wheels[-1]
            note = ""
            if dist == "bitsandbytes":
                before, dropped = slim_bitsandbytes(wheel, keep_cuda)
                note = (f" (slimmed from {before / 2**20:.1f} MiB: {dropped} native libraries dropped, kept CPU and "
                        f"CUDA {', '.join(keep_cuda)})")
            staged.append((wheel, note))
        if not staged:  # no registry here: one line, nothing staged
            print(f"memkit peer wheels: none downloaded (no package registry?): {'; '.join(failed)}")
            return 0
        for f in failed:
            print(f"memkit peer wheels: not downloaded: {f}")
        # Smallest first, so that one wheel too big does not crowd out the others.
        for wheel, note in sorted(staged, key=lambda w: w[0].stat().st_size):
            total = tree_bytes(dest.parent) + wheel.stat().st_size
            if total > carry_limit_mib * 2**20:
                print(f"memkit peer wheels: {wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB would take the "
                      f"carry to {total / 2**20:.1f} MiB (> {carry_limit_mib} MiB): not staged")
                continue
            target = dest / wheel.name
            wheel.replace(target)
            print(f"memkit peer wheels: staged {target.name}: {target.stat().st_size / 2**20:.1f} MiB{note}")
    print(f"memkit peer wheels: {dest.parent} holds {tree_bytes(dest.parent) / 2**20:.1f} MiB in all")
    return 0


def import_name(wheel_name):
    dist = wheel_name.split("-")[0].replace("_", "-").lower()
    for d, module, _ in PEERS:
        if d == dist:
            return d, module
    return dist, dist.replace("-", "_")


PROBE = ("import importlib, importlib.metadata, json, sys\n"
         "m = importlib.import_module(sys.argv[1])\n"
         "print(json.dumps({'version': importlib.metadata.version(sys.argv[2]), 'file': m.__file__}))\n")


def probe(module, dist, env, python):
    """Imports module with python in a child process (a native library that crashes cannot take the run down)."""
    try:
        proc = subprocess.run([python, "-c", PROBE, module, dist], capture_output=True, text=True, timeout=180, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{type(e).__name__}: {e}"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        try:
            return json.loads(lines[-1]), None
        except ValueError:
            pass
    err = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    return None, (err[-1] if err else f"exit {proc.returncode}")[:200]


def install(wheel_dir, site, python=sys.executable, env=None):
    """Unpacks and checks each wheel of wheel_dir; returns (records, folders to put on PYTHONPATH). The imports run
    side by side (each child imports torch: seconds), first the machine's own peers, then the carried wheels."""
    env = dict(os.environ if env is None else env)
    wheels = sorted(pathlib.Path(wheel_dir).glob("*.whl")) if wheel_dir and pathlib.Path(wheel_dir).is_dir() else []
    carried = {import_name(w.name)[0]: w for w in wheels}
    with ThreadPoolExecutor(max_workers=4) as pool:
        own = list(pool.map(lambda peer: probe(peer[1], peer[0], env, python), PEERS))
        records, trials = [], []
        for (dist, module, _), (found, why_not) in zip(PEERS, own):
            wheel = carried.pop(dist, None)
            if found is not None:
                records.append({"peer": dist, "version": found["version"], "source": "the machine's own",
                                "path": found["file"]} | ({"wheel_not_used": wheel.name} if wheel else {}))
            elif wheel is None:
                records.append({"peer": dist, "skipped": f"not installed here ({why_not}) and no wheel carried"})
            else:
                trials.append((dist, module, wheel))
        # A wheel of a peer not in PEERS is unpacked and checked the same way.
        trials += [(dist, dist.replace("-", "_"), wheel) for dist, wheel in carried.items()]
        tried = list(pool.map(lambda t: unpack_and_probe(*t, site, env, python), trials))
    records += [record for record, _ in tried]
    return records, [folder for _, folder in tried if folder]


def unpack_and_probe(dist, module, wheel, site, env, python):
    """(record, the folder for PYTHONPATH or None)."""
    folder = pathlib.Path(site) / dist
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(folder)
    except (OSError, zipfile.BadZipFile) as e:
        return {"peer": dist, "wheel": wheel.name, "skipped": f"could not unpack: {e}"}, None
    trial = dict(env, PYTHONPATH=os.pathsep.join([str(folder)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])))
    got, why = probe(module, dist, trial, python)
    if got is None:
        return {"peer": dist, "wheel": wheel.name, "skipped": f"the carried wheel does not import: {why}"}, None
    return {"peer": dist, "version": got["version"], "source": f"carried wheel {wheel.name}", "path": got["file"]}, str(folder)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stage", help="download and slim the peers' wheels into DIR (build-gpu/carry/wheels)")
    s.add_argument("dir")
    s.add_argument("--carry-limit", type=float, default=CARRY_LIMIT_MIB,
                   help=f"MiB the whole carry (DIR's parent) may hold (default {CARRY_LIMIT_MIB})")
    s.add_argument("--python-version", default="3.12",
                   help="the GPU machine's python (default 3.12; the peers' wheels are py3-none today)")
    i = sub.add_parser("install", help="unpack DIR's wheels into SITE and check they import (prints JSON)")
    i.add_argument("dir")
    i.add_argument("site")
    args = parser.parse_args()
    if args.command == "stage":
        return stage(args.dir, args.carry_limit, args.python_version, [sys.executable, "-m", "pip"])
    records, paths = install(args.dir, args.site)
    print(json.dumps({"peers": records, "pythonpath": paths}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
