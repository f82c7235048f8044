"""SFT's parts: slime's SFT flags parsed into the sft slice (no engines), `--num-epoch` counted from the data, the
SFT rollout's samples (slime's response and mask, one per chat, in epochs), and the NLL loss's token mean."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from coordinator.config import ConfigError, ConfigWarning, parse_config
from coordinator.config.porting import porting_notice
from coordinator.data.source import DataSourceError
from coordinator.rollout.epochs import with_rollout_count
from coordinator.rollout.manager import RolloutManager
from coordinator.rollout.sft_mask import ChatLossMask
from coordinator.train.settings import train_settings
from workers.train_rank.sft_loss import loss_function, sft_loss

SLIME_SFT = "slime.rollout.sft_rollout.generate_rollout"


def write_chats(path: Path, count: int, *, without_assistant: int | None = None) -> Path:
    rows = []
    for i in range(count):
        messages = [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"},
                    {"role": "user", "content": "again"}, {"role": "assistant", "content": f"b{i}"}]
        rows.append({"messages": messages[:1] if i == without_assistant else messages})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def sft_argv(model: Path, data: Path, *extra: str) -> list[str]:
    """slime's SFT_ARGS (scripts/run-qwen3-4B-base-sft.sh), small."""
    return ["--hf-checkpoint", str(model), "--rollout-function-path", SLIME_SFT, "--prompt-data", str(data),
            "--input-key", "messages", "--rollout-shuffle", "--rollout-batch-size", "4", "--global-batch-size", "4",
            "--loss-type", "sft_loss", "--calculate-per-token-loss", "--disable-compute-advantages-and-returns",
            "--debug-train-only", *extra]


def test_slimes_sft_args_parse_into_the_sft_slice_and_start_no_engines(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_chats(tmp_path / "chats.jsonl", 10)
    for extra in ([], ["--apply-chat-template"]):  # slime's scripts pass it or not alike
        config = parse_config(sft_argv(tiny_model_dir, data, "--num-epoch", "3", "--loss-mask-type", "qwen3", *extra))
        assert (config.sft.loss_type, config.sft.loss_mask_type, config.sft.num_epoch) == ("sft_loss", "qwen3", 3)
        assert config.sft.disable_compute_advantages_and_returns
        assert not config.needs_engines and config.num_rollout_engines == 0 and config.needs_train_ranks
        assert config.rollout.rollout_function_path == "coordinator.rollout.sft:SftRollout"
        assert SLIME_SFT in (porting_notice(config) or "")
        assert train_settings(config).loss.loss_type == "sft_loss"
        assert not train_settings(config).loss.recomputes_old_log_probs
    # without --debug-train-only an SFT run starts no engines either; replaying its dumps trains them again
    without = [a for a in sft_argv(tiny_model_dir, data, "--num-rollout", "2") if a != "--debug-train-only"]
    assert not parse_config(without).needs_engines
    replay = parse_config(["--hf-checkpoint", str(tiny_model_dir), "--loss-type", "sft_loss",
                           "--load-debug-rollout-data", str(tmp_path / "{rollout_id}.rld")])
    assert replay.replay_mode and replay.sft.enabled
    with pytest.raises(ConfigError, match="add --loss-type sft_loss"):
        parse_config([a for a in sft_argv(tiny_model_dir, data, "--num-rollout", "2") if a not in ("--loss-type",
                                                                                                "sft_loss")])
    with pytest.raises(ConfigError, match="--loss-type custom_loss: custom loss functions are refused"):
        parse_config(sft_argv(tiny_model_dir, data, "--num-rollout", "2", "--loss-type", "custom_loss"))
    with pytest.raises(ConfigError, match="--loss-mask-type"):
        parse_config(sft_argv(tiny_model_dir, data, "--num-rollout", "2", "--loss-mask-type", "llama"))


def test_num_epoch_sets_the_rollouts_from_the_data_as_slime(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_chats(tmp_path / "chats.jsonl", 10)
    config = with_rollout_count(parse_config(sft_argv(tiny_model_dir, data, "--num-epoch", "3")))
    assert config.rollout.num_rollout == 3 * (10 // 4)  # slime's code: epochs × rollouts per epoch
    assert config.total_train_steps == 6  # the learning-rate schedule's span follows
    with pytest.warns(ConfigWarning, match="--num-epoch 3 is ignored: --num-rollout 5 is given"):
        given = parse_config(sft_argv(tiny_model_dir, data, "--num-epoch", "3", "--num-rollout", "5"))
    assert with_rollout_count(given).rollout.num_rollout == 5
    small = write_chats(tmp_path / "small.jsonl", 3)
    with pytest.raises(ConfigError, match="holds 3 records, fewer than one --rollout-batch-size 4"):
        with_rollout_count(parse_config(sft_argv(tiny_model_dir, small, "--num-epoch", "3")))
    with pytest.raises(ConfigError, match="--disable-rollout-global-dataset"):
        parse_config(sft_argv(tiny_model_dir, data, "--num-epoch", "3", "--disable-rollout-global-dataset"))


async def test_the_sft_rollout_makes_slimes_samples_one_per_chat_in_epochs(tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    data = write_chats(tmp_path / "chats.jsonl", 6)
    chats = [json.loads(line)["messages"] for line in data.read_text().splitlines()]
    manager = RolloutManager.build(parse_config(sft_argv(tiny_model_dir, data, "--num-rollout", "3")))
    assert manager.counts["generate_states"] == 0 and manager.counts["dispatchers"] == 0
    mask = ChatLossMask(AutoTokenizer.from_pretrained(tiny_model_dir), "qwen")
    seen = []
    for rollout_id in range(3):
        batch = await manager.get_rollout(rollout_id, "0")
        assert [len(group) for group in batch.groups] == [1, 1, 1, 1]
        for (sample,) in batch.groups:
            tokens, full_mask = mask(sample.prompt)
            first = full_mask.index(1)
            assert sample.tokens == tokens and sample.response_length == len(tokens) - first
            assert sample.loss_mask == full_mask[first:] and sample.advantage == 0.0 and sample.reward == 0.0
            assert sample.rollout_log_probs == [0.0] * sample.response_length
            seen.append(chats.index(sample.prompt))
        assert batch.metrics["sft/trained_tokens"] == sum(sum(s.loss_mask) for (s,) in batch.groups)
    assert sorted(seen[:6]) == list(range(6))  # an epoch hands every chat out once


async def test_a_chat_without_an_assistant_turn_names_its_record(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_chats(tmp_path / "chats.jsonl", 4, without_assistant=2)
    manager = RolloutManager.build(parse_config(sft_argv(tiny_model_dir, data, "--num-rollout", "1")))
    with pytest.raises(DataSourceError, match=r"record 2 .*no assistant tokens to train on"):
        await manager.get_rollout(0, "0")


def test_the_sft_loss_is_the_token_mean_nll_over_the_mask_whatever_the_split() -> None:
    torch.manual_seed(0)
    log_probs = (-torch.rand(2, 6)).requires_grad_()
    mask = torch.tensor([[0, 1, 1, 0, 1, 1], [1, 0, 0, 1, 1, 0]], dtype=torch.float32)
    loss, sums, _ = sft_loss(log_probs=log_probs, loss_mask=mask, global_loss_tokens=int(mask.sum()),
                             advantages=torch.ones(2, 6))  # a policy-loss input: not part of the NLL
    expected = -(log_probs * mask).sum() / mask.sum()
    assert float(loss.detach()) == pytest.approx(float(expected.detach())) and sums["loss_tokens"] == 7.0
    loss.backward()
    assert torch.equal(log_probs.grad != 0, mask.bool())  # only the trained tokens get a gradient
    # two ranks, each its row, over the step's tokens: their losses add up to the whole
    halves = [float(sft_loss(log_probs=log_probs[i:i + 1], loss_mask=mask[i:i + 1], global_loss_tokens=7)[0]
                    .detach()) for i in range(2)]
    assert sum(halves) == pytest.approx(float(expected.detach()))
    assert loss_function("sft_loss") is sft_loss
    with pytest.raises(ValueError, match="loss_type must be one of"):
        loss_function("custom_loss")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sft_loss(log_probs=log_probs, loss_mask=torch.zeros(2, 6), global_loss_tokens=0)  # no token: loss 0


def test_a_rank_with_sft_loss_trains_the_nll_of_the_masked_tokens(tiny_model_dir: Path) -> None:
    """The rank's first step reports the NLL the untouched model gives the masked response tokens (computed here
    with transformers alone), packed several to a micro-batch or not, and the advantages play no part."""
    from transformers import AutoModelForCausalLM

    from tests.support.train_settings import init_command
    from workers import protocol
    from workers.train_rank.trainer import Trainer

    torch.manual_seed(1)
    samples = []
    for length, response, mask in ((9, 5, [1, 1, 0, 1, 1]), (7, 3, [1, 1, 1]), (11, 6, [0, 0, 1, 1, 1, 1])):
        tokens = torch.randint(5, 60, (length,)).tolist()
        samples.append(protocol.WireSample(tokens=tokens, response_length=response, loss_mask=mask,
                                           rollout_log_probs=[0.0] * response, advantage=float(length)))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    nll, count = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            log_probs = model(torch.tensor([sample.tokens])).logits[0].log_softmax(-1)
            start = len(sample.tokens) - sample.response_length
            for offset, trained in enumerate(sample.loss_mask):
                if trained:
                    nll -= float(log_probs[start + offset - 1, sample.tokens[start + offset]])
                    count += 1
    for budget in (10**6, 12):  # one micro-batch, or one per sample
        trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
        trainer.init(init_command({"model_path": str(tiny_model_dir), "lr": 1e-3, "loss_type": "sft_loss",
                                   "max_tokens_per_micro_batch": budget}))
        step = trainer.train(protocol.TrainCommand(0, [samples], [count])).steps[0]
        assert step.loss == pytest.approx(nll / count, rel=1e-5) and step.loss_tokens == count
        assert step.kl_sum == 0.0 and step.clipped_tokens == 0.0


async def test_sft_samples_dump_and_replay_into_an_sft_run_unchanged(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_chats(tmp_path / "chats.jsonl", 4)
    template = str(tmp_path / "dumps" / "{rollout_id}.rld")
    producing = RolloutManager.build(parse_config(sft_argv(tiny_model_dir, data, "--num-rollout", "1",
                                                           "--save-debug-rollout-data", template)))
    made = await producing.get_rollout(0, "0")
    replaying = RolloutManager.build(parse_config(["--hf-checkpoint", str(tiny_model_dir), "--loss-type", "sft_loss",
                                                   "--disable-compute-advantages-and-returns",
                                                   "--load-debug-rollout-data", template]))
    replayed = await replaying.get_rollout(0, "0")
    fields = ("prompt", "tokens", "response_length", "loss_mask", "rollout_log_probs", "advantage")
    assert [[getattr(s, f) for f in fields] for s in replayed.samples] == \
        [[getattr(s, f) for f in fields] for s in made.samples]


BAD_CHATS = {  # message 1 of a chat, as a careless dataset holds it → what the check says
    "int": ({"role": "assistant", "content": 7}, "content of type int"),
    "dict": ({"role": "assistant", "content": {"text": "a"}}, "content of type dict"),
    "parts": ({"role": "assistant", "content": [{"type": "text", "text": "a"}]}, "list of parts"),
    "null": ({"role": "user", "content": None}, "null content"),
    "null tool call": ({"role": "assistant", "content": None,
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                       "null content, which the chat template does not render"),
    "role": ({"role": "gpt", "content": "a"}, "role 'gpt'"),
    "text part": ({"role": "assistant", "content": [{"type": "text", "text": 3}]}, "list of parts"),
}
#: a template that renders content parts as their text and an assistant's null content as nothing
PARTS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
                  "{{ m['content'] }}{% elif m['content'] is not none %}{% for p in m['content'] %}{{ p['text'] }}"
                  "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_with_bad_line(path: Path, message: dict[str, object]) -> Path:
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    bad = {"messages": [{"role": "user", "content": "q"}, message, {"role": "assistant", "content": "b"}]}
    path.write_text("".join(json.dumps(row) + "\n" for row in (good, good, bad, good)))
    return path


@pytest.mark.parametrize("kind", sorted(BAD_CHATS))
def test_each_bad_chat_row_is_refused_at_start_up_naming_its_line(tiny_model_dir: Path, tmp_path: Path,
                                                                   kind: str) -> None:
    from coordinator.checks.preflight import check_data

    message, words = BAD_CHATS[kind]
    data = write_with_bad_line(tmp_path / "chats.jsonl", message)
    with pytest.raises(ConfigError) as caught:
        check_data(parse_config(sft_argv(tiny_model_dir, data, "--num-rollout", "1")))
    assert f"{data}:3:" in str(caught.value) and words in str(caught.value), str(caught.value)


def test_content_parts_and_a_tool_calls_null_content_pass_where_the_template_takes_them(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    import shutil

    from transformers import AutoTokenizer

    from coordinator.checks.preflight import check_data

    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    tokenizer.chat_template = PARTS_TEMPLATE
    tokenizer.save_pretrained(str(model))
    for kind in ("parts", "null tool call"):
        data = write_with_bad_line(tmp_path / f"{kind}.jsonl", BAD_CHATS[kind][0])
        assert "all 4 record(s)" in check_data(parse_config(sft_argv(model, data, "--num-rollout", "1")))[0]
    for kind in ("int", "dict", "null", "role", "text part"):  # still refused with this template
        data = write_with_bad_line(tmp_path / f"{kind}.jsonl", BAD_CHATS[kind][0])
        with pytest.raises(ConfigError, match=f"{data}:3:") as caught:
            check_data(parse_config(sft_argv(model, data, "--num-rollout", "1")))
        assert kind != "text part" or "'text' is int" in str(caught.value)
    # and the SFT rollout's tokenization takes what passed
    mask = ChatLossMask(AutoTokenizer.from_pretrained(str(model)), "qwen")
    for kind in ("parts", "null tool call"):
        chat = [{"role": "user", "content": "q"}, BAD_CHATS[kind][0], {"role": "assistant", "content": "b"}]
        ids, loss_mask = mask(chat)
        assert len(ids) == len(loss_mask) and sum(loss_mask) > 0
