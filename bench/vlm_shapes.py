"""The trainer on a vision-language batch against the same batch as text: what the images cost (issue 33).

One train command (one optimizer step over the batch) on a Qwen2.5-VL-shaped model built locally
(`workers.tiny_vlm`, sizes from the flags), twice, each in a fresh process: the samples with their images
(`WireSample.images`: the vision tower runs, rows packed with multimodal positions) and the same token sequences
with every image token replaced by a text token and no images (the language model alone, the same packed
rows). Reported: the rank's peak resident memory (or CUDA peak) over the command and real tokens per second, and
their ratios. A report, no target: the figures say what the vision tower and the images' pixel inputs cost at
this shape.

    python -m bench.vlm_shapes --quick                 # CPU, under a minute on 2 cores
    python -m bench.vlm_shapes --samples 64 --image-size 448 --hidden 512 --layers 8
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import tempfile
import time
from pathlib import Path


def rank_process(model_dir: str, samples: int, image_size: int, response: int, with_images: bool,
                 device_name: str, threads: int) -> dict[str, float]:
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
    wire = []
    for index in range(samples):
        pixels = bytes(rng.randrange(256) for _ in range(image_size * image_size * 3))
        vision = processor.pixel_inputs([Image.frombytes("RGB", (image_size, image_size), pixels)])
        prompt = processor.expand_ids(tokenizer.encode(text), vision.image_grid_thw)
        if not with_images:  # the same sequence as text: every image token a text one
            prompt = [filler if token == processor.image_token_id else token for token in prompt]
        out = [rng.randrange(10, 80) for _ in range(response)]
        images = wire_images({"pixel_values": vision.pixel_values, "image_grid_thw": vision.image_grid_thw}) \
            if with_images else None
        wire.append(protocol.WireSample(tokens=prompt + out, response_length=response, loss_mask=[1] * response,
                                        rollout_log_probs=[-1.0] * response, advantage=1.0 if index % 2 else -1.0,
                                        images=images))
    device = torch.device(device_name)
    trainer = Trainer(rank=0, world_size=1, device=device)
    trainer.init(init_command({"model_path": model_dir, "lr": 1e-5, "max_tokens_per_micro_batch": 8192,
                               "use_rollout_logprobs": True}))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    trainer.train(protocol.TrainCommand(0, [wire], [samples * response]))
    seconds = time.perf_counter() - started
    tokens = sum(len(sample.tokens) for sample in wire)
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"tokens": float(tokens), "seconds": seconds, "tokens_per_s": tokens / seconds,
            "peak_bytes": float(peak), "rss_before_bytes": float(before * 1024)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 samples of 112-pixel images, a 2-layer model")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224, help="square images, pixels a side")
    parser.add_argument("--response", type=int, default=64, help="response tokens per sample")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vision-hidden", type=int, default=128)
    parser.add_argument("--vision-depth", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    options = parser.parse_args()
    if options.quick:
        options.samples, options.image_size, options.layers, options.vision_depth = 16, 112, 2, 2
    from workers.tiny_vlm import PIXEL_FACTOR, TinyVlmSpec, build_tiny_vlm

    side = max(PIXEL_FACTOR, options.image_size // PIXEL_FACTOR * PIXEL_FACTOR)
    spec = TinyVlmSpec(hidden_size=options.hidden, num_hidden_layers=options.layers,
                       intermediate_size=2 * options.hidden, num_attention_heads=max(4, options.hidden // 64),
                       num_key_value_heads=2, vision_hidden_size=options.vision_hidden,
                       vision_depth=options.vision_depth, vision_heads=max(2, options.vision_hidden // 64),
                       max_position_embeddings=8192, min_pixels=side * side, max_pixels=side * side)
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="rayless-vlm-bench-") as directory:
        model = str(build_tiny_vlm(Path(directory) / "model", spec))
        results = {}
        for with_images in (False, True):
            with context.Pool(1) as pool:  # a fresh process each: its peak memory is this command's alone
                results[with_images] = pool.apply(rank_process, (model, options.samples, side, options.response,
                                                                 with_images, options.device, options.threads))
    text, vlm = results[False], results[True]
    print(f"shape: {options.samples} samples, one {side}x{side} image each ({(side // PIXEL_FACTOR) ** 2} image "
          f"tokens), {options.response} response tokens; hidden {options.hidden} x {options.layers} layers, vision "
          f"{options.vision_hidden} x {options.vision_depth} blocks; {options.device}")
    print(f"{'batch':<12}{'tokens':>8}{'seconds':>10}{'tokens/s':>11}{'peak MiB':>10}")
    for name, row in (("text only", text), ("with images", vlm)):
        print(f"{name:<12}{row['tokens']:>8.0f}{row['seconds']:>10.2f}{row['tokens_per_s']:>11.0f}"
              f"{row['peak_bytes'] / 2**20:>10.0f}")
    print(f"images cost: {vlm['seconds'] / text['seconds']:.2f}x the time, "
          f"{vlm['peak_bytes'] / text['peak_bytes']:.2f}x the peak memory")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
