"""The cluster slice: where training ranks and engines run, how many there are, and how they are reached.

Owns the sizing flags of both halves (training ranks per node and nodes; rollout engines by GPUs, by count or
attached by address), colocation and its memory hand-over (`--colocate`, `--offload-train`,
`--offload-rollout`, miles' `--num-gpus-per-node` and `--train-memory-margin-bytes`), the engine backend and
the control channel's address. Invariant: the rollout fleet is sized by one flag (`--rollout-num-engines` or
`--rollout-num-gpus`), and GPUs divide into whole engines. `--colocate` sizes it as slime does: its
`--rollout-num-gpus` is the training GPUs (`resolve_colocation`, applied before the slice is built).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from coordinator.config import values
from coordinator.config.fields import ConfigError, ConfigWarning, Slice, flag

#: auto: SGLang on GPUs where installed, else our engine on CUDA; fleets sized in engines run ours on the CPU.
#: rayless: our engine on the device the plan gives it. sglang: SGLang on GPUs. cpu: our engine on the CPU.
#: (`coordinator.plan.backend` resolves them.)
ENGINE_BACKENDS = ("auto", "rayless", "sglang", "cpu")


@dataclass(frozen=True)
class ClusterConfig(Slice):
    TITLE = "cluster"
    DESCRIPTION = "training ranks, rollout engines and the control channel"

    actor_num_nodes: int = flag(1, help="nodes of training ranks", minimum=1)
    actor_num_gpus_per_node: int = flag(1, help="training ranks per node (GPUs, or gloo processes on CPU)",
                                        minimum=1)
    actor_node_rank: int = flag(0, help="this node's rank for multi-node torchrun", minimum=0)
    rdzv_endpoint: str | None = flag(None, help="torchrun rendezvous endpoint HOST:PORT for multi-node training",
                                     parse=values.host_port, metavar="HOST:PORT")
    rollout_num_gpus: int | None = flag(None, help="GPUs for rollout engines (SGLang, or our engine on CUDA)",
                                        minimum=0)
    rollout_num_gpus_per_engine: int = flag(1, help="GPUs per rollout engine (tensor parallel size)", minimum=1)
    rollout_num_engines: int | None = flag(None, help="CPU rollout engines to launch", minimum=0)
    rollout_external_engine_addrs: tuple[str, ...] = flag(
        (), help="attach to running engines at these HOST:PORT addresses", parse=values.engine_address, metavar="HOST:PORT")
    engine_backend: str = flag("auto", help="engine implementation: auto (SGLang on GPUs where it is installed, "
                               "else our engine on CUDA; our engine on the CPU for --rollout-num-engines), "
                               "rayless (our engine, on the GPUs the plan gives it or the CPU), sglang, cpu "
                               "(our engine on the CPU)", choices=ENGINE_BACKENDS)
    colocate: bool = flag(False, help="slime/miles: the rollout engines run on the training ranks' GPUs and take "
                          "turns with them each step (engines release their memory while the ranks train, the "
                          "ranks offload while the engines generate); --rollout-num-gpus becomes the training "
                          "GPUs; implies --offload-train and --offload-rollout")
    offload_train: bool | None = flag(None, help="the training ranks' parameters, gradients and optimizer state "
                                      "leave the device between steps and come back for the step (default: on "
                                      "with --colocate)")
    offload_rollout: bool | None = flag(None, help="the rollout engines release their weights and KV cache "
                                        "(/release_memory_occupation) while the ranks train, and take them back "
                                        "before the weight update (default: on with --colocate)")
    offload: bool = flag(False, help="slime's --offload: --offload-train and --offload-rollout together")
    num_gpus_per_node: int | None = flag(None, help="miles: the GPUs each node has for the run; the plan uses "
                                         "at most this many of the GPUs a node shows (default: all of them)",
                                         minimum=1)
    train_memory_margin_bytes: int = flag(1024**3, help="miles: with --offload-train on CUDA, the device "
                                          "memory that must stay free beyond the training state when the ranks "
                                          "bring it back, checked before they do (no effect on CPU ranks)",
                                          minimum=0)
    control_host: str = flag("127.0.0.1", help="address the control channel listens on (127.0.0.1 unless "
                             "multi-node)", parse=values.host, metavar="HOST")
    control_port: int = flag(0, help="control channel port (0 = any free port; multi-node: the rendezvous port "
                             "+ 1, and the node registry listens on the next port)", minimum=0, maximum=65535)
    control_token_file: str | None = flag(None, help="multi-node: the control token in a file on a filesystem "
                                          "every node shares (node 0 creates it, mode 0600, when absent; the "
                                          "others read it). Default: RAYLESS_CONTROL_TOKEN from the launcher's "
                                          "environment", metavar="PATH", secret=False)

    def check(self) -> None:
        if self.rollout_num_gpus is not None and self.rollout_num_gpus % self.rollout_num_gpus_per_engine:
            raise ConfigError(
                f"--rollout-num-gpus {self.rollout_num_gpus} is not divisible by "
                f"--rollout-num-gpus-per-engine {self.rollout_num_gpus_per_engine}"
            )
        if self.rollout_num_engines is not None and self.rollout_num_gpus is not None:
            raise ConfigError("--rollout-num-engines (CPU engines) and --rollout-num-gpus both size the rollout "
                              "fleet: give one")
        if self.colocate and self.rollout_external_engine_addrs:
            raise ConfigError("--colocate launches the rollout engines on the training GPUs; "
                              "--rollout-external-engine-addrs attaches engines running elsewhere: drop one")
        if self.actor_node_rank >= self.actor_num_nodes:
            raise ConfigError(f"--actor-node-rank {self.actor_node_rank} must be below --actor-num-nodes "
                              f"{self.actor_num_nodes}")


def resolve_colocation(given: dict[str, Any]) -> dict[str, Any]:
    """slime's and miles' sizing under `--colocate`: the rollout engines get the training GPUs
    (`--actor-num-nodes` × `--actor-num-gpus-per-node`), whatever `--rollout-num-gpus` said (miles overrides
    it with a message; so does this, as a warning). A fleet sized in CPU engines (`--rollout-num-engines`) keeps
    its size: that is colocation on the CPU. `given`: converted flag values by field name."""
    if not given.get("colocate") or given.get("rollout_num_engines") is not None:
        return given
    defaults = {spec.name: spec.default for spec in ClusterConfig.specs()}
    nodes = given.get("actor_num_nodes", defaults["actor_num_nodes"])
    per_node = given.get("actor_num_gpus_per_node", defaults["actor_num_gpus_per_node"])
    asked = given.get("rollout_num_gpus")
    if asked is not None and asked != nodes * per_node:
        warnings.warn(f"--colocate: the rollout engines run on the {nodes * per_node} training GPUs "
                      f"(--actor-num-nodes {nodes} × --actor-num-gpus-per-node {per_node}); --rollout-num-gpus "
                      f"{asked} is replaced by {nodes * per_node}", ConfigWarning, stacklevel=3)
    return {**given, "rollout_num_gpus": nodes * per_node}
