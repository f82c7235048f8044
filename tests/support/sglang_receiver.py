"""SGLANG_RECEIVER: the engine side of a distributed weight update run by SGLang's own code, over HTTP.

    python -m tests.support.sglang_receiver --model-path DIR --port N [--tp-size 2] [--before-sessions]

Not an engine: it serves only what a weight update touches, so a test can drive our `WeightSync` into SGLang
0.5.x's real `init_custom_process_group` and `receive_weights_from_distributed` (loaded from the installed wheel
by `tests.support.sglang_parts`), per tensor or as one `FlattenedTensorBucket`; `--tp-size N` adds one process
per extra tp rank. Written here, restating SGLang 0.5.23: the begin/end weight-update session (an update outside
one is refused; `--before-sessions` answers as 0.5.20 and older: 404, no session), the weight version recorded
after a load, and `{success, message}` bodies with 200/400. Tp rank 0 loads what it received into a Hugging Face
model; `POST /logprobs` (test-only) answers log-probabilities under the weights it holds, `GET /stats` what it
was asked. Why SGLang's own code: docs/weight-sync.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from typing import Any

import torch

from tests.support import sglang_parts


class TpRank:
    """One tp rank's groups and its SGLang receive calls (blocking)."""

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank
        self.groups: dict[str, Any] = {}

    def run(self, op: str, body: dict[str, Any]) -> tuple[bool, str, Any]:
        import torch.distributed as dist

        try:
            if op == "init":
                self.groups[body["group_name"]] = sglang_parts.init_custom_process_group()(
                    backend=body["backend"],
                    init_method=f"tcp://{body['master_address']}:{body['master_port']}",
                    world_size=body["world_size"],
                    rank=body["rank_offset"] + self.tp_rank,
                    group_name=body["group_name"],
                )
                return True, "Succeeded to initialize custom process group.", None
            if op == "update":
                weights = sglang_parts.receive_weights_from_distributed(
                    self.groups, names=body["names"], dtypes=body["dtypes"], shapes=body["shapes"],
                    group_name=body["group_name"], load_format=body.get("load_format"),
                )
                return True, "received", weights
            if op == "destroy":
                dist.destroy_process_group(self.groups.pop(body["group_name"]))
                return True, "Succeeded to destroy custom process group.", None
        except Exception as exc:  # reported as SGLang does: a failed call, not a dead server
            return False, f"{op} failed on tp rank {self.tp_rank}: {exc}", None
        return False, f"unknown op {op}", None


def worker_main(tp_rank: int) -> None:
    """An extra tp rank: ops as JSON lines on stdin, one JSON answer line each on stdout."""
    rank = TpRank(tp_rank)
    for line in sys.stdin:
        request = json.loads(line)
        ok, message, _ = rank.run(request["op"], request["body"])
        print(json.dumps({"ok": ok, "message": message}), flush=True)


class Receiver:
    def __init__(self, model_path: str, tp_size: int, sessions: bool = True) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.rank0 = TpRank(0)
        self.workers = [
            subprocess.Popen([sys.executable, "-m", "tests.support.sglang_receiver", "--tp-worker", str(rank)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for rank in range(1, tp_size)
        ]
        self.tp_size = tp_size
        self.sessions = sessions
        self.session = False
        self.weight_version = "default"
        self.stats: dict[str, Any] = {"updates": [], "inits": []}

    def all_ranks(self, op: str, body: dict[str, Any]) -> tuple[bool, str, Any]:
        """The op on every tp rank at once (they are ranks of one collective)."""
        answers: list[dict[str, Any]] = []

        def ask(worker: subprocess.Popen[str]) -> None:
            assert worker.stdin is not None and worker.stdout is not None
            worker.stdin.write(json.dumps({"op": op, "body": body}) + "\n")
            worker.stdin.flush()
            answers.append(json.loads(worker.stdout.readline()))

        threads = [threading.Thread(target=ask, args=(worker,)) for worker in self.workers]
        for thread in threads:
            thread.start()
        ok, message, result = self.rank0.run(op, body)
        for thread in threads:
            thread.join()
        for answer in answers:
            if not answer["ok"]:
                ok, message = False, answer["message"]
        return ok, message, result

    def update(self, body: dict[str, Any]) -> tuple[bool, str]:
        if self.sessions and not self.session:
            return False, ("update_weights_from_distributed must run between begin_weight_update() and "
                           "end_weight_update()")
        ok, message, weights = self.all_ranks("update", body)
        self.stats["updates"].append({"names": body["names"], "load_format": body.get("load_format"),
                                      "bytes": sum(t.numel() * t.element_size() for _, t in weights or [])})
        if not ok:
            return False, f"Failed to receive weights: {message}"
        state = self.model.state_dict()
        unknown = [name for name, _ in weights if name not in state]
        if unknown:
            return False, f"Failed to update parameter online: unknown {unknown}"
        with torch.no_grad():
            for name, tensor in weights:
                state[name].copy_(tensor)
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return True, "Succeeded to update parameter online."

    def logprobs(self, body: dict[str, Any]) -> list[list[float]]:
        out = []
        with torch.no_grad():
            for tokens, length in zip(body["tokens"], body["response_lengths"], strict=True):
                logits = self.model(input_ids=torch.tensor([tokens])).logits[0].float()
                logps = torch.log_softmax(logits, dim=-1)
                start = len(tokens) - length
                out.append([float(logps[p - 1, tokens[p]]) for p in range(start, len(tokens))])
        return out


def app(receiver: Receiver) -> Any:
    import anyio
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    lock = anyio.Lock()

    def result(ok: bool, message: str) -> JSONResponse:
        return JSONResponse({"success": ok, "message": message}, status_code=200 if ok else 400)

    async def ok(_: Request) -> JSONResponse:
        return JSONResponse({})

    async def server_info(_: Request) -> JSONResponse:
        return JSONResponse({"tp_size": receiver.tp_size, "version": f"SGLANG_RECEIVER {sglang_parts.installed_version()}"})

    async def weight_version(_: Request) -> JSONResponse:
        return JSONResponse({"weight_version": receiver.weight_version})

    async def init(request: Request) -> JSONResponse:
        body = {"group_name": "weight_update_group", "backend": "nccl", **(await request.json())}
        receiver.stats["inits"].append(body)
        ok_, message, _ = await anyio.to_thread.run_sync(receiver.all_ranks, "init", body)
        return result(ok_, message if ok_ else f"Failed to initialize custom process group: {message}.")

    async def begin(_: Request) -> JSONResponse:
        if receiver.session:
            return result(False, "a weight-update session is already open; call end_weight_update() first")
        receiver.session = True
        return result(True, "Success")

    async def end(_: Request) -> JSONResponse:
        if not receiver.session:
            return result(False, "no weight-update session is open; call begin_weight_update() first")
        receiver.session = False
        return result(True, "Success")

    async def update(request: Request) -> JSONResponse:
        body = {"group_name": "weight_update_group", **(await request.json())}
        async with lock:
            return result(*await anyio.to_thread.run_sync(receiver.update, body))

    async def destroy(request: Request) -> JSONResponse:
        body = {"group_name": "weight_update_group", **(await request.json())}
        ok_, message, _ = await anyio.to_thread.run_sync(receiver.all_ranks, "destroy", body)
        return result(ok_, message)

    async def logprobs(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"logprobs": await anyio.to_thread.run_sync(receiver.logprobs, body)})

    async def stats(_: Request) -> JSONResponse:
        return JSONResponse(receiver.stats)

    get, post = ["GET"], ["POST"]
    sessions = [Route("/begin_weight_update", begin, methods=post), Route("/end_weight_update", end, methods=post)]
    return Starlette(routes=(sessions if receiver.sessions else []) + [
        Route("/health", ok, methods=get), Route("/health_generate", ok, methods=get),
        Route("/get_server_info", server_info, methods=get), Route("/server_info", server_info, methods=get),
        Route("/get_weight_version", weight_version, methods=get),
        Route("/pause_generation", ok, methods=post), Route("/continue_generation", ok, methods=post),
        Route("/init_weights_update_group", init, methods=post),
        Route("/update_weights_from_distributed", update, methods=post),
        Route("/destroy_weights_update_group", destroy, methods=post),
        Route("/logprobs", logprobs, methods=post), Route("/stats", stats, methods=get),
    ])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path")
    parser.add_argument("--port", type=int)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--tp-worker", type=int, default=None)
    parser.add_argument("--before-sessions", action="store_true")
    args, _ = parser.parse_known_args()  # the engine's other flags (seed, log level) mean nothing here
    torch.set_num_threads(1)
    if args.tp_worker is not None:
        worker_main(args.tp_worker)
        return
    import uvicorn

    receiver = Receiver(args.model_path, args.tp_size, sessions=not args.before_sessions)
    try:
        uvicorn.run(app(receiver), host="127.0.0.1", port=args.port, log_level="warning")
    finally:
        for worker in receiver.workers:
            worker.terminate()
            worker.wait(10)


if __name__ == "__main__":
    main()
