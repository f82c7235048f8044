"""Dump format versions: a format-1 dump written by the format-1 writer (tests/data/dumps, before format 2
existed) still reads, sample for sample; format 2 carries multi-turn samples with what custom generate
functions put in them (chat-message prompts, dict labels, slime's index, the FAILED status)."""

from __future__ import annotations

from pathlib import Path

from replay.format import FORMAT_VERSION, write_dump
from replay.reader import read_dump
from replay.sample import Sample, SampleStatus

V1_DUMP = Path(__file__).resolve().parents[1] / "data" / "dumps" / "v1_multi_turn.rld"


def v1_expected() -> list[Sample]:
    """What tests/data/dumps/write_v1_multi_turn.py wrote (at commit 0c6461c, format 1)."""
    samples = []
    for group in range(2):
        for k in range(2):
            response = [20 + k, 21, 30, 31, 32, 40 + group, 41 + k]
            samples.append(Sample(
                group_index=group, sample_index=k, prompt=f"{group}+{k}", tokens=[5, 17, 8 + group, *response],
                response_length=7, loss_mask=[1, 1, 0, 0, 0, 1, 1],
                rollout_log_probs=[-0.5 - 0.125 * k, -1.25, 0.0, 0.0, 0.0, -0.75, -2.0 + 0.25 * group],
                reward=float(group == k), status=SampleStatus.COMPLETED if k == 0 else SampleStatus.TRUNCATED,
                weight_versions=["3"], label=str(group + k), response="ab=xyz" + str(group),
                advantage=0.5 if group == k else -0.5, metadata={"tool_calls": 1, "turns": (1, 2)}))
    return samples


def test_a_format_1_dump_still_reads_sample_for_sample() -> None:
    dump = read_dump(V1_DUMP)
    assert dump.header.format_version == 1 and "index" not in dump.header.raw["sample_fields"]
    assert dump.samples == v1_expected()
    assert all(sample.index is None and sample.is_multi_turn for sample in dump.samples)
    assert [sample.effective_response_length for sample in dump.samples] == [4, 4, 4, 4]


def test_format_2_carries_what_custom_generate_functions_put_in_a_sample(tmp_path: Path) -> None:
    samples = v1_expected()
    samples[0].prompt = [{"role": "user", "content": "3+4"}]
    samples[1].label = {"ground_truth": {"target": ["Paris"]}, "style": "rule"}
    samples[2].status = SampleStatus.FAILED
    for position, sample in enumerate(samples):
        sample.index = position
    path = write_dump(tmp_path / "0.rld", 0, samples, config_facts={})
    dump = read_dump(path)
    assert dump.header.format_version == FORMAT_VERSION == 2
    assert dump.samples == samples
    # a format-1 dump, rewritten by this writer, reads back the same
    again = read_dump(write_dump(tmp_path / "1.rld", 1, read_dump(V1_DUMP).samples, config_facts={}))
    assert again.samples == v1_expected()
