"""Entry point of a training rank: `torchrun ... -m workers.train_rank`.

Fixed wiring order: read the environment → dial the coordinator (token from RAYLESS_CONTROL_TOKEN,
address from RAYLESS_CONTROL_ADDR, never argv) → join the torch process group (gloo on CPU, NCCL on
CUDA) → serve commands until `shutdown` → always destroy the process group and close the channel → after a
clean shutdown, exit at once (`os._exit`, stdio flushed) rather than through the interpreter's teardown.
`@record` makes torchrun's error file name this rank when it fails. Invariant: every Request gets exactly
one Response; a failing command is answered with its error and traceback, never with silence.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback

from torch.distributed.elastic.multiprocessing.errors import record

from workers import protocol, stack_dumps


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(
                f"{name} is not set: start this module with torchrun (see coordinator.train.torchrun)"
            )
        return default
    return int(value)


def _connect() -> protocol.RankChannel:
    address = os.environ.get(protocol.ENV_ADDR)
    token = os.environ.get(protocol.ENV_TOKEN)
    if not address or not token:
        raise RuntimeError(
            f"{protocol.ENV_ADDR} and {protocol.ENV_TOKEN} must be set in the environment: the coordinator's "
            "TrainGroup passes them to torchrun"
        )
    hello = protocol.Hello(
        protocol_version=protocol.PROTOCOL_VERSION,
        token=token,
        rank=_env_int("RANK"),
        world_size=_env_int("WORLD_SIZE"),
        local_rank=_env_int("LOCAL_RANK", 0),
        pid=os.getpid(),
        restart_count=_env_int("TORCHELASTIC_RESTART_COUNT", 0),
        node_rank=_env_int(protocol.ENV_NODE_RANK, 0),
    )
    return protocol.RankChannel.connect(address, hello, max_frame_bytes=protocol.max_frame_bytes_from_env())


def serve(channel: protocol.RankChannel, trainer: object) -> None:
    from workers.train_rank.commands import handle

    while True:
        try:
            message = channel.receive()
        except (ConnectionError, OSError) as exc:
            raise RuntimeError(f"rank lost the control channel to the coordinator: {exc}") from exc
        if not isinstance(message, protocol.Request):
            raise protocol.ProtocolError(f"expected a request from the coordinator, got {message.kind!r}")
        if isinstance(message.command, protocol.ShutdownCommand):
            channel.send(protocol.Response(request_id=message.request_id, ok=True, result=protocol.ShutdownReply()))
            return
        try:
            result = handle(trainer, message.command)  # type: ignore[arg-type]
            response = protocol.Response(request_id=message.request_id, ok=True, result=result)
            channel.send(response)
        except Exception as exc:
            channel.send(_error_response(message.request_id, exc))


def _error_response(request_id: int, error: Exception) -> protocol.Response:
    """A failed command's answer. An OSError (a missing directory, a full disk, a refused connection) is the
    environment's failure, not a bug: its traceback goes to this rank's log, and the answer carries the
    message alone, so the coordinator reports it in one line."""
    trace = traceback.format_exc()
    environment = isinstance(error, OSError)
    if environment:
        print(trace, file=sys.stderr, flush=True)
    return protocol.Response(request_id=request_id, ok=False, error=f"{type(error).__name__}: {error}",
                             traceback="" if environment else trace)


@record
def main() -> None:
    import torch
    import torch.distributed as dist

    threads = _env_int("RAYLESS_TORCH_THREADS", 1)
    torch.set_num_threads(threads)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass

    # The trainer's imports (transformers, the model code) before Hello: once connected, a rank answers its
    # commands — a shutdown included — without seconds of importing first.
    from workers.collector import tune_collector
    from workers.train_rank.trainer import Trainer

    stack_dumps.install(f"rank{_env_int('RANK')}")  # `rayless stacks`: SIGUSR1 writes this rank's stacks
    channel = _connect()
    try:
        if torch.cuda.is_available():
            local_rank = _env_int("LOCAL_RANK", 0)
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
            backend = "nccl"
        else:
            device = torch.device("cpu")
            backend = "gloo"
        timeout = datetime.timedelta(seconds=_env_int("RAYLESS_PG_TIMEOUT_S", 600))
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
        trainer = Trainer(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)
        tune_collector(collect_first=False)  # the imports' heap out of the collector's full passes (issue 38)
        try:
            serve(channel, trainer)
        finally:
            if trainer.state is not None:
                trainer.state.discard()  # a spill file of a state offloaded at exit
            dist.destroy_process_group()
    finally:
        channel.close()


if __name__ == "__main__":
    main()
    # A clean shutdown ends here without the interpreter's teardown of torch and transformers: ~1.2 CPU-s that
    # nothing needs (the channel and the process group are closed, no atexit hook is ours), and, on a loaded
    # machine, over the coordinator's grace for the group's exit. A failure raised out of main() is untouched.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
