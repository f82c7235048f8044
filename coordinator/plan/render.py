"""The placement plan as text: what `--dry-run` prints and what a launch writes to `<run_dir>/plan.txt`.

Owns the wording only; every fact comes from the plan's slots, so the text shows exactly what is launched.
Invariant: no secret is printed — commands pass through `mask_argv` (an `--api-key` value is `***`), and
an environment variable whose name looks secret (`*_TOKEN`, `*_KEY`) shows `***`.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from coordinator.config.fields import looks_secret
from coordinator.config.secrets import MASK, mask_argv
from coordinator.plan.records import EngineSlot, NodePlan, PlacementPlan, RanksSlot, RouterSlot


def gpu_text(positions: Iterable[int]) -> str:
    """`4`, `0-3`, `0,2,5`; `-` for none."""
    gpus = sorted(positions)
    if not gpus:
        return "-"
    if len(gpus) > 2 and gpus == list(range(gpus[0], gpus[-1] + 1)):
        return f"{gpus[0]}-{gpus[-1]}"
    return ",".join(map(str, gpus))


def size_text(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} bytes"


def where_text(slot: RanksSlot | EngineSlot | RouterSlot) -> str:
    """Short placement of one process, for the start-up board: `GPU 4 · port 35001`."""
    if isinstance(slot, RouterSlot):
        return f"port {slot.port}"
    device = f"GPU {gpu_text(slot.gpus)}" if slot.gpus else "CPU"
    if isinstance(slot, RanksSlot):
        return f"{device} · {slot.spec.nproc_per_node} rank(s)"
    return f"{device} · port {slot.port}"


def describe_plan(plan: PlacementPlan, *, detail: bool = True) -> str:
    """The plan; `detail` adds each process's environment and full command line."""
    lines = [f"placement plan (policy {plan.policy}: " + _policy_text(plan.policy) + ")"]
    for choice, group in ((plan.rollout_choice, "rollout"), (plan.eval_choice, "eval")):
        if choice is not None:
            lines.append(f"{group} engines: {choice.backend} on {choice.device} ({choice.reason})")
    for address in plan.external_engines:
        lines.append(f"attached rollout engine (not launched): {address}")
    if plan.swap is not None:
        lines.append(swap_text(plan))
    if plan.layout is not None:
        lines += plan.layout.describe()
        lines += [f"  node {node}{' (this node)' if node == plan.node_rank else ''}: {ranks} training rank(s), "
                  f"{rollout} rollout engine(s)" + (f", {eval_} eval engine(s)" if eval_ else "")
                  for node, ranks, rollout, eval_ in plan.shares]
    sync = plan.weight_sync
    if sync is not None:
        lines.append(f"weight sync: {sync.mode} (--update-weight-transfer-mode), bucket size "
                     f"{size_text(sync.bucket_bytes)} (--update-weight-buffer-size {sync.bucket_bytes}): "
                     f"{sync.detail}")
    for node in plan.nodes:
        lines += _node_lines(node, detail=detail)
    return "\n".join(lines)


def _policy_text(policy: str) -> str:
    return {"separate": "no two processes share a GPU",
            "colocate": "--colocate: the rollout engines run on the training ranks' GPUs and take turns with "
                        "them each step"}.get(
        policy, policy)


def swap_text(plan: PlacementPlan) -> str:
    """The per-step schedule of the memory hand-over (`coordinator.weights.colocate`), as the run follows it."""
    swap = plan.swap
    assert swap is not None
    phases = ["generate"]
    if swap.offload_rollout:
        phases.append("engines release memory (weights, kv_cache, cuda_graph)")
    if swap.offload_train:
        phases.append("ranks bring parameters, gradients and optimizer state back")
    phases.append("train")
    if swap.offload_train:
        phases.append("ranks offload (to host memory on CUDA; on CPU ranks, to a file under the run "
                      "directory's train-offload/)")
    if swap.offload_rollout:
        phases.append("engines take their weights back")
    phases.append("weight update")
    if swap.offload_rollout:
        phases.append("engines take their KV cache back")
    margin = (f"; --train-memory-margin-bytes {swap.train_memory_margin_bytes} must stay free on CUDA when the "
              "ranks bring their state back" if swap.offload_train else "")
    return ("memory hand-over each step (--offload-train " + ("on" if swap.offload_train else "off")
            + ", --offload-rollout " + ("on" if swap.offload_rollout else "off") + "): "
            + " → ".join(phases) + margin)


def _node_lines(node: NodePlan, *, detail: bool) -> list[str]:
    lines = ["", f"node {node.node_rank}: {node.gpus.describe()}; this plan uses {node.gpus_needed}"]
    rows = [("PROCESS", "GPUS", "DEVICE", "PORTS")]
    for slot in node.processes():
        rows.append((slot.name, _gpus_column(node, slot), _device(slot), _ports(slot)))
    if node.reserved_gpus:  # --sglang-config's placeholder groups
        rows.append(("reserved", gpu_text(node.reserved_gpus), "-", "placeholder server groups: no engine"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines += ["  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    if detail:
        for slot in node.processes():
            lines += ["", *_process_lines(slot)]
    return lines


def _gpus_column(node: NodePlan, slot: RanksSlot | EngineSlot | RouterSlot) -> str:
    if isinstance(slot, RouterSlot) or not slot.gpus:
        return "-"
    shown = gpu_text(slot.gpus)
    ids = node.gpus.visible_devices(slot.gpus)
    if ids != ",".join(map(str, slot.gpus)):
        shown += f" (CUDA ids {ids})"
    others = {gpu for other in node.processes() if other is not slot for gpu in other.gpus}
    if others.intersection(slot.gpus):
        shown += " shared"
    return shown


def _device(slot: RanksSlot | EngineSlot | RouterSlot) -> str:
    if isinstance(slot, RouterSlot):
        return "cpu (sglang-router)"
    if isinstance(slot, RanksSlot):
        return "cuda (nccl)" if slot.device == "cuda" else "cpu (gloo)"
    tp = f", tp {len(slot.gpus)}" if slot.choice.backend == "sglang" else ""
    return f"{slot.choice.device} ({slot.choice.backend}{tp})"


def _ports(slot: RanksSlot | EngineSlot | RouterSlot) -> str:
    if isinstance(slot, RanksSlot):
        rendezvous = "torchrun --standalone" if "--standalone" in slot.command() else "torchrun c10d rendezvous"
        return f"control {slot.control_address}; {rendezvous}"
    if isinstance(slot, RouterSlot):
        return f"http {slot.host}:{slot.port}, prometheus {slot.prometheus_port}"
    return f"http {slot.spec.host}:{slot.port}"


def _process_lines(slot: RanksSlot | EngineSlot | RouterSlot) -> list[str]:
    if isinstance(slot, RanksSlot):
        head = (f"{slot.name}: {slot.spec.nproc_per_node} rank(s) on this node, "
                + ("LOCAL_RANK i on the i-th GPU of CUDA_VISIBLE_DEVICES" if slot.gpus else "gloo on the CPU"))
        env = slot.environment()
    elif isinstance(slot, EngineSlot):
        head = f"{slot.name}: {slot.choice.backend} on {where_text(slot)}"
        env = dict(slot.spec.env)
    else:
        head = f"{slot.name}: sglang-router, policy {slot.policy}"
        env = {}
    lines = [head, f"  log  {slot.log}"]
    shown_env = [f"{key}={MASK if looks_secret(key) else value}" for key, value in env.items()]
    lines.append("  env  " + (" ".join(shown_env) if shown_env else "(the coordinator's, unchanged)"))
    lines.append("  cmd  " + shlex.join(mask_argv(slot.command())))
    return lines
