"""What verifying a checkpoint costs against loading it: a ~1 GB checkpoint (model + AdamW state) written by
`save_checkpoint`, then, alternately, the coordinator's full verification (`verify_checkpoint`: manifest sizes
and xxh3-128 digests, DCP metadata against its shards, JSON typed), the ranks' structural one (no digests), and
the load itself (`load_checkpoint` into a fresh model and optimizer: the floor). Also the save's own cost of
writing the manifest, against the save.

    python -m bench.checkpoint_verify --gib 1 --rounds 3

Target: the full verification ≤ 1× the load (`--max-ratio`), since it reads every byte once and the load
does too; exits 1 otherwise. Memory: the verification, whole and of the checkpoint damaged two ways (a byte
flipped at the end of the largest shard: only the digest sees it; the shard truncated), runs in a child
process whose peak resident set (`VmHWM`) is read before and after the verification: it
streams in 8 MiB blocks, so the peak should not grow with the checkpoint. Each damaged run must be refused
naming the shard, or the bench exits 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path

import torch

from workers.host_memory import resident_bytes
from workers.train_rank import checkpoint as ckpt
from workers.train_rank import checkpoint_files as files


def _state(parameters: int) -> dict[str, object]:
    side = int((parameters / 4) ** 0.5)
    model = torch.nn.Sequential(*(torch.nn.Linear(side, side, bias=False) for _ in range(4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.ones(1, side)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler}


def _timed(action) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


#: run in a child: the verification's own peak resident set, apart from this process's 1 GiB of state
_CHILD = """
import json, re, sys, time
import torch.distributed.checkpoint  # what reading DCP's metadata imports: outside the timed verification
from workers.train_rank import checkpoint_files as files

def high_water_kib():  # VmHWM: this process's peak resident set (ru_maxrss would carry the forking parent's)
    with open("/proc/self/status") as status:
        return int(re.search(r"VmHWM:\\s+(\\d+) kB", status.read()).group(1))

before = high_water_kib()
started = time.perf_counter()
try:
    files.verify_checkpoint(sys.argv[1])
    refusal = None
except files.CheckpointError as error:
    refusal = str(error)
print(json.dumps({"seconds": time.perf_counter() - started, "refusal": refusal, "peak_kib": high_water_kib(),
                  "before_kib": before}))
"""


def _verify_in_child(directory: Path) -> dict[str, object]:
    result = subprocess.run([sys.executable, "-c", _CHILD, str(directory)], capture_output=True, text=True,
                            check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _damage_drills(directory: Path) -> bool:
    """Whole, flipped, truncated: each verified in a child; True when both damaged runs were refused naming
    the shard and the whole one passed."""
    shard = max(directory.glob("*.distcp"), key=lambda p: p.stat().st_size)
    ok = True
    for name in ("whole", "flipped byte", "truncated"):
        if name == "flipped byte":
            with shard.open("r+b") as handle:
                handle.seek(-1, 2)
                last = handle.read(1)
                handle.seek(-1, 2)
                handle.write(bytes([last[0] ^ 0x01]))
        elif name == "truncated":
            with shard.open("r+b") as handle:
                handle.truncate(shard.stat().st_size // 2)
        outcome = _verify_in_child(directory)
        refusal = outcome["refusal"]
        right = refusal is None if name == "whole" else isinstance(refusal, str) and str(shard) in refusal
        ok &= right
        peak, before = int(outcome["peak_kib"]) / 1024, int(outcome["before_kib"]) / 1024  # type: ignore[call-overload]
        print(f"verify, {name}: {outcome['seconds']:.2f} s, peak resident set {peak:.0f} MiB ({peak - before:.1f} "
              f"MiB above the process's peak after its imports); " + ("passed" if refusal is None else
                                                                  f"refused: {str(refusal)[len(str(directory)) + 1:]}")
              + ("" if right else "  <-- WRONG"))
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size (model + 2 AdamW moments)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-ratio", type=float, default=1.0)
    parser.add_argument("--dir", default=None, help="where to write it (default: a temporary directory)")
    options = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    root = Path(tempfile.mkdtemp(prefix="ckpt-verify-", dir=options.dir))
    try:
        parameters = int(options.gib * 2**30 / 4 / 3)
        state = _state(parameters)
        save_s = _timed(partial(ckpt.save_checkpoint, root, 1, extra={}, **state))
        directory = root / "rollout_1"
        size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
        manifest_s = _timed(lambda: files.write_manifest(directory))
        print(f"checkpoint {size / 2**30:.2f} GiB: save {save_s:.2f} s, of which the manifest {manifest_s:.2f} s "
              f"({100 * manifest_s / save_s:.0f} %)")
        state.clear()
        full, structural, loads = [], [], []
        peak_growth = 0
        for _ in range(options.rounds):
            before = resident_bytes()
            full.append(_timed(lambda: files.verify_checkpoint(directory)))
            peak_growth = max(peak_growth, resident_bytes() - before)
            structural.append(_timed(lambda: files.verify_checkpoint(directory, digests=False)))
            loads.append(_timed(partial(ckpt.load_checkpoint, root, **_state(parameters))))
        verify, structure, load = (statistics.median(x) for x in (full, structural, loads))
        ratio = verify / load
        print(f"verify (digests) {verify:.2f} s, {size / 2**30 / verify:.2f} GiB/s; structure only {structure:.3f} s;"
              f" load (floor) {load:.2f} s; verify/load {ratio:.2f} (target ≤ {options.max_ratio}); resident growth "
              f"during a verify {peak_growth / 2**20:.1f} MiB")
        drills_ok = _damage_drills(directory)  # last: it damages the checkpoint
        return 0 if ratio <= options.max_ratio and drills_ok else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
