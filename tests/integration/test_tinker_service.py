"""`rayless tinker-server` driven by the official `tinker` SDK: one service (a subprocess: its torchrun rank, its
CPU engine) for the whole module, one LoRA training client shared by the loops.

The SDK's own calls: an `importance_sampling` RL loop shaped like the cookbook's raises the tiny task's reward
by the margin the GRPO tests use; a supervised loop lowers its loss; the sampler after
`save_weights_for_sampler` serves the trained weights (its prompt logprobs equal the trainer's `forward`);
`save_state` / `load_state` bring the weights back. Hostile and unsupported calls get 4xx answers naming what
is wrong. An SDK client in its own process resumes a checkpoint as the cookbook resumes
(`create_training_client_from_state_with_optimizer`) and is killed: its model's ranks are stopped. The
service's stop leaves no process behind. The cookbook's own `sl_loop` and `rl_loop` run on the same service
(when tinker-cookbook is installed). `/status` shows the loops' model, session and sampler.
"""

from __future__ import annotations

import gc
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest

from coordinator.data.tasks import make_task_prompts
from coordinator.engines.spec import free_port
from tests.support.processes import wait_gone
from tests.support.waiting import wait_until_sync

tinker = pytest.importorskip(
    "tinker", reason="the official tinker SDK is not installed: install the test extra (./run.sh test, or "
    "pip install -e '.[dev]'; it needs Python >= 3.11)")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

# The SDK leaves some of its own HTTP pools to the garbage collector (their sockets then warn in this
# process); the service's side is what these tests hold to account.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

KEY = "tml-rayless-test"
MAX_DATUMS = 64
SESSION_TIMEOUT_S = 30
COOKBOOK_MODEL = "Qwen/Qwen3-4B-Instruct-2507"
BOXED = "\\boxed{3}"


@dataclass
class Service:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    saved: list[tuple[str, list[int], list[float]]]
    cookbook_model: Path

    def post(self, call: str, body: Any = None, *, content: bytes | None = None, key: str | None = KEY,
             headers: dict[str, str] | None = None) -> httpx.Response:
        auth = {"X-API-Key": key} if key else {}
        return httpx.post(f"{self.url}/api/v1/{call}", json=body, content=content, timeout=60,
                          headers={**auth, **(headers or {})})

    def torchruns(self) -> list[psutil.Process]:
        return [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                if "torch.distributed.run" in " ".join(p.cmdline()) and "lifeline" not in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    from workers.tiny_model import TinyModelSpec, build_tiny_model

    # the output head untied, so LoRA adapts it (tests/integration/test_train_lora.py: the task needs it)
    model = build_tiny_model(tmp_path_factory.mktemp("tinker-model"), TinyModelSpec(untied_head=True))
    # the cookbook's loops pick their renderer by a Hugging Face model name: the tiny model (ChatML tokens, as
    # Qwen's) under a Qwen instruct name, with the answer the RL loop's grader looks for as one token
    cookbook_model = build_tiny_model(tmp_path_factory.mktemp("tinker-cookbook-model"),
                                      TinyModelSpec(untied_head=True, words=(BOXED,)))
    root = tmp_path_factory.mktemp("tinker-service")
    port = free_port()
    log = root / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "tinker-server", "--port", str(port), "--api-key", KEY,
             "--base-model", f"tiny={model}", "--base-model", f"{COOKBOOK_MODEL}={cookbook_model}",
             "--max-models", "4", "--run-dir", str(root / "run"), "--max-batch-datums", str(MAX_DATUMS),
             "--session-timeout", str(SESSION_TIMEOUT_S)], stdout=out, stderr=subprocess.STDOUT)
    service = Service(f"http://127.0.0.1:{port}", proc, log, [], cookbook_model)
    try:
        wait_until_sync(lambda: log.read_text(errors="replace"), until=lambda text: "ready on" in text
                        or proc.poll() is not None, timeout=120, what="the service's ready line")
        assert proc.poll() is None, log.read_text()
        yield service
    finally:
        tree = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert not wait_gone(tree, 30), "processes outlived the service"
    assert proc.returncode == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def service_client(service: Service) -> Iterator[Any]:
    client = tinker.ServiceClient(base_url=service.url, api_key=KEY)
    yield client
    client.close("success").result()
    del client
    # the SDK's pools left to the collector are collected here, inside this module's warning filter, not at the
    # session's end (where pytest turns each unclosed socket into an error of the whole run)
    gc.collect()


@pytest.fixture(scope="module")
def training(service_client: Any) -> Any:
    return service_client.create_lora_training_client(base_model="tiny", rank=8).result()


def datum(tokens: list[int], weights: list[float]) -> Any:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                                       "weights": np.array(weights[1:], dtype=np.float32)})


def first_digit_reward(text: str, label: str) -> float:
    """The `first_digit` task's rule (coordinator/rewards): the share of the first 4 characters that are the
    label."""
    return sum(char == label for char in text[:4]) / 4


def test_an_importance_sampling_rl_loop_raises_the_reward(training: Any) -> None:
    """The cookbook's rl_loop shape: sample groups on the current weights, centre each group's rewards, train
    with `importance_sampling` on the sampler's logprobs, save for the sampler, again. First in the module: it
    starts from the base model, as the GRPO tests' reward margin does."""
    tokenizer = training.get_tokenizer()
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=4, temperature=1.0)
    means = []
    for step in range(9):
        prompts = make_task_prompts("first_digit", 32, seed=100 + step)
        encoded = [tokenizer.encode(p.prompt) for p in prompts]
        futures = [sampler.sample(types.ModelInput.from_ints(ids), 8, params) for ids in encoded]
        data, rewards = [], []
        for record, ids, future in zip(prompts, encoded, futures, strict=True):
            sequences = future.result().sequences
            group = [first_digit_reward(tokenizer.decode(seq.tokens, skip_special_tokens=True), record.label)
                     for seq in sequences]
            rewards += group
            mean = sum(group) / len(group)
            for seq, reward in zip(sequences, group, strict=True):
                if reward == mean or not seq.tokens:
                    continue  # no signal in a group that scored alike
                tokens = ids + list(seq.tokens)
                pad = [0.0] * (len(ids) - 1)
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                                    "logprobs": np.array(pad + list(seq.logprobs), dtype=np.float32),
                                    "advantages": np.array(pad + [reward - mean] * len(seq.tokens),
                                                           dtype=np.float32)}))
        means.append(sum(rewards) / len(rewards))
        if data:
            backward = training.forward_backward(data, "importance_sampling")
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            assert np.isfinite(backward.result().metrics["loss:sum"])
        sampler = training.save_weights_and_get_sampling_client().result()
    first, last = sum(means[:3]) / 3, sum(means[-3:]) / 3
    assert last >= 2 * first, means


def test_sl_loop_lowers_the_loss_and_the_sampler_serves_the_trained_weights(training: Any, service_client: Any,
                                                                           service: Service) -> None:
    tokenizer = training.get_tokenizer()
    texts = ["hello world", "hello there", "hi world", "hey there"]
    data = [datum(tokenizer.encode(text), [1.0] * len(tokenizer.encode(text))) for text in texts]
    count = sum(len(d.model_input.to_ints()) for d in data)
    losses = []
    for _ in range(6):
        backward = training.forward_backward(data, "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=1e-2))
        result = backward.result()
        assert step.result().metrics["grad_norm:mean"] > 0
        nll = -np.concatenate([out["logprobs"].to_numpy() for out in result.loss_fn_outputs]).sum() / count
        assert result.metrics["loss:sum"] == pytest.approx(nll * count, rel=1e-4)
        losses.append(nll)
    assert losses[-1] < 0.8 * losses[0], losses

    # the sampler serves the weights just trained: its prompt logprobs are the trainer's
    path = training.save_weights_for_sampler("sl-final").result().path
    assert path.startswith("tinker://")
    sampler = service_client.create_sampling_client(model_path=path).result()
    prompt = tokenizer.encode(texts[0])
    sample = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=4),
                            include_prompt_logprobs=True).result()
    assert len(sample.sequences) == 2 and all(len(seq.logprobs) == len(seq.tokens) for seq in sample.sequences)
    trainer = training.forward([data[0]], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert sample.prompt_logprobs[0] is None
    assert np.abs(np.array(sample.prompt_logprobs[1:]) - trainer).max() <= 1e-4

    # save_state / load_state: a step after the save is undone by the load
    saved = training.save_state("sl-state").result().path
    service.saved.append((saved, tokenizer.encode(texts[0]), trainer.tolist()))
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    moved = training.forward([data[0]], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(moved - trainer).max() > 1e-3
    with pytest.warns(FutureWarning, match="load_state"):  # deprecated in the SDK, still served
        training.load_state(saved).result()
    back = training.forward([data[0]], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(back - trainer).max() <= 1e-5

    # ppo through the whole stack: sampler logprobs 0.5 below the trainer's make every ratio e^0.5 > 1.3, clipped
    # at the client's clip_high_threshold for a positive advantage (and taken whole for a negative one)
    advantages = np.where(np.arange(len(trainer)) % 2 == 0, 1.0, -1.0).astype(np.float32)
    ppo = types.Datum(model_input=data[0].model_input, loss_fn_inputs={
        "target_tokens": data[0].loss_fn_inputs["target_tokens"],
        "logprobs": (trainer - 0.5).astype(np.float32), "advantages": advantages})
    out = training.forward([ppo], "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.3}).result()
    expected = -np.minimum(np.exp(0.5) * advantages, 1.3 * advantages)
    assert np.abs(out.loss_fn_outputs[0]["elementwise_loss"].to_numpy() - expected).max() <= 1e-4


def proto_body(model_id: str, loss_fn: str, count: int) -> bytes:
    data = [types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": np.array([6, 7, 8]),
                                        "weights": np.ones(3, dtype=np.float32)})] * count
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data[:1], loss_fn="cross_entropy"),
        model_id=model_id, seq_id=1000)
    message = forward_backward_request_to_proto(request)
    message.loss_fn = loss_fn
    for _ in range(count - 1):
        message.data.add().CopyFrom(message.data[0])
    return message.SerializeToString()


def test_hostile_and_unsupported_calls_get_answers_naming_what_is_wrong(service: Service, training: Any,
                                                                      service_client: Any) -> None:
    protobuf = {"Content-Type": "application/x-protobuf"}
    model_id = training.model_id
    refused = service.post("create_session", {}, key="tml-wrong")
    assert refused.status_code == 401 and "API key" in refused.json()["detail"]
    assert httpx.get(f"{service.url}/api/v1/healthz").json() == {"status": "ok"}  # the probe needs no key
    metrics = httpx.get(f"{service.url}/metrics", headers={"X-API-Key": KEY}).text
    assert "tinker_models_live 1\n" in metrics and "tinker_optim_steps_total" in metrics, metrics
    # the status document: the loops' model with its steps and its ranks' own times, its session, the sampler
    assert httpx.get(f"{service.url}/status", headers={"X-API-Key": "tml-wrong"}).status_code == 401
    status = httpx.get(f"{service.url}/status", headers={"X-API-Key": KEY}).json()
    shown = next(m for m in status["models"] if m["model_id"] == model_id)
    assert shown["state"] == "ready" and shown["queued"] == 0 and shown["optim_steps"] >= 9, shown
    assert shown["rank_seconds"]["forward_backward"] > 0 and shown["rank_seconds"]["optim_step"] > 0, shown
    assert shown["session_id"] in [s["session_id"] for s in status["sessions"]], status
    assert status["samplers"][0]["started"] and status["samplers"][0]["in_flight"] == 0, status
    page = httpx.get(f"{service.url}/")  # the page is static (no data, no key): it asks /status with #key=
    assert page.status_code == 200 and 'fetch("status"' in page.text and model_id not in page.text

    cases = [
        (service.post("retrieve_future", {"request_id": "req-999999"}), 404, "unknown request_id"),
        (service.post("get_info", {"model_id": "model-nope"}), 404, "unknown model_id"),
        (service.post("forward_backward", content=proto_body(model_id, "bogus", 1), headers=protobuf), 400,
         "unknown loss_fn 'bogus'"),
        (service.post("forward_backward", content=proto_body(model_id, "cispo", 1), headers=protobuf), 400,
         "'cispo' is not served"),
        (service.post("forward_backward", content=proto_body(model_id, "cross_entropy", MAX_DATUMS + 1),
                      headers=protobuf), 400, "--max-batch-datums"),
        (service.post("forward_backward", content=b"\x1a\xff\xff\xff\xff\x0f", headers=protobuf), 400,
         "past the end"),
        (service.post("optim_step", {"model_id": model_id, "optimizer_params": {"type": "dimuon"}}), 400,
         "'dimuon' are not supported"),
        (service.post("save_weights_external", {"model_id": model_id}), 400, "save_weights_external"),
        (service.post("load_weights", {"model_id": model_id, "path": "../../etc", "optimizer": False}), 400,
         "tinker://"),
        (service.post("asample", {"base_model": "tiny", "prompt": {"chunks": [{"tokens": [5]}]},
                                  "sampling_params": {}, "topk_prompt_logprobs": 5}), 400, "topk_prompt_logprobs"),
        (service.post("asample", {"base_model": "tiny", "prompt": {"chunks": [{"tokens": [10**6]}]},
                                  "sampling_params": {}}), 400, "outside the vocabulary"),
    ]
    for answer, status, words in cases:
        assert answer.status_code == status and words in answer.json()["detail"], answer.text

    # through the SDK: an unknown base model is refused at once, named (no ranks start)
    with pytest.raises(tinker.BadRequestError, match="unknown base_model 'nope'"):
        service_client.create_lora_training_client(base_model="nope", rank=4).result()


CLIENT = """
import json, sys
import numpy as np, tinker
from tinker import types
url, key, path, tokens = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
service = tinker.ServiceClient(base_url=url, api_key=key)
training = service.create_training_client_from_state_with_optimizer(path).result()
datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1)})
logprobs = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
print(json.dumps({"model_id": training.model_id, "logprobs": logprobs.tolist()}), flush=True)
sys.stdin.read()  # until it is killed
"""


def test_a_client_that_disappears_leaves_nothing_running(service: Service, tmp_path: Path) -> None:
    """An SDK client in its own process resumes the SL test's checkpoint as the cookbook's loops resume
    (`create_training_client_from_state_with_optimizer`: the weights it gets are the saved ones), then is
    SIGKILLed: past --session-timeout without its heartbeat, its model's ranks are stopped."""
    path, tokens, expected = service.saved[0]
    before = {p.pid for p in service.torchruns()}
    out = tmp_path / "client.out"
    with out.open("wb") as sink:
        client = subprocess.Popen([sys.executable, "-W", "ignore", "-c", CLIENT, service.url, KEY, path,
                                   json.dumps(tokens)], stdin=subprocess.PIPE, stdout=sink,
                                  stderr=subprocess.STDOUT)
    try:
        line = wait_until_sync(lambda: out.read_text(errors="replace"), until=lambda text: '"logprobs"' in text
                               or client.poll() is not None, timeout=180, what="the resumed client's forward")
        resumed = json.loads(next(row for row in line.splitlines() if row.startswith("{")))
        assert np.abs(np.array(resumed["logprobs"]) - np.array(expected)).max() <= 1e-5
    finally:
        client.kill()
        client.wait(timeout=30)
    ranks = [p for p in service.torchruns() if p.pid not in before]
    assert len(ranks) == 1
    assert not wait_gone(ranks, SESSION_TIMEOUT_S * 3), "the gone client's ranks still run"
    stopped = service.post("get_info", {"model_id": resumed["model_id"]})
    assert stopped.status_code == 400 and "no heartbeat" in stopped.json()["detail"], stopped.text
    session = resumed["model_id"].split(":")[0]
    assert service.post("session_heartbeat", {"session_id": session}).status_code == 410


def test_the_cookbooks_own_loops_run_changed_only_in_url_model_and_data(service: Service, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """tinker-cookbook's `sl_loop.main` and `rl_loop.main`, as installed: only `base_url`, the model name and
    the dataset (`datasets.load_dataset`, here local rows in the loops' own shapes: no_robots conversations,
    GSM8K question/answer) differ. The SL loop's NLL falls; the RL loop (`importance_sampling`, its default
    `stable_reinforce` is refused by name) raises the reward by the GRPO tests' margin."""
    sl_loop = pytest.importorskip("tinker_cookbook.recipes.sl_loop", reason="tinker-cookbook is not installed "
                                  "(pip install tinker-cookbook; not in the test extra: it is not light)")
    rl_loop = pytest.importorskip("tinker_cookbook.recipes.rl_loop", reason="tinker-cookbook is not installed")
    import datasets

    # the loops' tokenizer lookup finds the model name as a local directory; the key from the SDK's variable
    (tmp_path / "Qwen").mkdir()
    (tmp_path / COOKBOOK_MODEL).symlink_to(service.cookbook_model)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    conversations = [{"messages": [{"role": "user", "content": f"add {a} and {b}"},
                                   {"role": "assistant", "content": f"{a} + {b} = {a + b}"}]}
                     for a, b in zip(range(10), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3] * 4, strict=False)] * 3
    problems = [{"question": f"what is {i % 3} times 0 plus 3?", "answer": "so 3\n#### 3"} for i in range(48)]
    local = {"HuggingFaceH4/no_robots": conversations, "openai/gsm8k": problems}
    monkeypatch.setattr(datasets, "load_dataset", lambda name, *_a, **_k: datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(local[name])}))

    sl_loop.main(sl_loop.Config(base_url=service.url, model_name=COOKBOOK_MODEL, log_path=str(tmp_path / "sl"),
                                batch_size=5, learning_rate=1e-2, lora_rank=8, save_every=3, max_steps=6))
    nll = [row["train_mean_nll"] for row in map(json.loads, (tmp_path / "sl/metrics.jsonl").read_text().splitlines())]
    assert len(nll) == 6 and nll[-1] < 0.8 * nll[0], nll

    rl_loop.main(rl_loop.Config(base_url=service.url, model_name=COOKBOOK_MODEL, log_path=str(tmp_path / "rl"),
                                batch_size=8, group_size=8, max_tokens=16, learning_rate=1e-2, lora_rank=8,
                                loss_fn="importance_sampling", save_every=0, max_steps=6))
    rows = [json.loads(line) for line in (tmp_path / "rl/metrics.jsonl").read_text().splitlines()]
    rewards = [row["reward/total"] for row in rows if "reward/total" in row]
    assert len(rewards) == 6 and np.mean(rewards[-2:]) >= max(2 * np.mean(rewards[:2]), 0.25), rewards
    # the loops never close their ServiceClients: their HTTP pools are collected here, under this module's
    # filter (collected at the session's end instead, their ResourceWarnings would fail the run)
    gc.collect()
