"""The sglang slice: how the coordinator talks to its engines (concurrency, router, API key, context length,
weight transfer) and the `--sglang-*` flags passed through to `sglang.launch_server`.

Owns these flags. Invariant: `sglang_passthrough` is not a flag of ours: the parser fills it from unknown
`--sglang-*` flags (prefix removed), and a `--config` file cannot set it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.config import values
from coordinator.config.fields import ConfigError, Slice, flag

#: sglang-router's policies (0.3.2's `policy_from_str`; miles' scripts pick consistent_hashing). A policy only picks
#: the engine of a request; those its command line takes (`LAUNCHABLE_POLICIES`) go to the router rayless launches.
ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two", "manual", "bucket", "consistent_hashing",
                   "prefix_hash")
LAUNCHABLE_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two", "manual")
#: --update-weight-transfer-mode → the transfer rayless runs: "broadcast" is miles' name for "distributed" (an
#: NCCL/gloo broadcast group from rank 0 to the engines); miles' "p2p" (each training rank writes its shard into the
#: engines over RDMA) changes only the carrier, so it runs as "distributed" (the notice says so).
TRANSFER_CARRIERS = {"disk": "disk", "distributed": "distributed", "broadcast": "distributed", "p2p": "distributed"}
#: the flag's choices: miles' "disk-delta" is taken so that its refusal can name it
WEIGHT_TRANSFER_MODES = (*TRANSFER_CARRIERS, "disk-delta")


@dataclass(frozen=True)
class SglangConfig(Slice):
    TITLE = "sglang"
    DESCRIPTION = "engine requests, sglang-router, API key and weight transfer"

    sglang_server_concurrency: int = flag(512, help="requests in flight per engine", minimum=1)
    use_sglang_router: bool = flag(False, help="route generate requests through sglang-router")
    use_miles_router: bool = flag(False, help="miles' router (least requests in flight, unhealthy engines left "
                                  "out): rayless' own dispatch does that, so no router process is launched")
    sglang_config: str | None = flag(None, help="slime's/miles' YAML of SGLang server groups: the policy's groups "
                                     "are the rollout engines, `name: eval`'s the eval fleet, each group's "
                                     "engines of its own size, placeholder groups reserving GPUs, each group's "
                                     "overrides on its engines' command lines (docs/engine.md)", metavar="FILE")
    sglang_router_ip: str | None = flag(None, help="attach to a running sglang-router at this address (our engines "
                                        "register with it; none is launched)", parse=values.host, metavar="HOST")
    sglang_router_port: int | None = flag(None, help="port of the running sglang-router (with --sglang-router-ip); "
                                          "alone: launch the router on this port", minimum=1, maximum=65535)
    sglang_router_policy: str = flag("cache_aware", help="sglang-router policy", choices=ROUTER_POLICIES)
    sglang_api_key: str | None = flag(None, help="API key of the engines (sent as Bearer; passed to launched "
                                      "engines in a 0600 file, never on a command line); also asked by every "
                                      "server of the run", secret=True, metavar="KEY", parse=values.api_key)
    allow_unauthenticated: bool = flag(False, help="let a server of the run (status server, session server, "
                                       "engines on other nodes) listen beyond loopback without --sglang-api-key")
    sglang_admin_api_key: str | None = flag(
        None, help="SGLang's --admin-api-key of the engines: the key of their control routes (pause, weight "
        "updates, memory, flush, abort), which the coordinator alone sends; agents see --sglang-api-key at most "
        "(passed to launched engines in the same 0600 file)", secret=True, metavar="KEY", parse=values.api_key)
    sglang_context_length: int | None = flag(None, help="engine context length", minimum=1)
    update_weight_transfer_mode: str = flag("disk", help="how trained weights reach the engines",
                                            choices=WEIGHT_TRANSFER_MODES)
    update_weight_buffer_size: int = flag(512 * 1024**2, help="bytes of parameters per weight-update bucket "
                                          "(slime's flag)", minimum=1)
    update_weight_join_timeout: float = flag(120.0, help="seconds the engines get to join a distributed weight "
                                             "update's group before the update fails naming them", above=0)
    update_weight_ack_timeout: float = flag(600.0, help="seconds each engine gets to acknowledge loading a weight "
                                            "snapshot (/update_weights_from_disk: an update, a resume, a recovered "
                                            "engine) before it is named; with rollout FT it is marked dead and "
                                            "recovered, otherwise the update fails", above=0)
    update_weight_mode: str = flag(
        "full", help="slime: full (every tensor each sync) or delta (rank 0 writes only the tensors whose bytes "
        "changed since the engines' version, against a CPU copy of it; our engines apply and checksum them; disk "
        "transfer only, not with SGLang engines)", choices=("full", "delta"))
    update_weight_transport: str | None = flag(
        None, help="slime's carrier of a weight sync: disk is --update-weight-transfer-mode disk (the default), "
        "nccl is --update-weight-transfer-mode distributed", choices=("nccl", "disk"))
    update_weight_delta_encoding: str = flag(
        "xor", help="slime: a delta's bytes as new ^ old (xor) or changed positions and their bytes (overwrite)",
        choices=("xor", "overwrite"))
    update_weight_delta_checksum: str = flag(
        "xxh3-128", help="slime: the per-tensor checksum of a delta; rayless computes xxh3-128 only",
        choices=("xxh3-128", "blake3", "adler32"))
    pause_generation_mode: str = flag(
        "in_place", help="how in-flight requests wait out a weight update (miles' flag; SGLang's /pause_generation "
        "mode): in_place keeps them and their KV cache, retract re-queues them and recomputes the cache, abort "
        "ends them (the rollout sends them again). miles' default is retract", choices=("in_place", "retract",
                                                                                          "abort"))
    # Filled by the parser from unknown `--sglang-*` flags; not a flag itself.
    sglang_passthrough: tuple[str, ...] = field(default=())

    def check(self) -> None:
        self._check_weight_update()
        if self.launches_router and self.sglang_router_policy not in LAUNCHABLE_POLICIES:
            raise ConfigError(f"--sglang-router-policy {self.sglang_router_policy}: the sglang-router rayless "
                              f"launches takes --policy {' | '.join(LAUNCHABLE_POLICIES)} on its command line; pick "
                              "one of those, or drop --use-sglang-router (rayless then dispatches requests itself)")
        if self.sglang_router_ip is not None and self.sglang_router_port is None:
            raise ConfigError("--sglang-router-ip names a running router: give its --sglang-router-port too "
                              "(--sglang-router-port alone launches the router on that port, as miles does)")

    def _check_weight_update(self) -> None:
        """slime's --update-weight-* flags against rayless' transfer modes (slime's own checks where they agree)."""
        if self.update_weight_transfer_mode == "disk-delta":
            raise ConfigError("--update-weight-transfer-mode disk-delta (miles': deltas published to a shared "
                              "--update-weight-disk-dir, applied by each engine's /pull_weights into a host-local "
                              "checkpoint) is not in rayless: slime's --update-weight-mode delta sends only the "
                              "changed tensors over rayless' disk transfer (rayless' engines only)")
        distributed = self.update_weight_transfer_mode != "disk"
        if self.update_weight_transport == "nccl" and not distributed:
            raise ConfigError("--update-weight-transport nccl is rayless' --update-weight-transfer-mode distributed "
                              "(disk is its default): pass that too, or --update-weight-transport disk")
        if self.update_weight_transport == "disk" and distributed:
            raise ConfigError(f"--update-weight-transport disk with --update-weight-transfer-mode "
                              f"{self.update_weight_transfer_mode}: choose one carrier")
        if self.update_weight_mode == "delta" and distributed:
            raise ConfigError("--update-weight-mode=delta requires --update-weight-transport=disk (slime's rule): "
                              f"drop --update-weight-transfer-mode {self.update_weight_transfer_mode}")
        if self.update_weight_delta_checksum != "xxh3-128":
            raise ConfigError(f"--update-weight-delta-checksum {self.update_weight_delta_checksum}: rayless checks "
                              "deltas with xxh3-128 only (blake3 is not a dependency of rayless; adler32's 32 bits "
                              "are weaker than the default): drop the flag")

    @property
    def launches_router(self) -> bool:
        """The run launches sglang-router: `--use-sglang-router`, or `--sglang-router-port` without an address
        (miles' start_router: the router is launched on the given port) — unless `--use-miles-router` chose
        miles' router over it (miles' start_router), which rayless' own dispatch stands for."""
        return self.sglang_router_ip is None and not self.use_miles_router and (
            self.use_sglang_router or self.sglang_router_port is not None)

    @property
    def router_address(self) -> str | None:
        """HOST:PORT of a running router to attach to, or None."""
        if self.sglang_router_ip is None:
            return None
        host = f"[{self.sglang_router_ip}]" if ":" in self.sglang_router_ip else self.sglang_router_ip
        return f"{host}:{self.sglang_router_port}"
