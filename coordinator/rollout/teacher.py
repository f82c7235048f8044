"""The `sglang` teacher of on-policy distillation: teacher logprobs of every sampled response token.

Owns `TeacherScorer` (asks the teacher's engine, through the engine client's generate path, for the logprobs of
each sample's tokens: `input_ids`, `max_new_tokens: 0`, `return_logprob`, `logprob_start_len` at the prompt's last
token, as slime's and miles' `on_policy_distillation.reward_func` do; miles' routing of a sample to the teacher
named by `metadata[--opd-teacher-key]`, 'default' as the fallback) and the rayless stand-ins for slime's and miles'
OPD reward hooks (`distill_reward`, `distill_post_process`: pure distillation, a task reward of 0). With miles'
`--opd-log-prob-top-k` the scorer asks for top-k and asked-id logprobs instead and sets each sample's
`opd_reverse_kl` (`coordinator.rollout.teacher_topk`).

Invariants: after `score`, every non-aborted sample with a response holds `teacher_log_probs`, one finite float per
response token (the last `response_length` of the teacher's `input_token_logprobs`) — with top-k, `opd_reverse_kl`,
one finite float per response token — or `score` raised
`TeacherError` naming the teacher and the sample; at most `concurrency` requests are in flight; every request has
the engine client's deadline.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import anyio

from coordinator.config.distill import DEFAULT_TEACHER
from coordinator.engines.replies import GenerateAnswer
from coordinator.rollout import teacher_topk as topk
from replay.sample import Sample, SampleStatus
from workers.boundary.json_input import JsonObject, JsonValue
from workers.errors import RaylessError

if TYPE_CHECKING:
    from coordinator.engines.client import EngineClient


class TeacherError(RaylessError, RuntimeError):
    """The teacher could not score a sample: no route to a teacher, or its answer lacks the logprobs."""


def score_payload(sample: Sample) -> JsonObject:
    """The teacher's request for one sample: prefill only, the input logprobs from the prompt's last token."""
    return with_images({
        "input_ids": [int(token) for token in sample.tokens],
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": max(sample.prompt_length - 1, 0),
    }, sample)


def with_images(payload: JsonObject, sample: Sample) -> JsonObject:
    """`payload` with the sample's images as `image_data` when it has any, as its rollout request sent them: a
    vision-language teacher scores the tokens after an image from the image (without it, from the placeholder's
    embedding alone)."""
    from coordinator.rollout.requests import image_data

    images = image_data(sample)
    if images:
        payload["image_data"] = images
    return payload


def response_log_probs(answer: GenerateAnswer, response_length: int, where: str) -> list[float]:
    """The teacher's logprobs of the response tokens: the last `response_length` `input_token_logprobs` of its
    one reply (checked where the answer was decoded: finite numbers, the first alone may be null)."""
    entries = answer.replies[0].input_logprobs if len(answer.replies) == 1 else None
    if entries is None or len(entries) < response_length:
        count = "no" if entries is None else len(entries)
        raise TeacherError(f"{where}: the teacher's answer has {count} meta_info.input_token_logprobs, the "
                           f"response has {response_length} tokens")
    values = []
    for value in entries[len(entries) - response_length:]:
        if value is None:  # the input's first token has none: a response cannot start there
            raise TeacherError(f"{where}: the teacher's logprob {value!r:.40} of a response token is not a finite "
                               "number")
        values.append(value)
    return values


def plain_answer(answer: GenerateAnswer) -> JsonValue:
    """An answer's JSON, for top-k OPD's fields the typed reply does not carry (`input_top_logprobs`,
    `input_token_ids_logprobs`): its bytes were bounded and depth-checked where they were read (the engine
    client's `read_generate_answer`), so this decode is the plain one. One prompt's answer is its one reply."""
    value = json.loads(answer.body)
    return value[0] if isinstance(value, list) and len(value) == 1 else value


class TeacherScorer:
    """Scores a rollout's samples on the teacher engines (`routes`: teacher name → engine base URL). With
    `top_k` (miles' top-k OPD) it sets `opd_reverse_kl` instead of `teacher_log_probs`; `student` then posts a
    scoring request to the policy's engines (strategies that read the student's logprobs of the teacher's ids)."""

    def __init__(self, client: EngineClient, routes: Mapping[str, str], *, key: str = "opd_teacher",
                 concurrency: int = 64, top_k: topk.TopK | None = None,
                 student: Callable[[JsonObject], Awaitable[GenerateAnswer]] | None = None) -> None:
        if not routes:
            raise TeacherError("on-policy distillation (--opd-type sglang) has no teacher: give --opd-teacher-urls "
                               "NAME=URL, --opd-teacher-load DIR or --rm-url")
        if top_k is not None and top_k.student_on_teacher and student is None:
            raise TeacherError(f"--opd-top-k-strategy {top_k.strategy} scores the teacher's top-k on the student's "
                               "engines, and this run has none to ask")
        self.client, self.routes, self.key = client, dict(routes), key
        self.top_k, self.student = top_k, student
        self.limit = anyio.CapacityLimiter(max(concurrency, 1))

    def route(self, sample: Sample) -> str:
        """miles' `_teacher_url_for_sample`: the teacher named in the metadata, else 'default', else an error."""
        metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
        name = metadata.get(self.key)
        if name is not None and str(name) in self.routes:
            return self.routes[str(name)]
        if DEFAULT_TEACHER in self.routes:
            return self.routes[DEFAULT_TEACHER]
        said = f"metadata[{self.key!r}] = {name!r}" if name is not None else f"no metadata[{self.key!r}]"
        raise TeacherError(f"sample {sample.group_index}/{sample.sample_index}: {said} names none of the teachers "
                           f"of --opd-teacher-urls ({sorted(self.routes)}) and there is no 'default' entry")

    async def score(self, samples: Sequence[Sample]) -> None:
        """Set `teacher_log_probs` (top-k: `opd_reverse_kl`) on every sample that has a response and was not
        aborted."""
        todo = [s for s in samples if s.status is not SampleStatus.ABORTED and s.response_length > 0]
        routes = [self.route(sample) for sample in todo]  # every routing error before any request
        async with anyio.create_task_group() as group:
            for sample, url in zip(todo, routes, strict=True):
                group.start_soon(self._score_one, sample, url)
        for sample in samples:
            if sample.response_length == 0 and self.top_k is not None and sample.opd_reverse_kl is None:
                sample.opd_reverse_kl = []
            elif sample.response_length == 0 and self.top_k is None and sample.teacher_log_probs is None:
                sample.teacher_log_probs = []

    async def _score_one(self, sample: Sample, url: str) -> None:
        if self.top_k is not None:
            await self._score_top_k(sample, url, self.top_k)
            return
        async with self.limit:
            answer = await self.client.engine(url).generate(score_payload(sample))
        where = f"teacher {url}, sample {sample.group_index}/{sample.sample_index}"
        sample.teacher_log_probs = response_log_probs(answer, sample.response_length, where)

    async def _score_top_k(self, sample: Sample, url: str, spec: topk.TopK) -> None:
        """miles' `reward_func` + `_compute_topk_reverse_kl`: the teacher asked for its top-k and (student-side
        strategies) its logprobs of the student's top-k ids; the student's engines, for strategies that read
        it, for their logprobs of the teacher's top-k ids; then the per-token estimate."""
        length, prompt = sample.response_length, sample.prompt_length
        where = f"teacher {url}, sample {sample.group_index}/{sample.sample_index}"
        empty: list[topk.LogprobMap] = [{} for _ in range(length)]
        student_entries = (topk.student_top_logprobs(sample.metadata, length, where) if spec.student_top else None)
        asked = (topk.asked_ids(spec, sample.tokens, prompt, student_entries)
                 if student_entries and spec.strategy in topk.TEACHER_ON_STUDENT else None)
        payload = with_images(topk.score_payload(sample.tokens, prompt,
                                                 top=spec.k if spec.strategy in topk.TEACHER_TOP else 0, asked=asked),
                              sample)
        async with self.limit:
            answer = await self.client.engine(url).generate(payload)
        plain = plain_answer(answer)
        teacher_top = (topk.response_maps(plain, "input_top_logprobs", length, where)
                       if spec.strategy in topk.TEACHER_TOP else empty)
        teacher_asked = (topk.response_maps(plain, "input_token_ids_logprobs", length, where)
                         if asked is not None else empty)
        student_asked = empty
        if spec.student_on_teacher:
            assert self.student is not None  # checked at construction
            teacher_entries = [[[value, token] for token, value in position.items()] for position in teacher_top]
            request = with_images(topk.score_payload(sample.tokens, prompt,
                                                     asked=topk.asked_ids(spec, sample.tokens, prompt, teacher_entries)),
                                  sample)
            async with self.limit:
                student_answer = await self.student(request)
            student_asked = topk.response_maps(plain_answer(student_answer), "input_token_ids_logprobs", length,
                                               f"student engines, sample {sample.group_index}/{sample.sample_index}")
        student_top = [topk.entries_to_map(entries) for entries in student_entries] if student_entries else empty
        try:
            sample.opd_reverse_kl = topk.reverse_kl(spec, student_top=student_top, teacher_top=teacher_top,
                                                    teacher_on_student=teacher_asked,
                                                    student_on_teacher=student_asked)
        except topk.TopKError as error:
            raise TeacherError(f"{where}: {error}") from None


def settle_teacher_log_probs(samples: Sequence[Sample]) -> None:
    """A hook's `teacher_log_probs` (slime's OPD post-process leaves a tensor) as a list of floats, one per
    response token; TeacherError naming the sample otherwise."""
    for sample in samples:
        values = sample.teacher_log_probs
        if values is None or (isinstance(values, list) and all(type(v) is float for v in values)):
            continue
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        if len(values) != sample.response_length:
            raise TeacherError(f"sample {sample.group_index}/{sample.sample_index}: a hook set {len(values)} "
                               f"teacher_log_probs for {sample.response_length} response tokens")
        sample.teacher_log_probs = [float(value) for value in values]


def require_teacher_log_probs(samples: Sequence[Sample], *, hook: str) -> None:
    """With a hook-supplied teacher: every sample with a response that was not aborted carries its teacher
    logprobs, one per response token; TeacherError naming the sample and the hook otherwise."""
    for sample in samples:
        if sample.status is SampleStatus.ABORTED or sample.response_length == 0:
            continue
        values = sample.teacher_log_probs
        if values is None or len(values) != sample.response_length:
            count = "no" if values is None else len(values)
            raise TeacherError(f"sample {sample.group_index}/{sample.sample_index}: {hook} set {count} "
                               f"teacher_log_probs for {sample.response_length} response tokens; with --opd-type "
                               "sglang and no teacher address the hook supplies them (slime's contract)")


def distill_reward(args: argparse.Namespace, sample: Sample, **kwargs: object) -> float:
    """Stands in for slime's / miles' `on_policy_distillation.reward_func` (which posts to the teacher at
    `--rm-url`): rayless asks the teacher itself (`TeacherScorer`), so the task reward is pure distillation's 0."""
    return 0.0


def distill_post_process(args: argparse.Namespace, samples: Sequence[Sample], **kwargs: object) -> tuple[list[float], list[float]]:
    """Stands in for slime's / miles' `on_policy_distillation.post_process_rewards`: the teacher logprobs are
    already on the samples, and the rewards (hence the task advantages) are 0, as theirs for pure distillation."""
    zeros = [0.0] * len(samples)
    return zeros, list(zeros)
