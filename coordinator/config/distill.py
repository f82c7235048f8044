"""The on-policy distillation slice: slime's and miles' `--use-opd` / `--opd-*` flags and where the teacher is.

Owns these flags, `teacher_routes` (miles' `--opd-teacher-urls NAME=URL` map, or slime's single teacher at
`--rm-url`) and `rank_opd` (the ranks' `opd` setting). Names, defaults and start-up rules are upstream's
(`add_on_policy_distillation_arguments` and the OPD checks of `slime/utils/arguments.py` and
`miles/utils/arguments.py`): `--use-opd` needs `--opd-type`; `megatron` needs `--opd-teacher-load`;
`--opd-teacher-urls` only with `sglang`; `--opd-teacher-load` only with `--use-opd`.

Invariant: with `--use-opd` every trained sample carries teacher logprobs of its response tokens (`sglang`: asked
of the teacher's engine during the rollout, `coordinator.rollout.teacher`; `megatron`: computed on the ranks by
the frozen teacher, `workers.train_rank.distill`), and the ranks subtract `--opd-kl-coef` × (student − teacher)
logprob from each token's advantage (miles' `--opd-log-prob-top-k K`: a weighted reverse KL over each position's
top-K token set instead, computed during the rollout, `coordinator.rollout.teacher_topk`). One rayless extension: with `sglang`, `--opd-teacher-load` names a model
that rayless serves itself on its own engine (slime refuses the pair; it has no engine to launch).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.config import checkpoint
from coordinator.config.fields import ConfigError, ConfigWarning, Slice, flag
from workers.protocol.train_settings import OpdSettings

if TYPE_CHECKING:
    from coordinator.config.hooks import HooksConfig
    from coordinator.config.rollout import RolloutConfig

OPD_TYPES = ("sglang", "megatron")
TOP_K_STRATEGIES = ("only-student", "only-teacher", "intersection", "union", "xor")
REWARD_WEIGHT_MODES = ("student_p", "teacher_p", "none")
#: which top-k sets, and which cross-scorings, each top-k strategy reads (miles' sets)
STUDENT_TOP = frozenset(TOP_K_STRATEGIES) - {"only-teacher"}
TEACHER_TOP = frozenset(TOP_K_STRATEGIES) - {"only-student"}
TEACHER_ON_STUDENT = frozenset({"only-student", "union", "xor"})
STUDENT_ON_TEACHER = frozenset({"only-teacher", "union", "xor"})
#: miles' reserved teacher name: the route of a sample whose teacher name is missing or unknown
DEFAULT_TEACHER = "default"


@dataclass(frozen=True)
class TopK:
    """miles' top-k OPD settings."""

    k: int
    strategy: str = "only-student"
    weight_mode: str = "student_p"
    #: `--opd-topk-per-position`: each position is asked for its own ids (`token_ids_logprob_positions`), not
    #: the sample's union of them at every position
    per_position: bool = False

    def __post_init__(self) -> None:
        if self.k <= 0 or self.strategy not in TOP_K_STRATEGIES or self.weight_mode not in REWARD_WEIGHT_MODES:
            raise ValueError(f"top-k OPD: k {self.k} must be > 0, strategy one of {TOP_K_STRATEGIES}, weight "
                             f"mode one of {REWARD_WEIGHT_MODES}")

    @property
    def student_top(self) -> bool:
        """The rollout asks the student engine for its top-k of each generated token."""
        return self.strategy in STUDENT_TOP

    @property
    def student_on_teacher(self) -> bool:
        """The student engine is asked for its logprobs of the teacher's top-k ids after the rollout."""
        return self.strategy in STUDENT_ON_TEACHER


@dataclass(frozen=True)
class DistillConfig(Slice):
    TITLE = "on-policy distillation"
    DESCRIPTION = ("slime/miles OPD: teacher logprobs of the sampled tokens, and -coef x (student - teacher) "
                   "added to each token's advantage (docs/distillation.md)")

    use_opd: bool = flag(False, help="on-policy distillation: needs --opd-type")
    opd_type: str | None = flag(None, help="where teacher logprobs come from: sglang (a teacher engine, asked "
                                "during the rollout) or megatron (a frozen teacher on the training ranks)",
                                choices=OPD_TYPES)
    opd_kl_coef: float = flag(1.0, help="weight of the reverse KL (student - teacher logprob) subtracted from "
                              "each token's advantage", minimum=0)
    opd_teacher_load: str | None = flag(None, help="the teacher model (Hugging Face directory or rayless "
                                        "checkpoint): loaded on the ranks (megatron), or served by an engine "
                                        "rayless launches (sglang)", metavar="DIR")
    opd_teacher_ckpt_step: int | None = flag(None, help="the step of a rayless checkpoint directory to take the "
                                             "teacher from (default: its latest)", minimum=0)
    opd_teacher_urls: tuple[str, ...] | None = flag(None, help="miles: running teacher engines as NAME=URL "
                                                    "(URL: the /generate endpoint); a sample goes to the teacher "
                                                    "named by its metadata[--opd-teacher-key], else 'default'",
                                                    metavar="NAME=URL")
    opd_teacher_key: str = flag("opd_teacher", help="sample metadata key naming its teacher in "
                                "--opd-teacher-urls", secret=False)
    opd_log_prob_top_k: int = flag(0, help="miles' top-k OPD: K > 0 replaces each token's student - teacher "
                                   "logprob by a weighted reverse KL over a set of top-K tokens (sglang only); 0: "
                                   "sampled-token OPD", minimum=0)
    opd_top_k_strategy: str = flag("only-student", help="miles' token set of top-k OPD (only with "
                                   "--opd-log-prob-top-k > 0)", choices=TOP_K_STRATEGIES)
    opd_reward_weight_mode: str = flag("student_p", help="miles' weighting of top-k OPD rewards (only with "
                                       "--opd-log-prob-top-k > 0)", choices=REWARD_WEIGHT_MODES)
    opd_topk_per_position: bool = flag(False, help="miles' per-position top-k scoring: each position is asked "
                                       "for its own top-k ids' logprobs (token_ids_logprob_positions), not the "
                                       "sample's union at every position (only with --opd-log-prob-top-k > 0)")

    def check(self) -> None:
        if not self.use_opd:
            if self.opd_teacher_load is not None:
                raise ConfigError("--opd-teacher-load is set but --use-opd is not enabled: add --use-opd (as slime)")
            return
        if self.opd_type is None:
            raise ConfigError("--opd-type must be specified when --use-opd is enabled: choose 'sglang' or "
                              "'megatron'")
        if self.opd_log_prob_top_k > 0 and self.opd_type != "sglang":
            raise ConfigError("--opd-log-prob-top-k is currently supported only with --opd-type=sglang (as miles: "
                              "the top-k logprobs come from the engines)")
        if self.opd_type == "megatron":
            if self.opd_teacher_load is None:
                raise ConfigError("--opd-teacher-load is required when --opd-type=megatron (the teacher model "
                                  "the training ranks load)")
            if self.opd_teacher_urls:
                raise ConfigError("--opd-teacher-urls is only supported with --opd-type=sglang")
        if self.opd_teacher_urls and self.opd_teacher_load is not None:
            raise ConfigError("--opd-teacher-urls (running teachers) and --opd-teacher-load (a teacher rayless "
                              "launches) both give the sglang teacher: give one")
        parse_teacher_urls(self.opd_teacher_urls)
        idle = [name for name, given in (("--opd-top-k-strategy", self.opd_top_k_strategy != "only-student"),
                                         ("--opd-reward-weight-mode", self.opd_reward_weight_mode != "student_p"),
                                         ("--opd-topk-per-position", self.opd_topk_per_position)) if given]
        if idle and self.opd_log_prob_top_k == 0:
            warnings.warn(f"{' / '.join(idle)}: no effect with --opd-log-prob-top-k 0 (sampled-token OPD)",
                          ConfigWarning, stacklevel=3)

    @property
    def top_k(self) -> TopK | None:
        """miles' top-k OPD settings (None: sampled-token OPD, or no distillation)."""
        if not self.use_opd or self.opd_log_prob_top_k <= 0:
            return None
        return TopK(self.opd_log_prob_top_k, self.opd_top_k_strategy, self.opd_reward_weight_mode,
                    self.opd_topk_per_position)

    @property
    def student_top_logprobs_num(self) -> int:
        """`top_logprobs_num` the rollout asks the policy's engines for (the student's top-k; 0: none)."""
        spec = self.top_k
        return spec.k if spec is not None and spec.student_top else 0

    @property
    def engine_teacher(self) -> bool:
        """Teacher logprobs are asked of an engine during the rollout (`sglang`)."""
        return self.use_opd and self.opd_type == "sglang"

    @property
    def launches_teacher(self) -> bool:
        """rayless serves the `sglang` teacher itself, from `--opd-teacher-load`."""
        return self.engine_teacher and self.opd_teacher_load is not None

    @property
    def rank_teacher(self) -> bool:
        """The ranks load the teacher and compute its logprobs (`megatron`)."""
        return self.use_opd and self.opd_type == "megatron"

    def teacher_routes(self, rm_url: str | None, rm_type: str | None = None) -> dict[str, str]:
        """Teacher name → base URL of its engine: `--opd-teacher-urls`, else slime's single teacher at
        `--rm-url` (as 'default'; not when `--rm-type remote_rm` makes it the reward service); {} when neither
        (a launched teacher's URL is known only once it runs)."""
        routes = parse_teacher_urls(self.opd_teacher_urls)
        if rm_type is not None:
            from coordinator.rewards.rules import REMOTE_RM, base_rule

            if base_rule(rm_type)[0].name == REMOTE_RM:
                rm_url = None
        if not routes and rm_url is not None and not self.launches_teacher:
            routes = {DEFAULT_TEACHER: engine_base_url(rm_url)}
        return routes

    def teacher_path(self) -> str | None:
        """The teacher model's directory, checked on disk (None: no `--opd-teacher-load`). With
        `--opd-teacher-ckpt-step N`, `rollout_N` of a rayless save directory. The ranks read a Hugging Face
        directory or a rayless checkpoint; an engine (sglang) a Hugging Face directory."""
        if not self.use_opd or self.opd_teacher_load is None:
            return None
        path = Path(self.opd_teacher_load)
        if self.opd_teacher_ckpt_step is not None:
            path = path / f"rollout_{self.opd_teacher_ckpt_step}"
            if not path.is_dir():
                raise ConfigError(f"--opd-teacher-ckpt-step {self.opd_teacher_ckpt_step}: no checkpoint {path.name} "
                                  f"in --opd-teacher-load {self.opd_teacher_load}")
        if not path.is_dir():
            raise ConfigError(f"--opd-teacher-load {path}: no such directory (the teacher of --use-opd)")
        if checkpoint._is_hf_dir(path) or (self.rank_teacher and checkpoint._is_rayless_checkpoint(path)):
            return str(path)
        if checkpoint._is_megatron_checkpoint(path):
            raise ConfigError(checkpoint._megatron_message("--opd-teacher-load", str(path)))
        kinds = "a Hugging Face model directory (config.json)" + (" or a rayless checkpoint" if self.rank_teacher
                                                                   else ", which the teacher engine serves")
        raise ConfigError(f"--opd-teacher-load {path}: not {kinds}")

    def rank_opd(self, teacher_path: str | None) -> OpdSettings | None:
        """The ranks' `opd` setting (None: no distillation)."""
        if not self.use_opd or self.opd_type is None:
            return None
        return OpdSettings(type=self.opd_type, kl_coef=self.opd_kl_coef,
                           teacher_path=teacher_path if self.rank_teacher else None,
                           top_k=self.opd_log_prob_top_k if self.engine_teacher else 0)


def teacher_hook(rollout: RolloutConfig, hooks: HooksConfig) -> str | None:
    """slime's contract for `--opd-type sglang` without a teacher address: a custom hook talks to the teacher and
    sets `sample.teacher_log_probs` itself. The flag of the first such hook in use (a generate function, a
    rollout function, a reward or reward post-process other than slime's OPD ones, which rayless replaces),
    or None."""
    ours = "coordinator.rollout.teacher:"
    from coordinator.config.rollout import DEFAULT_ROLLOUT_FUNCTION

    for flag_name, path in (("--custom-generate-function-path", hooks.custom_generate_function_path),
                            ("--rollout-function-path", None if rollout.rollout_function_path ==
                             DEFAULT_ROLLOUT_FUNCTION else rollout.rollout_function_path),
                            ("--custom-rm-path", rollout.custom_rm_path),
                            ("--custom-reward-post-process-path", rollout.custom_reward_post_process_path)):
        if path is not None and not path.startswith(ours):
            return flag_name
    return None


def engine_base_url(url: str) -> str:
    """miles' teacher URLs name the `/generate` endpoint; the engine client wants the server's base URL."""
    base = url.rstrip("/")
    return base[: -len("/generate")] if base.endswith("/generate") else base


def parse_teacher_urls(entries: tuple[str, ...] | None) -> dict[str, str]:
    """miles' `parse_teacher_urls`: NAME=URL entries (split at the first '='), names unique; base URLs."""
    from coordinator.config import values

    routes: dict[str, str] = {}
    for entry in entries or ():
        name, sep, url = entry.partition("=")
        name, url = name.strip(), url.strip()
        if not sep or not name or not url:
            raise ConfigError(f"--opd-teacher-urls {entry!r}: expected NAME=URL (e.g. default=http://h:30001/generate)")
        if name in routes:
            raise ConfigError(f"--opd-teacher-urls: teacher name {name!r} given twice")
        try:
            values.http_url(url)
        except ValueError as error:
            raise ConfigError(f"--opd-teacher-urls {entry!r}: {error}") from None
        routes[name] = engine_base_url(url)
    return routes
