"""The generate path's batching and collector settings (issue 38): prompts tokenised and responses decoded a batch
at a time give the same ids and texts as one call per prompt / response (the tiny model's real fast tokenizer,
plain and chat-template prompts both); the rollout's new groups, built from one batch call, hold the ids one call
per prompt gives; `tune_collector` freezes the live heap once and raises the first threshold; the request slots
bound what is in flight, in arrival order.
"""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from coordinator.config import parse_config
from coordinator.engines.client import EngineClient
from coordinator.engines.fleet import EngineFleet
from coordinator.rollout.generate import DefaultRollout
from coordinator.rollout.manager import RolloutManager
from coordinator.rollout.requests import GenerateState, _plain_fast_decode

PLAIN = ["3 1 4=", "", "  leading and trailing  ", "naïve café — 数字 🙂", "a\nb\tc", "x" * 300,
         "What is 12 + 30? Answer: ", "<|im_start|>user\nhi<|im_end|>"]
CHATS = [[{"role": "user", "content": "What is 2 + 2?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime — 数字."}],
         [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
          {"role": "user", "content": "second\nline"}]]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def state_of(tokenizer: PreTrainedTokenizerBase) -> GenerateState:
    return GenerateState(tokenizer=tokenizer, sampling_params={}, max_response_len=8, context_length=512,
                         concurrency=4, seed=1)


def test_encode_many_gives_the_ids_of_one_call_per_prompt(tokenizer: PreTrainedTokenizerBase) -> None:
    state = state_of(tokenizer)
    chats = [str(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)) for chat in CHATS]
    prompts = PLAIN + chats
    assert state.encode_many(prompts) == [state.encode(prompt) for prompt in prompts]
    assert all(state.encode(chat) for chat in chats)  # the templates rendered into tokens, not nothing
    assert state.encode_many([]) == []


def test_decode_many_gives_the_text_of_one_call_per_response(tokenizer: PreTrainedTokenizerBase) -> None:
    state = state_of(tokenizer)
    assert _plain_fast_decode(tokenizer)  # the batch path is the one under test
    special = [tokenizer.convert_tokens_to_ids(token) for token in tokenizer.all_special_tokens]
    texts = [*PLAIN, "3333", " the end."]
    responses = [state.encode(text) for text in texts] + [[], special, [*special, *state.encode("7")]]
    assert state.decode_many(responses) == [state.decode(ids) for ids in responses]


def test_decode_many_falls_back_to_one_call_where_the_tokenizer_cleans_up_spaces(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, clean_up_tokenization_spaces=True)
    assert not _plain_fast_decode(tokenizer)
    state = state_of(tokenizer)
    responses = [state.encode(text) for text in ["a , b .", "it 's", ""]]
    assert state.decode_many(responses) == [state.decode(ids) for ids in responses]


def test_new_groups_hold_the_ids_of_one_call_per_prompt(tiny_model_dir: Path,
                                                        tokenizer: PreTrainedTokenizerBase) -> None:
    """The rollout's groups, their prompts tokenised in one batch call, each with n samples of those ids."""
    url = "http://127.0.0.1:9"  # built, never contacted: building the groups sends nothing
    config = parse_config(["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", "builtin:first_digit",
                           "--rollout-external-engine-addrs", url, "--rollout-batch-size", "6",
                           "--n-samples-per-prompt", "3", "--num-rollout", "1", "--no-progress"])
    fleet = EngineFleet(client=EngineClient(), external_urls=[url], run_dir=Path(tempfile.mkdtemp()))
    manager = RolloutManager.build(config, tokenizer=tokenizer, client=EngineClient(), pool=fleet,
                                   context_length=512)
    assert manager.context is not None
    rollout = DefaultRollout(manager.context)
    groups = rollout._new_groups(6, 10)
    assert [group.samples[0].group_index for group in groups] == list(range(10, 16))
    for group in groups:
        assert isinstance(group.record.prompt, str)
        assert group.prompt_ids == rollout.state.encode(group.record.prompt)
        assert [sample.tokens for sample in group.samples] == [group.prompt_ids] * 3
        assert all(sample.tokens is not group.prompt_ids for sample in group.samples)  # each its own list


def test_tune_collector_freezes_the_heap_once_and_raises_the_first_threshold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What a run does once its rollout pieces are built; undone here so the rest of the session is as before."""
    from workers import collector

    before = gc.get_threshold()
    monkeypatch.setattr(collector, "_TUNED", False)
    try:
        already = gc.get_freeze_count()  # an earlier in-process run in this worker may have frozen its heap
        live = len(gc.get_objects())
        frozen = collector.tune_collector() - already
        assert frozen >= live // 2  # the live heap went to the permanent generation
        assert len(gc.get_objects()) < live - frozen // 2  # and out of the collector's passes
        assert gc.get_threshold() == (collector.GEN0_THRESHOLD, *before[1:])
        fresh = [[] for _ in range(10)]  # objects made afterwards are tracked (and collected) as before
        assert all(gc.is_tracked(item) for item in fresh) and any(obj is fresh[0] for obj in gc.get_objects())
        count = gc.get_freeze_count()
        assert collector.tune_collector() == count  # a second call freezes nothing more
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_request_slots_bound_order_and_a_cancelled_waiter() -> None:
    """`RequestSlots.hold` (its Event renewed only when the head of the queue waits): never more than the
    concurrency held, groups served in arrival order, and a waiter cancelled while it waits leaves the bound
    working for the groups after it."""
    import anyio
    import anyio.lowlevel

    from coordinator.rollout.requests import RequestSlots

    async def main() -> tuple[int, list[int], int]:
        slots = RequestSlots(4)
        held, peak, order = 0, 0, []
        release = anyio.Event()

        async def group(index: int, count: int) -> None:
            nonlocal held, peak
            async with slots.hold(count):
                order.append(index)
                held += min(count, 4)
                peak = max(peak, held)
                if index == 0:
                    await release.wait()
                await anyio.lowlevel.checkpoint()
                held -= min(count, 4)

        with anyio.fail_after(30):  # a waiter never woken (a lost release) fails here rather than hanging
            await run(slots, group, release)
        return peak, order, slots.free

    async def run(slots: RequestSlots, group: object, release: anyio.Event) -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(group, 0, 3)  # holds 3 of 4 until released
            await anyio.wait_all_tasks_blocked()
            doomed = anyio.CancelScope()  # waits for 3 slots at the head of the queue, then is cancelled
            tasks.start_soon(_cancellable, slots, doomed)
            await anyio.wait_all_tasks_blocked()
            for index in range(1, 9):
                tasks.start_soon(group, index, 1 + index % 5)  # 5 asks for more than the bound: clipped to 4
                await anyio.wait_all_tasks_blocked()
            doomed.cancel()
            await anyio.wait_all_tasks_blocked()
            release.set()

    peak, order, free = anyio.run(main)
    assert peak <= 4
    assert order == list(range(9))
    assert free == 4


async def _cancellable(slots: object, scope: object) -> None:
    import anyio

    assert isinstance(scope, anyio.CancelScope)
    with scope:
        async with slots.hold(3):  # type: ignore[attr-defined]
            raise AssertionError("the cancelled waiter must not get its slots")


# the Rust tokenizer the generate path's batch calls end in (`decode_many`, `encode_many`), without transformers'
# import: the threads it starts are the library's, whoever wraps it
THREADS_AFTER_BATCH_CALLS = """
import os, sys
from tokenizers import Tokenizer
if sys.argv[1] == "rayless":
    from coordinator.cli import main
    main(["--help"])  # what every rayless command does first
tokenizer = Tokenizer.from_file(sys.argv[2])
before = len(os.listdir("/proc/self/task"))
tokenizer.decode_batch([[8, 8, 8, 8]] * 8, skip_special_tokens=True)
tokenizer.encode_batch(["3 1 4=", "2 7 1="] * 4, add_special_tokens=False)
print(before, len(os.listdir("/proc/self/task")), os.environ.get("TOKENIZERS_PARALLELISM"))
"""


@pytest.mark.parametrize(("process", "setting", "grows", "value"), [
    ("rayless", None, False, "false"),  # the coordinator's event loop: no thread pool woken per group
    ("rayless", "true", True, "true"),  # the user's own setting wins
    ("plain", None, True, None),  # the check can fail: the library's default starts its pool
])
def test_a_rayless_process_calls_the_tokenizers_batch_api_on_one_thread(
        tiny_model_dir: Path, process: str, setting: str | None, grows: bool, value: str | None) -> None:
    import os
    import subprocess
    import sys

    env = {key: item for key, item in os.environ.items() if key != "TOKENIZERS_PARALLELISM"}
    if setting is not None:
        env["TOKENIZERS_PARALLELISM"] = setting
    done = subprocess.run([sys.executable, "-c", THREADS_AFTER_BATCH_CALLS, process,
                           str(tiny_model_dir / "tokenizer.json")],
                          env=env, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    before, after, seen = done.stdout.split()[-3:]
    assert (int(after) > int(before)) is grows, done.stdout
    assert seen == str(value)


def test_a_rank_freezes_its_heap_without_a_full_collection_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's start-up: the collector's own passes already ran during its imports, so no full pass is paid
    before the freeze (80–270 ms of it measured), and the heap still leaves the collector's reach."""
    from workers import collector

    before = gc.get_threshold()
    passes: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            passes.append(info["generation"])

    monkeypatch.setattr(collector, "_TUNED", False)
    gc.callbacks.append(seen)
    try:
        already = gc.get_freeze_count()
        live = len(gc.get_objects())
        frozen = collector.tune_collector(collect_first=False) - already
        assert 2 not in passes  # no full collection
        assert frozen >= live // 2 and gc.get_threshold() == (collector.GEN0_THRESHOLD, *before[1:])
    finally:
        gc.callbacks.remove(seen)
        gc.unfreeze()
        gc.set_threshold(*before)
