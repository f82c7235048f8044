"""The cross-slice rules of a vision-language run (`--multimodal-keys`, a `builtin:` image task), appended to
`rules.RULES`.

Owns `VLM_RULES`. Invariant: a run with images has a vision-language `--hf-checkpoint` rayless serves
(`workers.vlm_processor.VLM_MODEL_TYPES`), and every part that does not carry images yet is refused at start-up
by its flag, naming why (docs/vlm.md), never run text-only in silence.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.config.fields import ConfigError

if TYPE_CHECKING:
    from coordinator.config.settings import Config


def has_images(config: Config) -> bool:
    from coordinator.data.tasks import is_image_task

    return config.rollout.multimodal_keys is not None or is_image_task(config.rollout.prompt_data)


def images_need_a_vlm(config: Config) -> None:
    """Images go to a Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE model — the rollout's and an eval dataset's
    (a built-in image task); a builtin text task has no image column to map."""
    from coordinator.data.tasks import builtin_task_name, is_image_task
    from workers.vlm_processor import VLM_MODEL_TYPES, vlm_model_type

    rollout = config.rollout
    if rollout.multimodal_keys is not None and builtin_task_name(rollout.prompt_data) is not None:
        what = "draws its images itself" if is_image_task(rollout.prompt_data) else "is text only"
        raise ConfigError(f"--multimodal-keys maps --prompt-data's columns; --prompt-data {rollout.prompt_data} "
                          f"{what}: drop --multimodal-keys")
    # an eval dataset that is a built-in image task draws its images whatever the training data is
    evaluated = config.eval.eval_datasets if config.eval.eval_interval is not None else []
    image_evals = [f"--eval-prompt-data {name} {path}" for name, path in evaluated if is_image_task(path)]
    if not (has_images(config) or image_evals) or rollout.hf_checkpoint is None \
            or not Path(rollout.hf_checkpoint).is_dir():
        return
    if vlm_model_type(rollout.hf_checkpoint) is None:
        source = ("--multimodal-keys" if rollout.multimodal_keys else f"--prompt-data {rollout.prompt_data}"
                  if has_images(config) else image_evals[0])
        raise ConfigError(f"{source}: prompts with images need a vision-language --hf-checkpoint (model_type "
                          f"{' or '.join(sorted(VLM_MODEL_TYPES))}); {rollout.hf_checkpoint} is not one "
                          "(`rayless make-tiny-model --vlm DIR` builds a tiny one)")


# Custom generate functions (`coordinator.rollout.hook_generate`), the session server
# (`coordinator.sessions.images`) and true-on-policy (`workers.engine.rescoring`) carry images: no rule refuses them.
VLM_RULES: tuple[Callable[[Config], None], ...] = (images_need_a_vlm,)
