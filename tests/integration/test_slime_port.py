"""A real slime example, ported by changing its imports only: search-r1's generate and reward functions
(tests/data/slime_ports/search_r1, from THUDM/slime@624b824) run for 2 rollouts on CPU engines and torchrun
(the second after a training step and a weight sync).

Its external service, the retrieval server, is replaced by a STAND-IN serving the same `/retrieve`
(tests/support/search_standin.py, a real HTTP server on 127.0.0.1). The model is the tiny one with Search-R1's
tags as single tokens, so its random turns write `<search>…</search>` now and then: the port posts to the
coordinator's endpoint (text prompts, stop strings, logprobs), queries the stand-in, appends `<information>`
with loss mask 0, and is scored by its own exact-match reward (a dict label).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from coordinator.checks.preflight import preflight
from coordinator.config import parse_config
from coordinator.lifecycle.processes import terminate_process_group_blocking
from coordinator.observe.progress import read_metrics
from coordinator.run import run_training
from replay.format import dump_path
from replay.reader import read_dump
from tests.support.engine_proc import free_port
from tests.support.waiting import wait_until_sync

PORT_DIR = Path(__file__).resolve().parents[1] / "data" / "slime_ports" / "search_r1"
TAGS = ("<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>", "<think>",
        "</think>")
TEMPLATE = ("Answer the given question. You must conduct reasoning inside <think> and </think> first every time "
            "you get new information. After reasoning, if you find you lack some knowledge, you can call a search "
            "engine by <search> query </search> and it will return the top searched results between "
            "<information> and </information>. You can search as many times as your want. If you find no "
            "further external knowledge needed, you can directly provide the answer inside <answer> and "
            "</answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: {}\n")
# Each training step costs more than its rollout (~450-token samples: the observations are long); the third
# rollout of the first version of this test only added the costliest step.
ROLLOUTS = 2
QUESTIONS = [("What is the capital of France?", ["Paris"]), ("Who created Python?", ["Guido van Rossum"]),
             ("What is the highest mountain?", ["Mount Everest", "Everest"]), ("What orbits Earth?", ["the Moon"])]


@pytest.fixture(scope="module")
def search_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.tiny_model import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("search-model"), TinyModelSpec(words=TAGS,
                                                                                     max_position_embeddings=2048))


@pytest.fixture
def search_standin(tmp_path: Path) -> Iterator[str]:
    """The stand-in retrieval server as a process of its own; its base URL."""
    port = free_port()
    log = (tmp_path / "standin.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "tests.support.search_standin", "--port", str(port)],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def serving() -> bool:
            assert process.poll() is None, (tmp_path / "standin.log").read_text()
            return httpx.get(f"{url}/stats", timeout=2).status_code == 200

        wait_until_sync(serving, timeout=60, interval=0.2, ignoring=(httpx.HTTPError,),
                        what="the stand-in retrieval server's /stats")
        yield url
    finally:
        terminate_process_group_blocking(process, grace=5.0)
        log.close()


def write_data(path: Path) -> Path:
    """Search-R1's data shape: chat-message prompts and the `reward_model` dict label, in Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "user", "content": TEMPLATE.format(question)}],
             "reward_model": {"ground_truth": {"target": answers}, "style": "rule"}} for question, answers in QUESTIONS]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_slimes_search_r1_pair_runs_on_our_engines(search_model: Path, search_standin: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PORT_DIR))  # the example's siblings import each other, as in slime
    import generate_with_search

    monkeypatch.setitem(generate_with_search.SEARCH_R1_CONFIGS["local"], "search_url", f"{search_standin}/retrieve")
    run_dir = tmp_path / "run"
    config = parse_config([
        "--hf-checkpoint", str(search_model), "--prompt-data", str(write_data(tmp_path / "train.parquet")),
        "--input-key", "prompt", "--label-key", "reward_model", "--apply-chat-template",
        "--custom-generate-function-path", "generate_with_search.generate",
        "--custom-rm-path", "generate_with_search.reward_func",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "96",
        "--num-rollout", str(ROLLOUTS), "--rollout-num-engines", "1", "--actor-num-gpus-per-node", "1", "--lr", "1e-3",
        "--save-debug-rollout-data", str(run_dir / "dumps" / "{rollout_id}.rld"), "--run-dir", str(run_dir),
        "--no-progress"])
    notes = preflight(config)  # the start-up checks take slime's signatures
    assert any("generate_with_search.generate: called as await generate(args, sample, sampling_params)" in n
               for n in notes), notes
    assert any("reward_func(args, sample, **kwargs) (slime's form)" in n for n in notes), notes

    summary = anyio.run(run_training, config)
    assert summary["rollouts"] == ROLLOUTS and summary["train_steps"] == ROLLOUTS
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert max(row["train/train_rollout_logprob_abs_diff_max"] for row in rows) <= 1e-4

    samples = [s for r in range(ROLLOUTS) for s in read_dump(dump_path(str(run_dir / "dumps" / "{rollout_id}.rld"),
                                                                r)).samples]
    assert len(samples) == ROLLOUTS * 16
    assert all(isinstance(s.label, dict) and "ground_truth" in s.label for s in samples)
    assert all(s.reward in (0.0, 1.0) for s in samples)  # exact match of the last <answer>
    multi_turn = [s for s in samples if s.is_multi_turn]
    assert multi_turn  # observations (search results, or the invalid-action hint) are in with loss mask 0
    for sample in multi_turn:
        assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if not m)
    searched = [s for s in samples if "<information>" in s.response]
    served = json.loads(httpx.get(f"{search_standin}/stats", timeout=5).text)["queries"]
    assert served >= 1 and searched, (served, [s.response for s in samples][:4])
    assert any("Doc 1(Title:" in s.response for s in searched)  # the stand-in's documents, formatted by slime
