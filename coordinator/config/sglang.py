"""The sglang slice: how the coordinator talks to its engines (concurrency, router, API key, context length,
weight transfer) and the `--sglang-*` flags passed through to `sglang.launch_server`.

Owns these flags. Invariant: `sglang_passthrough` is not a flag of ours: the parser fills it from unknown
`--sglang-*` flags (prefix removed), and a `--config` file cannot set it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.config.fields import Slice, flag

ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")
WEIGHT_TRANSFER_MODES = ("disk", "distributed")


@dataclass(frozen=True)
class SglangConfig(Slice):
    TITLE = "sglang"
    DESCRIPTION = "engine requests, sglang-router, API key and weight transfer"

    sglang_server_concurrency: int = flag(512, help="requests in flight per engine", minimum=1)
    use_sglang_router: bool = flag(False, help="route generate requests through sglang-router")
    sglang_router_policy: str = flag("cache_aware", help="sglang-router policy", choices=ROUTER_POLICIES)
    sglang_api_key: str | None = flag(None, help="API key of the engines (sent as Bearer; passed to launched "
                                      "engines)", secret=True, metavar="KEY")
    sglang_context_length: int | None = flag(None, help="engine context length", minimum=1)
    update_weight_transfer_mode: str = flag("disk", help="how trained weights reach the engines",
                                            choices=WEIGHT_TRANSFER_MODES)
    update_weight_buffer_size: int = flag(512 * 1024**2, help="bytes of parameters per weight-update bucket "
                                          "(slime's flag)", minimum=1)
    # Filled by the parser from unknown `--sglang-*` flags; not a flag itself.
    sglang_passthrough: tuple[str, ...] = field(default=())
