"""Vision-language parts without processes: the tiny VLM, the image boundary, the processing rule, and the
engine runner's logprobs against the trainer's scoring of the same sequence with its images."""

from __future__ import annotations

import base64
import io
import json
import resource
from pathlib import Path

import pytest
import torch

from tests.support.hostile_images import png, solid_png
from workers.boundary.errors import BoundaryError
from workers.boundary.images import ImageLimits, decode_image, encode_data_url


@pytest.fixture(scope="module")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


#: the families the engine and trainer checks run on (the suite's time is budgeted): the default, Qwen3-VL,
#: whose tower and positions differ most, and Qwen3-VL-MoE (its language model's sparse MoE blocks); Qwen2-VL's
#: tower is Qwen2.5-VL's without window attention (it is built and loaded below; its engine and trainer checks
#: passed when run by hand)
SERVED_CHECKS = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe"])
def family_vlm_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                   tiny_vlm_dir: Path) -> Path:
    """The tiny VLM of each family `make-tiny-model --vlm-family` builds (Qwen2.5-VL: the default's directory)."""
    from workers.tiny_vlm import TinyVlmSpec, build_tiny_vlm

    if request.param == "qwen2_5_vl":
        return tiny_vlm_dir
    return build_tiny_vlm(tmp_path_factory.mktemp(request.param), TinyVlmSpec(family=request.param))


def test_the_tiny_vlm_loads_offline_and_its_text_ids_are_the_text_models(family_vlm_dir: Path) -> None:
    from transformers import AutoModelForImageTextToText

    from workers.tiny_model import vocabulary
    from workers.tiny_vlm import FAMILIES, PATCH_SIZES, QWEN3_FAMILIES
    from workers.vlm_processor import VlmProcessor

    family = json.loads((family_vlm_dir / "rayless_tiny_model.json").read_text())["family"]
    assert family in FAMILIES
    tiny_vlm_dir = family_vlm_dir
    processor = VlmProcessor(tiny_vlm_dir)
    model = AutoModelForImageTextToText.from_pretrained(str(tiny_vlm_dir))
    assert model.config.model_type == family
    patch = PATCH_SIZES[family]
    assert (model.config.vision_config.patch_size, processor.image_processor.patch_size) == (patch, patch)
    if family == "qwen3_vl_moe":  # every decoder layer a sparse MoE block: top-2 of 4 experts
        text_config = model.config.text_config
        assert (text_config.num_experts, text_config.num_experts_per_tok, text_config.decoder_sparse_step) == (4, 2, 1)
    if family in QWEN3_FAMILIES:  # the tower's first block feeds the first decoder layer; interleaved mrope
        assert model.config.vision_config.deepstack_visual_indexes == [0]
        assert model.config.text_config.rope_parameters["mrope_interleaved"] is True
        assert list(processor.image_processor.image_mean) == [0.5, 0.5, 0.5]
    assert processor.tokenizer.encode("3 7=") == [vocabulary()[c] for c in "3 7="]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>colour?<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    vision = processor.pixel_inputs([decode_image(solid_png(56, 84, (255, 0, 0)), "test")])
    # 84 x 56 pixels resized to sides multiple of 2 patches (28: 84 x 56, 32: 96 x 64): 6 x 4 patches either way
    assert vision.image_grid_thw.tolist() == [[1, 6, 4]]
    assert vision.pixel_values.shape == (24, 3 * 2 * patch * patch)
    ids = processor.expand_ids(processor.tokenizer.encode(text), vision.image_grid_thw)
    assert ids.count(processor.image_token_id) == 6  # 6 x 4 patches, merged 2 x 2
    with pytest.raises(ValueError, match=r"1 image placeholder.*for 2 image"):
        processor.expand_ids(processor.tokenizer.encode(text), torch.tensor([[1, 2, 2], [1, 2, 2]]))


def test_make_tiny_model_vlm_refuses_the_text_models_shape_flags(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from coordinator.cli import make_tiny_model_main

    with pytest.raises(SystemExit) as stop:
        make_tiny_model_main([str(tmp_path / "m"), "--vlm", "--words", "<search>"])
    assert stop.value.code == 2
    assert "--words is for the text model only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # --vlm-family implies --vlm
        make_tiny_model_main([str(tmp_path / "m"), "--vlm-family", "qwen3_vl", "--untied-head"])
    assert stop.value.code == 2
    assert "--untied-head is for the text model only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        make_tiny_model_main([str(tmp_path / "m"), "--vlm-family", "qwen3_5"])
    assert stop.value.code == 2
    assert "--vlm-family: invalid choice: 'qwen3_5'" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_image_references_decode_from_paths_file_urls_data_urls_and_bytes(tmp_path: Path) -> None:
    data = solid_png(30, 20, (0, 255, 0))
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    for reference in ("img/a.png", f"file://{tmp_path}/img/a.png", url, data, {"bytes": data, "path": None}):
        image = decode_image(reference, "d.jsonl:3", base_dir=tmp_path)
        assert (image.size, image.mode, image.getpixel((0, 0))) == ((30, 20), "RGB", (0, 255, 0))
    assert decode_image(encode_data_url(image), "x").getpixel((5, 5)) == (0, 255, 0)
    with pytest.raises(BoundaryError, match=r"^d.jsonl:3: image '.*missing.png' cannot be read"):
        decode_image("missing.png", "d.jsonl:3", base_dir=tmp_path)
    with pytest.raises(BoundaryError, match="nothing is fetched from the network"):
        decode_image("https://example.com/a.png", "d.jsonl:4")


def test_hostile_images_are_refused_naming_where_with_memory_bounded() -> None:
    from PIL import Image

    noise = Image.frombytes("RGB", (64, 64), bytes(range(256)) * 48)
    buffer = io.BytesIO()
    noise.save(buffer, format="PNG")
    noisy_png = buffer.getvalue()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cases = {
        "truncated": (noisy_png[: len(noisy_png) // 2], "cannot be decoded"),
        "20k x 20k": (png(20_000, 20_000, rows=1), "20000x20000 pixels|400000000 pixels"),
        # 8 GB of pixels behind a few kilobytes of zlib: refused from its header
        "bomb": (png(50_000, 50_000, rows=200), "decompression bomb is refused"),
        "16-bit grey": (png(8, 8, rows=8, bit_depth=16, color_type=0), "does not convert to RGB"),
        "not an image": (b"GIF89a" + bytes(40), "cannot be decoded"),
        "too many bytes": (bytes(2048), "the limit is 1,024"),
    }
    for name, (data, reason) in cases.items():
        limits = ImageLimits(max_bytes=1024) if name == "too many bytes" else ImageLimits()
        with pytest.raises(BoundaryError, match=reason) as refused:
            decode_image(data, f"prompts.jsonl:{len(name)}", limits=limits)
        assert refused.value.source == f"prompts.jsonl:{len(name)}", name
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 * 1024  # decoding the 20k x 20k image alone would take 1.2 GB


def engine_rollout(tiny_vlm_dir: Path, batch_invariant: bool = False
                   ) -> tuple[object, dict[str, tuple[list[int], list[int], list[float]]], object]:
    """A VLM row (two images) and a text row prefilled and decoded together in the engine's runner (or the
    batch-invariant one, each row decoded alone): (runner, {row: (prompt ids, output ids, output logprobs)},
    the VLM row's images)."""
    from workers.engine.batch_invariant import BatchInvariantRunner
    from workers.engine.runner import ModelRunner, PrefillItem
    from workers.engine.sampling import RowSampling

    runner = (BatchInvariantRunner if batch_invariant else ModelRunner)(str(tiny_vlm_dir))
    processor = runner.vision_processor
    assert processor is not None
    tokenizer = processor.tokenizer

    def prompt(images: int, text: str) -> list[int]:
        content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                              tokenize=False, add_generation_prompt=True))

    vision = processor.pixel_inputs([decode_image(solid_png(56, 84, (255, 0, 0)), "a"),
                                     decode_image(solid_png(100, 60, (0, 0, 255)), "b")])
    prompts = {"vlm": processor.expand_ids(prompt(2, "colours?"), vision.image_grid_thw),
               "text": prompt(0, "hello there, what")}

    def sampling(seed: int) -> RowSampling:
        return RowSampling(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0,
                           generator=torch.Generator().manual_seed(seed))

    out = runner.step(drop=[], prefills=[PrefillItem("text", prompts["text"], sampling(1)),
                                         PrefillItem("vlm", prompts["vlm"], sampling(2), vision=vision)],
                      decode=None)
    assert runner._rope_delta["vlm"] < 0  # the images' positions are fewer than their tokens
    tokens = {row: [o.sample.token] for row, o in out.items() if o.sample}
    logprobs = {row: [o.sample.logprob] for row, o in out.items() if o.sample}
    rows = {"vlm": sampling(3), "text": sampling(4)}
    for _ in range(6):
        for row, o in runner.step(drop=[], prefills=[], decode=rows).items():
            assert o.sample is not None
            tokens[row].append(o.sample.token)
            logprobs[row].append(o.sample.logprob)
    return runner, {row: (prompts[row], tokens[row], logprobs[row]) for row in prompts}, vision


@pytest.mark.parametrize("family_vlm_dir", SERVED_CHECKS, indirect=True)
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["batched", "batch-invariant"])
def test_engine_logprobs_with_images_equal_a_full_forward_with_mrope(family_vlm_dir: Path,
                                                                     batch_invariant: bool) -> None:
    """A VLM row and a text row decoded in one batch: each sampled token's logprob equals the trainer's scoring
    (`token_scores` on prompt + output, with the images and the family's positions) of the same sequence; for
    Qwen3-VL with its deepstack features and interleaved mrope; and the model's own forward (positions made by
    the model itself) agrees."""
    from workers.shared_torch.token_scores import token_scores
    from workers.vlm_processor import rope_positions

    tiny_vlm_dir = family_vlm_dir

    runner, rows, vision = engine_rollout(tiny_vlm_dir, batch_invariant)
    image_token_id = runner.vision_processor.image_token_id
    for row, (ids, tokens, logprobs) in rows.items():
        sequence = torch.tensor([ids + tokens])
        if row == "text":
            positions, extra = torch.arange(sequence.shape[1]).unsqueeze(0), None
        else:
            positions, _ = rope_positions(runner.model, sequence, vision.image_grid_thw, image_token_id)
            extra = {"pixel_values": vision.pixel_values, "image_grid_thw": vision.image_grid_thw}
        with torch.no_grad():
            scored, _ = token_scores(runner.model, input_ids=sequence, position_ids=positions, with_entropy=False,
                                     vision=extra)
        expected = scored[0, len(ids) - 1:].tolist()
        assert max(abs(a - b) for a, b in zip(expected, logprobs, strict=True)) < 1e-5, row
        if row == "vlm" and not batch_invariant:
            # the model's own forward, which makes its positions itself from the token types: the same scores
            with torch.no_grad():
                logits = runner.model(input_ids=sequence, mm_token_type_ids=(sequence == image_token_id).int(),
                                      **extra).logits[0, len(ids) - 1:-1].float()
            own = logits.log_softmax(-1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).view(-1).tolist()
            assert max(abs(a - b) for a, b in zip(own, logprobs, strict=True)) < 1e-5


@pytest.mark.parametrize("family_vlm_dir", SERVED_CHECKS, indirect=True)
def test_the_trainer_packs_a_vlm_sample_with_a_text_one_and_matches_the_engines_logprobs(
        family_vlm_dir: Path) -> None:
    """The samples as the rank receives them (images on the wire): packed in one row with multimodal positions,
    the rank's logprobs equal the engine's; a train step runs and moves the weights; images malformed on the
    wire are refused naming the sample. Each family."""
    from msgspec.structs import replace

    from tests.support.train_settings import init_command
    from workers import protocol
    from workers.protocol.control import wire_images
    from workers.train_rank.batching import BatchError
    from workers.train_rank.trainer import Trainer

    tiny_vlm_dir = family_vlm_dir
    _, rows, vision = engine_rollout(tiny_vlm_dir)
    images = {"pixel_values": vision.pixel_values, "image_grid_thw": vision.image_grid_thw}
    samples = [protocol.WireSample(tokens=ids + out, response_length=len(out), loss_mask=[1] * len(out),
                                   rollout_log_probs=logprobs, advantage=1.0 if row == "vlm" else -1.0,
                                   images=wire_images(images) if row == "vlm" else None)
               for row, (ids, out, logprobs) in rows.items()]
    frame = protocol.encode_frame(protocol.Request(1, protocol.TrainCommand(0, [samples], [1])))
    decoded = protocol.decode_body(bytearray(frame[4:]))  # through the wire, as a rank receives them
    assert isinstance(decoded, protocol.Request) and isinstance(decoded.command, protocol.TrainCommand)
    decoded.command.attach_images()  # as Trainer.train does: the image set came once, in the command's table
    samples = decoded.command.steps[0]
    trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    trainer.init(init_command({"model_path": str(tiny_vlm_dir), "lr": 1e-2, "max_tokens_per_micro_batch": 4096,
                               "seed": 3, "use_rollout_logprobs": True}))
    batches = trainer._micro_batches(samples)
    assert len(batches) == 1 and batches[0].position_ids.shape[0] == 4  # packed, multimodal positions
    batch = batches[0]
    computed = trainer._log_probs(batch).view(-1)
    for (start, end), sample in zip(batch.spans, samples, strict=True):
        difference = (computed[start:end] - torch.tensor(sample.rollout_log_probs)).abs().max()
        assert float(difference) < 1e-5
    visual_before = next(trainer.model.model.visual.parameters()).detach().clone()
    step = trainer.train(protocol.TrainCommand(0, [samples], [sum(len(s.loss_mask) for s in samples)])).steps[0]
    assert step.logprob_abs_diff_max < 1e-5 and step.grad_norm > 0
    assert not torch.equal(visual_before, next(trainer.model.model.visual.parameters()))  # the tower trains
    broken = replace(samples[0], images=replace(samples[0].images, image_grid_thw=[[1, 2, 2]]))
    with pytest.raises(BatchError, match=r"sample 0: images: .* does not add up"):
        trainer._micro_batches([broken, samples[1]])


def test_true_on_policy_rescoring_with_images_is_the_trainers_logprobs_exactly(tiny_vlm_dir: Path) -> None:
    """`--rl-on-policy-target` on a VLM: the engine's rescorer scores a finished sequence with its images as a
    rank scores that one sample (micro-batch size 1, train mode, autograd on, images through the wire): equal
    floats, not close ones."""
    from tests.support.train_settings import init_command
    from workers import protocol
    from workers.engine.rescoring import Rescorer
    from workers.protocol.control import wire_images
    from workers.train_rank.trainer import Trainer

    runner, rows, vision = engine_rollout(tiny_vlm_dir, batch_invariant=True)
    ids, output, decoded = rows["vlm"]
    rescored = Rescorer(runner).rescore([(ids, output, vision), (rows["text"][0], rows["text"][1], None)])
    assert max(abs(a - b) for a, b in zip(rescored[0], decoded, strict=True)) < 1e-5  # the same sequence
    images = wire_images({"pixel_values": vision.pixel_values, "image_grid_thw": vision.image_grid_thw})
    samples = [protocol.WireSample(tokens=ids + output, response_length=len(output), loss_mask=[1] * len(output),
                                   rollout_log_probs=rescored[0], advantage=1.0, images=images),
               protocol.WireSample(tokens=rows["text"][0] + rows["text"][1], response_length=len(rows["text"][1]),
                                   loss_mask=[1] * len(rows["text"][1]), rollout_log_probs=rescored[1],
                                   advantage=1.0)]
    frame = protocol.encode_frame(protocol.Request(1, protocol.TrainCommand(0, [samples], [1])))
    decoded_frame = protocol.decode_body(bytearray(frame[4:]))
    assert isinstance(decoded_frame, protocol.Request) and isinstance(decoded_frame.command, protocol.TrainCommand)
    decoded_frame.command.attach_images()  # as Trainer.train does: the image set came once, in the command's table
    trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    trainer.init(init_command({"model_path": str(tiny_vlm_dir), "lr": 1e-2, "max_tokens_per_micro_batch": 4096,
                               "seed": 3, "micro_batch_size": 1, "use_rollout_logprobs": True}))
    trainer.model.train()
    batches = trainer._micro_batches(decoded_frame.command.steps[0])
    assert len(batches) == 2 and batches[0].position_ids.shape[0] == 4
    for batch, sample in zip(batches, samples, strict=True):
        log_probs, _ = trainer._scores(batch, trainer.model, with_entropy=True)
        assert log_probs.requires_grad
        start, end = batch.spans[0]
        assert log_probs.view(-1)[start:end].tolist() == sample.rollout_log_probs  # bit for bit


def test_multimodal_keys_turn_rows_into_chats_with_image_parts_as_slime(tmp_path: Path) -> None:
    from coordinator.data.source import read_prompt_file

    (tmp_path / "figs").mkdir()
    (tmp_path / "figs" / "a.png").write_bytes(solid_png(28, 28, (255, 0, 0)))
    blue = "data:image/png;base64," + base64.b64encode(solid_png(30, 30, (0, 0, 255))).decode()
    rows = [{"problem": "<image>Which is red? <image>", "images": ["figs/a.png", blue], "answer": "1"},
            {"problem": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image>Hue?"}],
             "images": "figs/a.png", "answer": "red"}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    first, second = read_prompt_file(path, input_key="problem", label_key="answer",
                                     multimodal_keys={"image": "images"})
    assert first.prompt == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which is red? "},
                                                         {"type": "image"}]}]
    # kept encoded (the file by its path, the data URL by its bytes), decoded when taken
    assert first.images[0].path == tmp_path / "figs" / "a.png" and first.images[1].data.startswith(b"\x89PNG")
    assert [image.load().getpixel((0, 0)) for image in first.images] == [(255, 0, 0), (0, 0, 255)]
    assert second.prompt[0] == {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    assert second.prompt[1]["content"][0] == {"type": "image"} and len(second.images) == 1


@pytest.mark.parametrize(("row", "reason"), [
    ({"problem": "<image><image>x", "images": ["a.png"]}, r"d.jsonl:2: the prompt has 2 <image> placeholder\(s\) "
                                                          r"for 1 image\(s\) in 'images'"),
    ({"problem": "no placeholder", "images": ["a.png"]}, r"d.jsonl:2: the prompt has 0 <image>"),
    ({"problem": "<image>x"}, r"d.jsonl:2: key 'images' \(--multimodal-keys image\) is missing"),
    ({"problem": "<image>x", "images": ["cut.png"]}, r"d.jsonl:2: images\[0\]: the image cannot be decoded"),
    ({"problem": "<image>x", "images": ["gone.png"]}, r"d.jsonl:2: images\[0\]: image '.*gone.png' cannot be read"),
])
def test_a_bad_image_row_is_named_by_file_and_line_at_start_up(tmp_path: Path, row: dict[str, object],
                                                               reason: str) -> None:
    """The start-up check (`check_data_file`) and the reader give the same reason for the same line."""
    from coordinator.data.check import RecordKeys, check_data_file
    from coordinator.data.source import DataSourceError, read_prompt_file

    (tmp_path / "a.png").write_bytes(solid_png(28, 28, (0, 255, 0)))
    (tmp_path / "cut.png").write_bytes(solid_png(64, 64, (0, 255, 0))[:60])
    path = tmp_path / "d.jsonl"
    good = {"problem": "<image>fine", "images": ["a.png"]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    keys = {"image": "images"}
    with pytest.raises(DataSourceError, match=reason):
        check_data_file(path, RecordKeys(input_key="problem", multimodal_keys=keys))
    with pytest.raises(DataSourceError, match=reason):
        read_prompt_file(path, input_key="problem", multimodal_keys=keys)


def test_parquet_image_bytes_render_through_the_vlms_template(tmp_path: Path, tiny_vlm_dir: Path) -> None:
    """geo3k's shape: Parquet rows holding `{"bytes", "path"}` image cells; the chat renders with the model's
    template, one `<|image_pad|>` per image for the processor to expand."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from coordinator.data.source import PromptDataSource

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": f"<image>Angle {i}?", "answer": str(i),
                                          "images": [{"bytes": solid_png(28, 28, (i, 0, 0)), "path": None}]}
                                         for i in range(3)]), path)
    source = PromptDataSource(path, input_key="problem", label_key="answer", shuffle=False, seed=0,
                              multimodal_keys={"image": "images"},
                              tokenizer=AutoTokenizer.from_pretrained(str(tiny_vlm_dir)))
    record = source.take(1)[0]
    assert record.prompt == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Angle 0?<|im_end|>\n"
                             "<|im_start|>assistant\n")
    assert record.label == "0" and record.images[0].getpixel((1, 1)) == (0, 0, 0)


def test_the_colour_task_draws_labelled_images_reproducibly() -> None:
    from coordinator.data.image_tasks import COLOURS, make_colour_prompts

    records = make_colour_prompts(30, seed=4)
    assert [r.label for r in records] == [r.label for r in make_colour_prompts(30, seed=4)]
    assert {r.label for r in records} == set(COLOURS)
    for record in records:
        pixels = set(record.images[0].get_flattened_data()) - {(0, 0, 0)}
        channel = "rgb".index(record.label)
        assert pixels and all(max(p) == p[channel] for p in pixels)  # the shape is of its label's colour


def test_a_vlm_run_is_refused_at_start_up_where_images_cannot_go(tmp_path: Path, tiny_vlm_dir: Path,
                                                                 tiny_model_dir: Path) -> None:
    from coordinator.config import ConfigError, parse_config

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "<image>x", "images": []}) + "\n")
    base = ["--run-dir", str(tmp_path / "run"), "--rollout-num-engines", "1", "--num-rollout", "1",
            "--rollout-batch-size", "1"]
    keys = ["--prompt-data", str(data), "--multimodal-keys", '{"image": "images"}']
    cases = [
        (["--hf-checkpoint", str(tiny_model_dir), *keys], "prompts with images need a vision-language "
                                                          "--hf-checkpoint"),
        (["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", "builtin:colour"], "--prompt-data builtin:colour"),
        # an eval dataset that is an image task, beside text training data
        (["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", "builtin:first_digit", "--eval-prompt-data",
          "colour", "builtin:colour", "--eval-interval", "1"], "--eval-prompt-data colour builtin:colour: prompts "
                                                              "with images need"),
        (["--hf-checkpoint", str(tiny_vlm_dir), "--prompt-data", "builtin:colour", "--multimodal-keys",
          '{"image": "images"}'], "draws its images itself"),
        (["--hf-checkpoint", str(tiny_vlm_dir), "--prompt-data", str(data), "--multimodal-keys",
          '{"video": "clips"}'], "'video': only images are served"),
    ]
    for argv, reason in cases:
        with pytest.raises(ConfigError) as refused:
            parse_config([*base, *argv])
        assert reason in str(refused.value), argv
    parse_config([*base, "--hf-checkpoint", str(tiny_vlm_dir), *keys])  # a VLM with images: accepted
    parse_config([*base, "--hf-checkpoint", str(tiny_vlm_dir), "--prompt-data", "builtin:colour",
                  "--eval-prompt-data", "colour", "builtin:colour", "digits", "builtin:first_digit",
                  "--eval-interval", "1"])
    # a custom generate function carries images (slime's geo3k_vlm_multi_turn shape): accepted
    parse_config([*base, "--hf-checkpoint", str(tiny_vlm_dir), *keys, "--custom-generate-function-path", "m.f"])
    parse_config([*base, "--hf-checkpoint", str(tiny_vlm_dir), *keys, "--use-session-server"])  # images carried
    # true-on-policy: the engine's rescorer takes the images (test_true_on_policy_rescoring_...): accepted
    parse_config([*base, "--hf-checkpoint", str(tiny_vlm_dir), *keys, "--deterministic-mode", "--true-on-policy-mode"])


def test_an_image_task_evaluated_gets_the_processor_its_prompts_need(tmp_path: Path, tiny_vlm_dir: Path) -> None:
    """`--eval-prompt-data colour builtin:colour` on a VLM: the eval's generate state has the policy's processor
    (chosen as the rollout's: by `--multimodal-keys` or a built-in image task), so each record's prompt ids come
    with its image tokens expanded and the trainer's pixel inputs; a text dataset beside it gets none."""
    from transformers import AutoTokenizer

    from coordinator.config import parse_config
    from coordinator.eval.run import generate_state
    from coordinator.eval.settings import EvalSettings, load_eval_datasets
    from coordinator.rollout.requests import with_images

    config = parse_config(["--hf-checkpoint", str(tiny_vlm_dir), "--run-dir", str(tmp_path / "run"),
                           "--prompt-data", "builtin:colour", "--rollout-num-engines", "1", "--num-rollout", "1",
                           "--rollout-batch-size", "1", "--eval-prompt-data", "colour", "builtin:colour", "digits",
                           "builtin:first_digit", "--eval-interval", "1"])
    settings = EvalSettings.from_slices(config.eval, rollout=config.rollout, sglang=config.sglang)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm_dir)
    colour, digits = load_eval_datasets(settings, tokenizer)
    state = generate_state(colour, tokenizer=tokenizer, context_length=4096, concurrency=4)
    record = colour.records[0]
    prompt_ids = state.encode(str(record.prompt))
    ids, inputs = with_images(state, record, prompt_ids)
    assert inputs is not None and len(ids) > len(prompt_ids)  # the image's placeholder expanded to its tokens
    assert generate_state(digits, tokenizer=tokenizer, context_length=4096, concurrency=4).vision is None


def test_a_hooks_sample_with_images_is_made_whole_or_refused_naming_the_hook(tiny_vlm_dir: Path) -> None:
    """`GenerateState(args).processor(text=, images=)` expands the placeholders as the coordinator does; a hook's
    sample gets `multimodal_train_inputs` for all its `multimodal_inputs` images (the prompt's and a later
    turn's) when it left them unset, and one whose image tokens do not match its images is refused."""
    from PIL import Image

    from coordinator.rollout.requests import GenerateState, settle_hook_images
    from replay.sample import Sample
    from workers.vlm_processor import VlmInputError, VlmProcessor

    vision = VlmProcessor(tiny_vlm_dir)
    text = "<|vision_start|><|image_pad|><|vision_end|>x"
    red, green = Image.new("RGB", (56, 56), (200, 0, 0)), Image.new("RGB", (28, 84), (0, 200, 0))
    out = vision(text=text, images=[red])
    ids = out["input_ids"][0]
    assert ids.count(vision.image_token_id) == 4 and out["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert vision(text=text, images=[red], return_tensors="pt")["input_ids"].shape == (1, len(ids))
    with pytest.raises(VlmInputError, match="1 image placeholder"):
        vision(text=text)
    second = vision(text=text, images=[green])["input_ids"][0]
    state = GenerateState(tokenizer=vision.tokenizer, sampling_params={}, max_response_len=8, context_length=512,
                          concurrency=1, seed=0, vision=vision)
    sample = Sample(tokens=[*ids, *second], response_length=len(second), loss_mask=[0] * len(second),
                    rollout_log_probs=[0.0] * len(second), multimodal_inputs={"images": [red, green]})
    settle_hook_images(state, sample, where="hook")
    grids = sample.multimodal_train_inputs["image_grid_thw"].tolist()
    assert grids == [[1, 4, 4], [1, 8, 4]]  # the processor resizes within its pixel bounds
    assert sample.multimodal_train_inputs["pixel_values"].shape[0] == 16 + 32
    sample.multimodal_inputs["images"].append(red)  # an image the sequence has no tokens for
    sample.multimodal_train_inputs = None
    with pytest.raises(ValueError, match="hook: the input ids hold 12 image token"):
        settle_hook_images(state, sample, where="hook")


@pytest.mark.anyio
@pytest.mark.parametrize("family_vlm_dir", SERVED_CHECKS, indirect=True)
async def test_engine_image_data_is_checked_and_expanded_before_anything_runs(family_vlm_dir: Path) -> None:
    """SGLang's `image_data` on /generate: with `input_ids` the ids must hold the expanded placeholders; with
    `text` the template's one placeholder per image is expanded; a bad image or count is a 400 naming it. Each
    family (a 56x56 image is 2x2 merged patches at patch 14 and at Qwen3-VL's 16, resized to 64x64)."""
    from types import SimpleNamespace

    from workers.engine.generate_request import RequestBuilder
    from workers.engine.runner import ModelRunner
    from workers.engine.sampling import RequestError

    runner = ModelRunner(str(family_vlm_dir))
    processor = runner.vision_processor
    assert processor is not None
    builder = RequestBuilder(SimpleNamespace(runner=runner, context_length=1024))  # type: ignore[arg-type]
    red = encode_data_url(decode_image(solid_png(56, 56, (255, 0, 0)), "x"))
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>colour?<|im_end|>\n<|im_start|>assistant\n"
    single = processor.tokenizer.encode(text)
    prompts = [list(single)]
    (vision,) = await builder._images({"image_data": red}, prompts, from_text=True)
    assert vision is not None and vision.image_grid_thw.tolist() == [[1, 4, 4]]
    assert prompts[0].count(processor.image_token_id) == 4 and len(prompts[0]) == len(single) + 3
    expanded = prompts[0]
    assert (await builder._images({"image_data": [red]}, [list(expanded)], from_text=False))[0] is not None
    with pytest.raises(RequestError, match=r"the input ids hold 1 image token\(s\); the 1 image\(s\) take 4"):
        await builder._images({"image_data": [red]}, [list(single)], from_text=False)
    with pytest.raises(RequestError, match=r"image_data\[0\]\[0\]: the image is over the limit"):
        bomb = "data:image/png;base64," + base64.b64encode(png(50_000, 50_000, rows=1)).decode()
        await builder._images({"image_data": [bomb]}, [list(expanded)], from_text=False)
    with pytest.raises(RequestError, match=r"one image or list of images per prompt \(2\)"):
        await builder._images({"image_data": [[red]]}, [list(expanded), list(expanded)], from_text=False)
    runner.vision_processor = None
    with pytest.raises(RequestError, match="not a vision-language model"):
        await builder._images({"image_data": [red]}, [list(expanded)], from_text=False)


@pytest.mark.parametrize(("family_vlm_dir", "targets"), [
    ("qwen2_5_vl", ("q_proj", "v_proj")), ("qwen2_5_vl", ("q_proj", "v_proj", "qkv")),
    ("qwen3_vl", ("q_proj", "v_proj", "qkv")),
], indirect=["family_vlm_dir"], ids=["language-model", "and-vision-tower", "and-vision-tower-qwen3-vl"])
def test_lora_adapts_the_language_model_or_both_and_the_engine_serves_the_merge(family_vlm_dir: Path,
                                                                                targets: tuple[str, ...]) -> None:
    """`--target-modules` of the language model's projections adapt it alone; the vision tower's `qkv` adds its
    blocks (Qwen2.5-VL's, and Qwen3-VL's, whose deepstack mergers stay frozen). After a step, the engine loading
    the merged weights scores the VLM sample as the trainer does."""
    tiny_vlm_dir = family_vlm_dir
    from tests.support.train_settings import init_command
    from workers import protocol
    from workers.protocol.control import wire_images
    from workers.train_rank import lora
    from workers.train_rank.trainer import Trainer

    runner, rows, vision = engine_rollout(tiny_vlm_dir)
    images = {"pixel_values": vision.pixel_values, "image_grid_thw": vision.image_grid_thw}
    samples = [protocol.WireSample(tokens=ids + out, response_length=len(out), loss_mask=[1] * len(out),
                                   rollout_log_probs=logprobs, advantage=1.0 if row == "vlm" else -1.0,
                                   images=wire_images(images) if row == "vlm" else None)
               for row, (ids, out, logprobs) in rows.items()]
    trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    trainer.init(init_command({"model_path": str(tiny_vlm_dir), "lr": 5e-2, "max_tokens_per_micro_batch": 4096,
                               "seed": 3, "use_rollout_logprobs": True,
                               "lora": {"rank": 4, "alpha": 8, "target_modules": list(targets)}}))
    adapted = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    assert adapted and all("lora_" in name for name in adapted)
    assert any("visual" in name for name in adapted) == ("qkv" in targets)
    step = trainer.train(protocol.TrainCommand(0, [samples], [sum(len(s.loss_mask) for s in samples)])).steps[0]
    assert step.logprob_abs_diff_max < 1e-5 and step.grad_norm > 0
    merged = {name: entry.full_tensor() if isinstance(entry, lora.MergedWeight) else entry
              for name, entry in lora.engine_tensors(trainer.model)}
    runner.load_tensors(merged, require_all=False)
    batch = trainer._micro_batches(samples)[0]
    trained = trainer._log_probs(batch).view(-1)
    (start, end) = batch.spans[0]
    from workers.shared_torch.token_scores import token_scores
    from workers.vlm_processor import rope_positions

    sequence = torch.tensor([samples[0].tokens])
    positions, _ = rope_positions(runner.model, sequence, vision.image_grid_thw, runner.vision_processor.image_token_id)
    with torch.no_grad():
        served, _ = token_scores(runner.model, input_ids=sequence, position_ids=positions, with_entropy=False,
                                 vision=images)
    response = served[0, len(samples[0].tokens) - samples[0].response_length - 1:]
    assert float((response - trained[start:end]).abs().max()) < 1e-5
    assert float((response - torch.tensor(samples[0].rollout_log_probs)).abs().max()) > 1e-4  # the step moved it


def test_session_image_parts_render_expand_and_refuse_as_the_session_server_needs(tiny_vlm_dir: Path) -> None:
    """`coordinator.sessions.images`: image_url parts become the template's images, a later turn's new image is
    expanded while the stored turn's already expanded run is kept, a count that does not fit and a URL to fetch
    are refused; an agent's chat gets the data's images as data URLs."""
    from coordinator.sessions.images import (
        agent_messages,
        decode_urls,
        expand_image_runs,
        image_urls,
        template_messages,
    )
    from coordinator.sessions.tito import SessionRequestError, TitoTokenizer
    from workers.vlm_processor import VlmProcessor

    processor = VlmProcessor(tiny_vlm_dir)
    red, blue = decode_image(solid_png(56, 56, (255, 0, 0)), "a"), decode_image(solid_png(100, 60, (0, 0, 255)), "b")
    chat = agent_messages([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}],
                          [red])
    assert isinstance(chat, list) and chat[0]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
    urls = image_urls(chat)
    assert decode_urls(urls)[0].tobytes() == red.tobytes()
    assert template_messages(chat)[0]["content"][0] == {"type": "image"}
    tito = TitoTokenizer(processor.tokenizer)
    tito.message_parts = template_messages
    first = tito.first_prompt(chat, None)
    pixels = processor.pixel_inputs([red])
    expanded = expand_image_runs(first, pixels, processor)
    assert expanded == processor.expand_ids(first, pixels.image_grid_thw)  # the data path's own expansion
    # a second turn: the stored (expanded) ids, then a user message with a new image (one placeholder)
    later = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": encode_data_url(blue)}}]}]
    appended = tito.appended_ids({"role": "assistant", "content": "r"}, later, None)
    both = processor.pixel_inputs([red, blue])
    ids = expand_image_runs(expanded + appended, both, processor)
    processor.check_expanded(ids, both.image_grid_thw)
    assert ids[:len(expanded)] == expanded and ids.count(processor.image_token_id) == sum(
        processor.image_tokens(grid.tolist()) for grid in both.image_grid_thw)
    # a tool's screenshot (an Anthropic tool_result's image block) sits in a tool message: rendered and expanded alike
    tool = [{"role": "tool", "tool_call_id": "t1", "content": [
        {"type": "text", "text": "shot:"}, {"type": "image_url", "image_url": {"url": encode_data_url(blue)}}]}]
    assert image_urls(tool) == [encode_data_url(blue)]
    shown = expand_image_runs(expanded + tito.appended_ids({"role": "assistant", "content": "r"}, tool, None), both,
                              processor)
    processor.check_expanded(shown, both.image_grid_thw)
    assert shown[:len(expanded)] == expanded and shown.count(processor.image_token_id) == ids.count(
        processor.image_token_id)
    with pytest.raises(SessionRequestError, match="1 image placeholder"):
        expand_image_runs(first, both, processor)
    with pytest.raises(SessionRequestError, match="do not match its 0 image"):  # an image token without an image
        expand_image_runs(first, None, processor)
    assert expand_image_runs([5, 6], None, processor) == [5, 6]
    with pytest.raises(SessionRequestError, match="base64 data URLs"):
        image_urls([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}])
    with pytest.raises(SessionRequestError, match="cannot be decoded"):
        decode_urls(["data:image/png;base64,aGVsbG8="])
    assert agent_messages("a text prompt", [red]) == "a text prompt"
def test_a_vlm_rank_given_no_sample_runs_its_empty_micro_batch(tiny_vlm_dir: Path) -> None:
    """A global batch smaller than the ranks leaves a rank an empty step: on a VLM its one padding micro-batch
    takes the multimodal position form too, and its step has no loss tokens and no gradient."""
    from tests.support.train_settings import init_command
    from workers import protocol
    from workers.train_rank.trainer import Trainer

    trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    trainer.init(init_command({"model_path": str(tiny_vlm_dir), "lr": 1e-5, "max_tokens_per_micro_batch": 4096}))
    (batch,) = trainer._micro_batches([])
    assert batch.num_tokens == 0 and batch.vision is None and float(batch.loss_mask.sum()) == 0
    assert batch.position_ids is not None and tuple(batch.position_ids.shape) == (4, 1, batch.input_ids.shape[1])
    (step,) = trainer.train(protocol.TrainCommand(0, [[]], [1])).steps
    assert step.loss_tokens == 0 and step.loss == 0 and step.grad_norm == 0  # the padding carries no gradient


def test_a_micro_batch_of_text_samples_on_a_vlm_attends_within_each_sample(tiny_vlm_dir: Path) -> None:
    """A VLM run's micro-batch without images (text prompts beside image ones) packs as a text one does: each
    sample's logprobs are those of its own forward (with plain position ids the model attended across the row:
    0.1 off before)."""
    from tests.support.train_settings import init_command
    from workers import protocol
    from workers.train_rank.trainer import Trainer

    trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    trainer.init(init_command({"model_path": str(tiny_vlm_dir), "lr": 1e-5, "max_tokens_per_micro_batch": 4096}))
    samples = [protocol.WireSample(tokens=list(range(first, first + length)), response_length=5, loss_mask=[1] * 5,
                                   rollout_log_probs=[0.0] * 5) for first, length in ((3, 20), (30, 12))]
    batch = trainer._micro_batches(samples)[0]
    assert batch.position_ids is not None and batch.position_ids.shape[0] == 4 and batch.vision is None
    packed = trainer._log_probs(batch).view(-1)
    for (start, end), sample in zip(batch.spans, samples, strict=True):
        with torch.no_grad():
            ids = torch.tensor([list(sample.tokens)])
            own = torch.log_softmax(trainer.model(input_ids=ids).logits[0, :-1].float(), -1)
        expected = own.gather(-1, ids[0, 1:, None])[-5:, 0]
        assert float((packed[start:end] - expected).abs().max()) < 1e-5


def test_the_engine_loads_a_vlm_checkpoint_from_disk_under_either_naming(tiny_vlm_dir: Path, tmp_path: Path) -> None:
    """`/update_weights_from_disk` on a VLM engine takes the checkpoint as transformers saves it and the hub holds
    Qwen2.5-VL (`model.layers...`, `visual...`: an eval fleet pins `--hf-checkpoint` so at step 0) and as the
    loaded model names it (`model.language_model...`, `model.visual...`: a rank's export), as SGLang's loader
    does; every weight lands, and a name of neither form is still refused."""
    import json
    import struct

    import torch
    from safetensors.torch import save_file

    from workers.engine.runner import ModelRunner, WeightUpdateError

    stored = tiny_vlm_dir / "model.safetensors"
    header = json.loads(stored.read_bytes()[8:8 + struct.unpack("<Q", stored.read_bytes()[:8])[0]])
    header.pop("__metadata__", None)
    assert any(name.startswith("visual.") for name in header)  # the saved form: the test reads what it claims
    runner = ModelRunner(str(tiny_vlm_dir))
    state = {name: tensor.detach().clone() for name, tensor in runner.model.state_dict().items()}
    with torch.no_grad():
        for parameter in runner.model.parameters():
            parameter.add_(1.0)
    assert runner.load_from_disk(str(tiny_vlm_dir)) == len(header)
    assert all(torch.equal(runner.model.state_dict()[name], state[name]) for name in state)

    loaded_form = tmp_path / "loaded-form"
    loaded_form.mkdir()
    save_file({name: tensor.contiguous() for name, tensor in state.items()
               if name != "lm_head.weight" or not runner.model.config.get_text_config().tie_word_embeddings},
              str(loaded_form / "model.safetensors"))
    assert runner.load_from_disk(str(loaded_form)) > 0

    save_file({"model.nonsense.weight": torch.zeros(2)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(WeightUpdateError, match=r"unknown parameter 'model\.nonsense\.weight'"):
        runner.load_from_disk(str(tmp_path / "bad.safetensors"))


def test_a_vlm_critic_reads_the_images_and_its_tower_trains(tiny_vlm_dir: Path) -> None:
    """PPO on a VLM: the critic's values after the images come from the images (another image, other values),
    as the policy's logprobs do, and its vision tower gets gradients — without them its optimizer held no state
    for the tower, and a resumed run failed to load the checkpoint it saved."""
    from tests.support.train_settings import flat_settings
    from workers import protocol
    from workers.protocol.control import wire_images
    from workers.protocol.train_settings import CriticSettings, ReturnsSettings
    from workers.train_rank.trainer import Trainer

    _, rows, vision = engine_rollout(tiny_vlm_dir)
    ids, out, logprobs = rows["vlm"]
    images = {"pixel_values": vision.pixel_values, "image_grid_thw": vision.image_grid_thw}
    settings = flat_settings({"model_path": str(tiny_vlm_dir), "lr": 1e-3, "max_tokens_per_micro_batch": 4096,
                              "seed": 3}).replace(returns=ReturnsSettings(estimator="ppo", gamma=1.0, lambd=1.0),
                                                  critic=CriticSettings(lr=1e-2))
    trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    trainer.init(protocol.InitCommand(settings))
    assert trainer.critic is not None

    def batch(pixels: torch.Tensor) -> object:
        sample = protocol.WireSample(tokens=ids + out, response_length=len(out), loss_mask=[1] * len(out),
                                     rollout_log_probs=logprobs, advantage=1.0,
                                     images=wire_images({**images, "pixel_values": pixels}))
        (only,) = trainer._micro_batches([sample])
        return only

    with torch.no_grad():  # the zero-initialised head makes every value 0: give it a direction first
        trainer.critic.model.get_output_embeddings().weight.normal_(0.0, 1.0)
    seen = trainer.critic.old_values(batch(images["pixel_values"]))
    other = trainer.critic.old_values(batch(torch.flip(images["pixel_values"], dims=[0])))
    assert not torch.allclose(seen, other)
    values = trainer.critic.values(batch(images["pixel_values"]))
    values.sum().backward()
    tower = [p.grad for p in trainer.critic.model.model.visual.parameters() if p.requires_grad]
    assert tower and all(grad is not None for grad in tower) and any(float(g.abs().sum()) > 0 for g in tower)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in one process
def test_a_vlm_trained_on_text_alone_saves_a_checkpoint_it_can_resume_exactly(tiny_vlm_dir: Path,
                                                                              tmp_path: Path) -> None:
    """A run whose steps so far held no image (a mixed dataset's text prompts) never stepped the vision tower,
    so AdamW held no state for it; the checkpoint it saved lacked those entries and loading it failed. Every
    trainable weight's state is saved (zero, as AdamW starts it), so the resumed steps equal the continued ones."""
    from tests.support.train_settings import init_command
    from workers import protocol
    from workers.train_rank.trainer import Trainer

    _, rows, _ = engine_rollout(tiny_vlm_dir)
    ids, out, logprobs = rows["text"]
    samples = [protocol.WireSample(tokens=ids + out, response_length=len(out), loss_mask=[1] * len(out),
                                   rollout_log_probs=logprobs, advantage=advantage) for advantage in (1.0, -0.5)]
    tokens = [2 * len(out)]

    def fresh() -> Trainer:
        trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
        trainer.init(init_command({"model_path": str(tiny_vlm_dir), "lr": 1e-2, "max_tokens_per_micro_batch": 4096,
                                   "seed": 3}))
        return trainer

    def step(trainer: Trainer, rollout_id: int) -> tuple[float, float]:
        metrics = trainer.train(protocol.TrainCommand(rollout_id, [samples], tokens)).steps[0]
        return metrics.loss, metrics.grad_norm

    trainer = fresh()
    step(trainer, 0)
    trainer.save(protocol.SaveCommand(directory=str(tmp_path / "ckpt"), rollout_id=0, extra={}))
    continued = [step(trainer, 1), step(trainer, 2)]
    resumed = fresh()
    resumed.load(protocol.LoadCommand(path=str(tmp_path / "ckpt")))
    assert [step(resumed, 1), step(resumed, 2)] == continued
    for (name, mine), theirs in zip(trainer.model.state_dict().items(), resumed.model.state_dict().values(),
                                    strict=True):
        assert torch.equal(mine, theirs), name
