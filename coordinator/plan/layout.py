"""Which node this process is, and how every node finds node 0: the layout of a multi-node run.

Owns `resolve_layout`, the one place where the launcher's environment is read, and `NodeLayout`, what it
decides: this node's rank (`--actor-node-rank`, `SLURM_NODEID`, `NODE_RANK`), node 0's host and rendezvous port
(`--rdzv-endpoint`, `MASTER_ADDR`/`MASTER_PORT`, the first host of SLURM's node list, expanded by
`expand_nodelist`), the control-channel and registry ports, what node 0 binds and what nodes dial, and where the
token comes from. The rules in full: docs/multi-node.md.

Invariants: a single-node run never reads the environment; every inconsistency (a node rank out of range,
`SLURM_NNODES` other than `--actor-num-nodes`, no node 0 address, no token source, a loopback `--control-host`
with a remote node 0) is a `ConfigError` naming the flag or variable, or a warning with a placeholder in a
lenient (`--dry-run`) layout.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from coordinator.config.fields import ConfigError
from coordinator.config.settings import Config
from coordinator.plan.token import TokenSource, token_source

DEFAULT_MASTER_PORT = 29500
WILDCARD_HOSTS = ("0.0.0.0", "::")
#: Set in every multi-node torchrun's environment. torch 2.x shares one TCP store between the rendezvous and
#: the ranks' bootstrap; a node whose torchrun is replaced (the node's process restarted after it died) then
#: waits forever for a MASTER_ADDR key the surviving rank-0 agent never writes again (seen with torch 2.13).
#: With sharing off every round publishes its own, so a restarted node rejoins.
TORCH_RDZV_STORE_ENV = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")

#: Records a problem: raises ConfigError, or in a lenient layout keeps it as a warning.
ProblemSink = Callable[[str], None]


def expand_nodelist(text: str) -> list[str]:
    """SLURM's hostlist expression → host names in order: `node[01-03,07],gpu5` → node01 node02 node03 node07 gpu5.

    Brackets hold comma-separated numbers and ranges (zero padding kept); several bracket groups in one name
    expand as a product, leftmost slowest (`r[1-2]n[1-2]` → r1n1 r1n2 r2n1 r2n2)."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        if not item:
            raise ValueError(f"empty host name in {text!r}")
        parts = re.split(r"(\[[^\]]*\])", item)
        choices: list[list[str]] = []
        for part in parts:
            if part.startswith("["):
                choices.append(_expand_brackets(part[1:-1], text))
            elif "[" in part or "]" in part:
                raise ValueError(f"unbalanced brackets in {text!r}")
            else:
                choices.append([part])
        hosts += ["".join(combination) for combination in itertools.product(*choices)]
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for character in text:
        if character == "[":
            depth += 1
        elif character == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced brackets in {text!r}")
        if character == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += character
    if depth:
        raise ValueError(f"unbalanced brackets in {text!r}")
    return [*items, current]


def _expand_brackets(body: str, text: str) -> list[str]:
    values: list[str] = []
    for piece in body.split(","):
        low, dash, high = piece.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{piece!r} in {text!r} is not a number or a range of numbers")
        if not dash:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"range {piece!r} in {text!r} runs backwards")
        width = len(low) if low.startswith("0") else 0
        values += [str(number).zfill(width) for number in range(int(low), int(high) + 1)]
    return values


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (checked without DNS: `localhost`, 127.0.0.0/8, ::1)."""
    bare = host.strip("[]")
    if bare.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to `host` (what a connection to it would come from); no packet is
    sent. OSError when `host` does not resolve or no route leads there."""
    infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_DGRAM)
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


@dataclass(frozen=True)
class NodeLayout:
    """What every node of a multi-node run agrees on, and which node this one is."""

    node_rank: int
    num_nodes: int
    #: node 0's host, as every node dials it (the rendezvous host)
    master_host: str
    rdzv_port: int
    #: what node 0's control channel and node registry listen on
    control_bind: str
    #: what every node (node 0's own ranks included) dials for both
    control_host: str
    control_port: int
    registry_port: int
    token: TokenSource
    #: where the node rank and node 0's address came from, in words
    source: str

    @property
    def is_coordinator(self) -> bool:
        return self.node_rank == 0

    @property
    def rdzv_endpoint(self) -> str:
        return join_host_port(self.master_host, self.rdzv_port)

    @property
    def control_address(self) -> str:
        return join_host_port(self.control_host, self.control_port)

    @property
    def registry_address(self) -> str:
        return join_host_port(self.control_host, self.registry_port)

    def engine_host(self) -> str:
        """Where this node's engines listen: 127.0.0.1 on node 0 (only its coordinator calls them), else the
        address this node reaches node 0 from (node 0 calls them there). OSError when node 0 is unreachable."""
        if self.is_coordinator:
            return "127.0.0.1"
        return route_address(self.control_host, self.registry_port)

    def describe(self) -> list[str]:
        """The layout for the plan's printout (no secret: the token's source, never its value)."""
        role = "the coordinator (node 0)" if self.is_coordinator else f"node {self.node_rank}, not the coordinator"
        others, verb = (("node 1", "reports its") if self.num_nodes == 2
                        else (f"nodes 1..{self.num_nodes - 1}", "report their"))
        return [
            f"nodes: {self.num_nodes}; this is {role} ({self.source})",
            f"  rendezvous  torchrun c10d at {self.rdzv_endpoint} (hosted by node 0's torchrun)",
            f"  control     ranks dial {self.control_address} (node 0 listens on "
            f"{join_host_port(self.control_bind, self.control_port)})",
            f"  registry    {others} {verb} engines to {self.registry_address}",
            f"  token       {self.token.describe()}",
        ]


def resolve_layout(config: Config, environ: Mapping[str, str] | None = None, *, lenient: bool = False
                   ) -> tuple[Config, NodeLayout | None, list[str]]:
    """(config with this node's rank, rendezvous endpoint and control address filled in, the layout, warnings);
    a single-node config is returned unchanged with no layout. ConfigError on what cannot work (a warning and a
    placeholder instead when `lenient`)."""
    cluster = config.cluster
    if cluster.actor_num_nodes == 1:
        return config, None, []
    env = os.environ if environ is None else environ
    warnings: list[str] = []

    def problem(message: str) -> None:
        if not lenient:
            raise ConfigError(message)
        warnings.append(message)

    nodes = cluster.actor_num_nodes
    node_rank, rank_source = _node_rank(config, env, problem)
    master_host, rdzv_port, master_source = _master(config, env, problem)
    slurm_nodes = env.get("SLURM_NNODES")
    if slurm_nodes is not None and rank_source.startswith("SLURM_NODEID") and slurm_nodes != str(nodes):
        problem(f"srun started the command on SLURM_NNODES={slurm_nodes} nodes, but --actor-num-nodes is {nodes}: "
                "run one task per node of the job (srun --ntasks-per-node 1) with a matching --actor-num-nodes")
    bind = cluster.control_host
    if is_loopback(bind) and not is_loopback(master_host):
        if "control_host" in config.given:
            problem(f"--control-host {bind} cannot be reached from the other nodes (node 0 is {master_host}): "
                    "give an address of node 0 they reach, or 0.0.0.0")
        bind = "0.0.0.0"
    dial = master_host if bind in WILDCARD_HOSTS else bind
    control_port = cluster.control_port or rdzv_port + 1
    if control_port + 1 > 65535:
        problem(f"--control-port {control_port}: the node registry needs the next port too (at most 65534)")
        control_port = 65534
    token, token_warnings = token_source(config, env, lenient=lenient)
    warnings += token_warnings
    layout = NodeLayout(node_rank=node_rank, num_nodes=nodes, master_host=master_host, rdzv_port=rdzv_port,
                        control_bind=bind, control_host=dial, control_port=control_port,
                        registry_port=control_port + 1, token=token,
                        source=f"{rank_source}; node 0 from {master_source}")
    resolved = dataclasses.replace(cluster, actor_node_rank=node_rank, rdzv_endpoint=layout.rdzv_endpoint,
                                   control_host=bind, control_port=control_port)
    return dataclasses.replace(config, cluster=resolved), layout, warnings


def _node_rank(config: Config, env: Mapping[str, str], problem: ProblemSink) -> tuple[int, str]:
    nodes = config.cluster.actor_num_nodes
    if "actor_node_rank" in config.given:
        return config.cluster.actor_node_rank, f"--actor-node-rank {config.cluster.actor_node_rank}"
    for variable in ("SLURM_NODEID", "NODE_RANK"):
        value = env.get(variable)
        if value is None or (variable == "SLURM_NODEID" and _slurm_nodelist(env) is None):
            continue
        if not value.isdigit() or int(value) >= nodes:
            problem(f"{variable}={value!r}: expected this node's rank, 0..{nodes - 1} (--actor-num-nodes {nodes})")
            return 0, f"{variable} (invalid)"
        return int(value), f"{variable}={value}"
    problem(f"--actor-num-nodes {nodes}: this node's rank is unknown: run the command under srun (one task per "
            "node: SLURM_NODEID), set NODE_RANK, or give --actor-node-rank")
    return 0, "no node rank (assumed 0)"


def _slurm_nodelist(env: Mapping[str, str]) -> tuple[str, str] | None:
    for variable in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(variable):
            return variable, env[variable]
    return None


def _master(config: Config, env: Mapping[str, str], problem: ProblemSink) -> tuple[str, int, str]:
    """(node 0's host, the rendezvous port, where they came from)."""
    endpoint = config.cluster.rdzv_endpoint
    if endpoint:
        host, _, port = endpoint.rpartition(":")
        return host.strip("[]"), int(port), f"--rdzv-endpoint {endpoint}"
    port_text = env.get("MASTER_PORT")
    port = DEFAULT_MASTER_PORT
    if port_text is not None:
        if not port_text.isdigit() or not 0 < int(port_text) < 65533:
            problem(f"MASTER_PORT={port_text!r}: expected a port (1..65532; the next two are used too)")
        else:
            port = int(port_text)
    port_note = f"MASTER_PORT={port}" if port_text is not None else f"port {port}"
    master = env.get("MASTER_ADDR")
    if master:
        return master, port, f"MASTER_ADDR={master}, {port_note}"
    nodelist = _slurm_nodelist(env)
    if nodelist is not None:
        variable, text = nodelist
        try:
            hosts = expand_nodelist(text)
        except ValueError as error:
            problem(f"{variable}: {error}")
            return "<node 0>", port, f"{variable} (unreadable)"
        return hosts[0], port, f"the first host of {variable}={text}, {port_note}"
    problem(f"--actor-num-nodes {config.cluster.actor_num_nodes}: node 0's address is unknown: run under srun "
            "(SLURM_JOB_NODELIST), set MASTER_ADDR (and MASTER_PORT), or give --rdzv-endpoint HOST:PORT")
    return "<MASTER_ADDR>", port, "no address (placeholder)"
