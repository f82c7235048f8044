"""A vision-language run end to end: the built-in `colour` task (images drawn at start-up) on the tiny VLM,
one CPU engine serving `image_data`, one gloo rank training the packed rows with their images.

It shows what the text task's run shows (tests/integration/test_train_e2e.py), by the same margins: the reward
rises (the last three rollouts' mean at least twice the first three's) and, after every weight sync, the
trainer's logprobs of each sampled token equal the engine's (which they could not if either side dropped the
images or their multimodal positions); its dumps, holding the processed images, replay with no engine and no
data to the same losses. slime's `geo3k_vlm_multi_turn` shape (a custom generate function whose environment
returns an image in a later turn) trains with both turns' images. An agent on the `openai` SDK posts the image to
the session server, whose trajectory trains with it; with `--true-on-policy-mode` the engine's rescored logprobs
are the trainer's exactly, images included. A VLM SFT run in slime's recipe shape (`--loss-type sft_loss`, chats whose user turn
holds `<image>`, `--multimodal-keys`) lowers its loss. Kept short: CI has 2 cores.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from coordinator.config import parse_config
from coordinator.observe.progress import read_metrics
from coordinator.run import run_training

ROLLOUTS = 8


@pytest.fixture(scope="module")
def vlm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="module")
def vlm_run(vlm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = vlm_model
    run_dir = tmp_path_factory.mktemp("vlm-run")
    config = parse_config(["--hf-checkpoint", str(model), "--run-dir", str(run_dir), "--prompt-data",
                           "builtin:colour", "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
                           "--rollout-max-response-len", "4", "--rollout-shuffle", "--lr", "1e-2", "--clip-grad",
                           "1.0", "--rollout-num-engines", "1", "--num-rollout", str(ROLLOUTS), "--no-progress",
                           "--save-debug-rollout-data", str(run_dir / "dumps" / "{rollout_id}.rld")])
    summary = anyio.run(run_training, config)
    assert summary["rollouts"] == ROLLOUTS and summary["train_steps"] == ROLLOUTS
    return run_dir


def test_the_colour_task_learns_and_the_trainer_matches_the_engine_with_images(vlm_run: Path) -> None:
    rows = read_metrics(vlm_run / "metrics.jsonl")
    rewards = [row["rollout/reward_mean"] for row in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= 2 * first, rewards
    assert [row["weight_version"] for row in rows] == [str(i + 1) for i in range(ROLLOUTS)]
    worst = max(row["train/train_rollout_logprob_abs_diff_max"] for row in rows)
    assert worst <= 1e-4, worst  # rollouts 1.. ran on weights the rank synced to the engine by disk
    engine_log = (vlm_run / "logs" / "engine-rollout-0.log").read_text()
    assert "Traceback" not in engine_log


def test_a_replay_of_the_vlm_dumps_repeats_its_losses_without_engines(vlm_run: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The dumps hold each sample's processed images (`multimodal_train_inputs`): a replay trains on them as the
    run did, from the same weights, to the same losses; `dump show` counts a sample's images."""
    from coordinator.cli import main as rayless
    from replay.reader import read_dump

    first = read_dump(vlm_run / "dumps" / "0.rld")
    images = first.samples[0].multimodal_train_inputs
    assert images is not None and images["image_grid_thw"] == [[1, 4, 4]]
    config = parse_config(["--run-dir", str(tmp_path / "replay"), "--load-debug-rollout-data",
                           str(vlm_run / "dumps" / "{rollout_id}.rld"), "--num-rollout", "2", "--no-progress"])
    summary = anyio.run(run_training, config)
    assert summary["train_steps"] == 2
    replayed = [row["train/loss"] for row in read_metrics(tmp_path / "replay" / "metrics.jsonl")]
    generated = [row["train/loss"] for row in read_metrics(vlm_run / "metrics.jsonl")][:2]
    assert replayed == pytest.approx(generated, abs=1e-6), (replayed, generated)
    capsys.readouterr()
    assert rayless(["dump", "show", str(vlm_run / "dumps" / "0.rld"), "--first", "1"]) == 0
    assert "images: 1 (patch grids t×h×w: 1×4×4)" in capsys.readouterr().out


def test_vlm_sft_on_chats_with_images_lowers_its_loss(tmp_path: Path) -> None:
    """slime's VLM SFT shape: a JSONL of chats (`messages`) whose user turn is `<image>colour?`, the images in
    an `images` column as paths beside the file, the assistant's answer the colour's name; no engine."""
    import json

    from tests.support.hostile_images import solid_png
    from workers.tiny_vlm import build_tiny_vlm

    model = build_tiny_vlm(tmp_path / "vlm")
    colours = {"red": (230, 20, 20), "green": (20, 210, 20), "blue": (30, 40, 230)}
    lines = []
    for index, (name, rgb) in enumerate(list(colours.items()) * 2):
        (tmp_path / f"{index}.png").write_bytes(solid_png(56, 56, rgb))
        lines.append(json.dumps({"messages": [{"role": "user", "content": "<image>colour?"},
                                              {"role": "assistant", "content": name}],
                                 "images": [f"{index}.png"]}))
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    config = parse_config(["--hf-checkpoint", str(model), "--run-dir", str(run_dir), "--no-progress",
                           "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
                           "--prompt-data", str(data), "--input-key", "messages", "--multimodal-keys",
                           '{"image": "images"}', "--rollout-shuffle", "--num-epoch", "12", "--rollout-batch-size",
                           "6", "--global-batch-size", "6", "--loss-type", "sft_loss", "--calculate-per-token-loss",
                           "--disable-compute-advantages-and-returns", "--debug-train-only", "--lr", "1e-2"])
    summary = anyio.run(run_training, config)
    assert summary["train_steps"] == 12
    losses = [row["train/loss"] for row in read_metrics(run_dir / "metrics.jsonl")]
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3, losses


def test_a_custom_generate_function_adds_an_image_in_a_later_turn(tmp_path: Path) -> None:
    """slime's `geo3k_vlm_multi_turn` shape (tests/support/vlm_multi_turn.py): the hook sends the prompt's image,
    then an observation turn with a second image, through the coordinator's endpoint to the engine. The trainer
    scores the whole sequence with both images: its logprobs equal the engine's (which they could not if either
    side missed the later image), the observation's tokens untrained; the dump holds both images' grids. On the
    tiny Qwen3-VL (miles' geo3k model family: patch 16, deepstack features, interleaved mrope), so its images go
    over HTTP to the engine and through a rank here (the run above covers Qwen2.5-VL)."""
    import json

    from transformers import AutoTokenizer

    from replay.reader import read_dump
    from tests.support.vlm_multi_turn import OBSERVATION
    from workers.tiny_vlm import TinyVlmSpec, build_tiny_vlm

    vlm_model = build_tiny_vlm(tmp_path / "qwen3-vl", TinyVlmSpec(family="qwen3_vl"))
    assert json.loads((vlm_model / "config.json").read_text())["model_type"] == "qwen3_vl"

    image_token = json.loads((vlm_model / "config.json").read_text())["image_token_id"]
    tokenizer = AutoTokenizer.from_pretrained(str(vlm_model))

    run_dir = tmp_path / "run"
    config = parse_config(["--hf-checkpoint", str(vlm_model), "--run-dir", str(run_dir), "--prompt-data",
                           "builtin:colour", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                           "--rollout-max-response-len", "3", "--rollout-num-engines", "1", "--num-rollout", "1",
                           "--no-progress", "--custom-generate-function-path",
                           "tests.support.vlm_multi_turn.generate",
                           "--save-debug-rollout-data", str(run_dir / "dumps" / "{rollout_id}.rld")])
    summary = anyio.run(run_training, config)
    assert summary["train_steps"] == 1
    (row,) = read_metrics(run_dir / "metrics.jsonl")
    assert row["train/train_rollout_logprob_abs_diff_max"] <= 1e-4
    samples = read_dump(run_dir / "dumps" / "0.rld").samples
    assert len(samples) == 4
    for sample in samples:
        assert sample.multimodal_train_inputs is not None
        assert sample.multimodal_train_inputs["image_grid_thw"] == [[1, 4, 4], [1, 4, 4]]
        response = sample.tokens[-sample.response_length:]
        assert len(response) == len(sample.loss_mask)
        # the observation's image tokens (4: a 1×4×4 grid, merged 2×2; 56x56 pixels resized to 64x64 at patch
        # 16) and its text sit in the response, untrained
        observed = [mask for token, mask in zip(response, sample.loss_mask, strict=True) if token == image_token]
        assert observed == [0, 0, 0, 0], (response, sample.loss_mask)
        assert OBSERVATION in tokenizer.decode(response)
        assert sum(sample.loss_mask) >= 2  # both of the model's turns are trained


def test_an_openai_agent_posts_an_image_to_the_session_server_and_its_trajectory_trains(
        vlm_model: Path, tmp_path: Path) -> None:
    """miles' agentic shape on the tiny VLM (tests/support/vlm_agent.py, the official SDKs): the prompt's image
    reaches the agent as an `image_url` data URL, which agents send in turn through `openai` chat completions,
    `anthropic` Messages (an image block) and `openai` Responses (an input_image part); an http URL is refused
    (400) in each; the session renders the image
    with the VLM's template, the engine gets it as `image_data`, and the sample carries it: its grid in the
    dump, its 4 image tokens in the prompt, the reply's tokens trained. With `--true-on-policy-mode` (miles'
    true_on_policy_vlm shape: batch-invariant decoding, each sequence rescored with its images as a rank scores
    it), the trainer's logprobs are the engine's exactly (one engine call per sample), before and after a sync."""
    import json

    from replay.reader import read_dump

    image_token = json.loads((vlm_model / "config.json").read_text())["image_token_id"]
    run_dir = tmp_path / "run"
    config = parse_config(["--hf-checkpoint", str(vlm_model), "--run-dir", str(run_dir), "--prompt-data",
                           "builtin:colour", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                           "--rollout-max-response-len", "3", "--rollout-num-engines", "1", "--num-rollout", "2",
                           "--no-progress", "--use-session-server", "--true-on-policy-mode",
                           "--custom-generate-function-path", "miles.rollout.generate_hub.agentic_tool_call.generate",
                           "--custom-agent-function-path", "tests.support.vlm_agent.run_agent",
                           "--save-debug-rollout-data", str(run_dir / "dumps" / "{rollout_id}.rld")])
    summary = anyio.run(run_training, config)
    assert summary["train_steps"] == 2
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["train/train_rollout_logprob_abs_diff_max"] for row in rows] == [0.0, 0.0]
    assert [row["weight_version"] for row in rows] == ["1", "2"]  # the second rollout ran on synced weights
    samples = [*read_dump(run_dir / "dumps" / "0.rld").samples, *read_dump(run_dir / "dumps" / "1.rld").samples]
    assert len(samples) == 8
    assert {sample.metadata["format"] for sample in samples} == {"chat", "messages", "responses"}
    for sample in samples:
        seen = sample.metadata
        assert seen["urls"] == 1 and "data URLs" in seen["http_refused"] and "400" in seen["http_refused"], seen
        assert sample.multimodal_train_inputs is not None
        assert sample.multimodal_train_inputs["image_grid_thw"] == [[1, 4, 4]]
        prompt = sample.tokens[:len(sample.tokens) - sample.response_length]
        response = sample.tokens[len(prompt):]
        assert prompt.count(image_token) == 4 and image_token not in response
        assert response == seen["reply_ids"] and sample.loss_mask == [1] * len(response) and response
