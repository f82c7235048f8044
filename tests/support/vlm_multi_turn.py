"""A two-turn vision-language environment as a slime custom generate function, in the shape of slime's
`examples/geo3k_vlm_multi_turn/rollout.py` (its imports changed to rayless' hook API): the prompt and its images
go to the engine as `input_ids` + `image_data`; the environment then answers with a user turn holding a new
image (a green square), whose tokens join the sample untrained (loss mask 0) and whose image joins
`multimodal_inputs` and `image_data`; the model answers again. `multimodal_train_inputs` is the per-turn
processor outputs concatenated (slime's `_merge_multimodal_train_inputs`).

Used by tests/integration/test_vlm_e2e.py (`--custom-generate-function-path tests.support.vlm_multi_turn.generate`).
"""

from __future__ import annotations

import argparse

from coordinator.hooks import GenerateState, Sample, post
from workers.boundary.images import encode_data_url

#: The observation's text after its image (the tiny VLM's character tokenizer spells it out).
OBSERVATION = "again?"


def _observation_image() -> object:
    from PIL import Image

    return Image.new("RGB", (56, 56), (20, 200, 20))


async def generate(args: argparse.Namespace, sample: Sample, sampling_params: dict[str, object]) -> Sample:
    import torch

    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    first = state.processor(text=sample.prompt, **(sample.multimodal_inputs or {}))
    sample.tokens = list(first["input_ids"][0])
    chunks = [first]
    image_data = [encode_data_url(image) for image in sample.multimodal_inputs["images"]]
    for turn in range(2):
        output = await post(url, {"input_ids": sample.tokens, "sampling_params": sampling_params,
                                  "return_logprob": True, "image_data": image_data})
        triples = output["meta_info"]["output_token_logprobs"]
        sample.append_response_tokens(args, tokens=[t[1] for t in triples], log_probs=[t[0] for t in triples],
                                      meta_info=output["meta_info"], text=output["text"])
        if turn == 1:
            break
        picture = _observation_image()
        message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": OBSERVATION}]}]
        text = state.tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
        observed = state.processor(text=text, images=[picture])
        sample.append_response_tokens(args, tokens=observed["input_ids"][0], trainable=False)
        sample.multimodal_inputs["images"].append(picture)
        image_data.append(encode_data_url(picture))
        chunks.append(observed)
    sample.multimodal_train_inputs = {key: torch.cat([chunk[key] for chunk in chunks], dim=0)
                                      for key in ("pixel_values", "image_grid_thw")}
    return sample
