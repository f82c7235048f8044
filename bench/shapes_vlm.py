"""`bench.train_shapes`' vision-language case (issue 33): the trainer on a batch with images against its text
floor, the same token sequences with every image token a text token and no images, each in a fresh process.

Owns `vlm_case` (build a Qwen2.5-VL-shaped model locally, `workers.tiny_vlm`; run both batches) and
`print_vlm`. The batch is `prompts` × `samples_per_prompt` samples, one square image per prompt shared by its
samples (as a rollout's group shares its prompt's processor outputs). Figures: real tokens/s of one train command
(one optimizer step), the rank's peak memory over it, the image bytes per sample on the control channel (each
distinct image once in the command's table, `TrainCommand.images`, against a copy per sample) and the language
model's attention pairs computed ÷ needed (the vision tower's own attention counted apart). A report, no target.
"""

from __future__ import annotations

import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.shapes_parts import _peak_bytes, _sync, counting_pairs, needed_pairs


def vlm_process(model_dir: str, prompts: int, per_prompt: int, side: int, response: int, with_images: bool,
                max_tokens: int, device_name: str, threads: int) -> dict[str, float]:
    import random

    import torch
    from PIL import Image

    from tests.support.train_settings import init_command
    from workers import protocol
    from workers.protocol.control import wire_images
    from workers.train_rank.trainer import Trainer
    from workers.vlm_processor import VlmProcessor

    torch.set_num_threads(threads)
    processor = VlmProcessor(model_dir)
    tokenizer = processor.tokenizer
    rng = random.Random(0)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is drawn?"}]}],
        tokenize=False, add_generation_prompt=True)
    filler = tokenizer.convert_tokens_to_ids("x")
    wire, inline_bytes = [], 0
    for _ in range(prompts):
        pixels = bytes(rng.randrange(256) for _ in range(side * side * 3))
        vision = processor.pixel_inputs([Image.frombytes("RGB", (side, side), pixels)])
        inputs = {"pixel_values": vision.pixel_values, "image_grid_thw": vision.image_grid_thw}
        prompt = processor.expand_ids(tokenizer.encode(text), vision.image_grid_thw)
        if not with_images:  # the text floor: the same sequence, every image token a text one
            prompt = [filler if token == processor.image_token_id else token for token in prompt]
        for index in range(per_prompt):
            out = [rng.randrange(10, 80) for _ in range(response)]
            images = wire_images(inputs) if with_images else None
            inline_bytes += images.nbytes if images is not None else 0
            wire.append(protocol.WireSample(tokens=prompt + out, response_length=response, loss_mask=[1] * response,
                                            rollout_log_probs=[-1.0] * response,
                                            advantage=1.0 if index % 2 else -1.0, images=images))
    device = torch.device(device_name)
    trainer = Trainer(rank=0, world_size=1, device=device)
    trainer.init(init_command({"model_path": model_dir, "lr": 1e-5, "max_tokens_per_micro_batch": max_tokens,
                               "use_rollout_logprobs": True}))
    command = protocol.TrainCommand(0, [wire], [len(wire) * response])
    frame_bytes = len(protocol.encode_frame(protocol.Request(1, command), 2**40))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")
    started = time.perf_counter()
    trainer.train(command)
    _sync(device)
    seconds = time.perf_counter() - started
    peak = _peak_bytes(device)
    # attention pairs over one forward of every micro-batch: the language model's apart from the vision tower's
    batches = trainer._micro_batches(wire)
    model = trainer.model
    visual = getattr(getattr(model, "model", model), "visual", None)
    vision_pairs = [0]
    with torch.no_grad(), counting_pairs() as pairs:
        if visual is not None:
            at_start: list[int] = []
            visual.register_forward_pre_hook(lambda *_: at_start.append(pairs[0]))
            visual.register_forward_hook(lambda *_: vision_pairs.__setitem__(0, vision_pairs[0] + pairs[0]
                                                                               - at_start.pop()))
        for batch in batches:
            trainer._log_probs(batch)
    layers = model.config.get_text_config().num_hidden_layers
    tokens = sum(len(sample.tokens) for sample in wire)
    return {"tokens": float(tokens), "seconds": seconds, "tokens_per_s": tokens / seconds, "peak_bytes": float(peak),
            "samples": float(len(wire)), "table_bytes": float(command.image_bytes()), "inline_bytes": float(inline_bytes),
            "frame_bytes": float(frame_bytes), "lm_pairs": float(pairs[0] - vision_pairs[0]),
            "vision_pairs": float(vision_pairs[0]), "needed_pairs": float(needed_pairs(batches, layers)),
            "micro_batches": float(len(batches))}


def vlm_case(*, quick: bool, device: str, threads: int) -> dict[str, Any]:
    """Both batches, each in a fresh process (its peak memory the command's alone). Quick: 4 prompts × 4 samples
    of 112-pixel images on a 2-layer model; otherwise 8 × 8 of 448-pixel images (1,024 patches, Qwen2-VL's
    processor at geo3k-like sizes) on a 4-layer one."""
    from workers.tiny_vlm import PIXEL_FACTOR, TinyVlmSpec, build_tiny_vlm

    prompts, per_prompt, side, response, layers, depth, hidden = ((4, 4, 112, 16, 2, 2, 128) if quick
                                                                  else (8, 8, 448, 64, 4, 4, 256))
    spec = TinyVlmSpec(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
                       num_attention_heads=max(4, hidden // 64), num_key_value_heads=2, vision_hidden_size=128,
                       vision_depth=depth, vision_heads=2, max_position_embeddings=8192, min_pixels=side * side,
                       max_pixels=side * side)
    context = multiprocessing.get_context("spawn")
    results: dict[str, Any] = {"prompts": prompts, "per_prompt": per_prompt, "side": side, "response": response,
                               "layers": layers, "depth": depth, "hidden": hidden, "device": device,
                               "image_tokens": (side // PIXEL_FACTOR) ** 2}
    with tempfile.TemporaryDirectory(prefix="rayless-vlm-bench-") as directory:
        model = str(build_tiny_vlm(Path(directory) / "model", spec))
        for name, with_images in (("text", False), ("vlm", True)):
            with context.Pool(1) as pool:
                try:
                    results[name] = pool.apply(vlm_process, (model, prompts, per_prompt, side, response,
                                                             with_images, 8192, device, threads))
                except Exception as exc:  # reported, so the text case's report still prints
                    return {**results, "failed": f"{name}: {type(exc).__name__}: {exc}"}
    return results


def print_vlm(result: dict[str, Any]) -> None:
    if "failed" in result:
        print(f"VLM case: FAILED ({result['failed']}); not gated, the text case's figures follow")
        return
    text, vlm = result["text"], result["vlm"]
    mib = 2**20
    print(f"VLM case: {result['prompts']} prompts × {result['per_prompt']} samples, one {result['side']}×"
          f"{result['side']} image per prompt ({result['image_tokens']} image tokens), {result['response']} response "
          f"tokens; hidden {result['hidden']} × {result['layers']} layers, vision 128 × {result['depth']} blocks; "
          f"{result['device']}")
    for name, row in (("text floor", text), ("with images", vlm)):
        print(f"  {name}: {row['tokens']:,.0f} tokens in {row['seconds']:.2f} s = {row['tokens_per_s']:,.0f} "
              f"tokens/s, peak {row['peak_bytes'] / mib:,.0f} MiB, {row['micro_batches']:.0f} micro-batch(es), "
              f"LM attention pairs {row['lm_pairs'] / row['needed_pairs']:.3f}× the needed")
    print(f"  images cost {vlm['seconds'] / text['seconds']:.2f}× the time and {vlm['peak_bytes'] / text['peak_bytes']:.2f}× "
          f"the peak memory; the vision tower's attention {vlm['vision_pairs']:,.0f} pairs")
    print(f"  image bytes per sample on the control channel: {vlm['table_bytes'] / vlm['samples'] / mib:.3f} MiB "
          f"(each distinct image once) against {vlm['inline_bytes'] / vlm['samples'] / mib:.3f} MiB with a copy per "
          f"sample; train command frame {vlm['frame_bytes'] / mib:.1f} MiB (text floor "
          f"{text['frame_bytes'] / mib:.1f} MiB)")
