"""The cluster slice: where training ranks and engines run, how many there are, and how they are reached.

Owns the sizing flags of both halves (training ranks per node and nodes; rollout engines by GPUs, by count or
attached by address), the engine backend and the control channel's address. Invariant: the rollout fleet is
sized by one flag (`--rollout-num-engines` or `--rollout-num-gpus`), and GPUs divide into whole engines.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.config import values
from coordinator.config.fields import ConfigError, Slice, flag

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
        if self.actor_node_rank >= self.actor_num_nodes:
            raise ConfigError(f"--actor-node-rank {self.actor_node_rank} must be below --actor-num-nodes "
                              f"{self.actor_num_nodes}")
