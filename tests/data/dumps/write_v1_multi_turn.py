"""How `v1_multi_turn.rld` was made: run at commit 0c6461c (dump format 1) from the repository root,
`PYTHONPATH=. python tests/data/dumps/write_v1_multi_turn.py`. Kept to document the file; the format-1 writer
is gone, so it no longer runs (`tests/unit/test_replay_versions.py` holds the same samples as expectations)."""

from replay.format import FORMAT_VERSION, write_dump
from replay.sample import Sample, SampleStatus

assert FORMAT_VERSION == 1


def v1_samples() -> list[Sample]:
    samples = []
    for group in range(2):
        for k in range(2):
            prompt = [5, 17, 8 + group]
            turn1 = [20 + k, 21]
            tool = [30, 31, 32]
            turn2 = [40 + group, 41 + k]
            response = turn1 + tool + turn2
            mask = [1, 1, 0, 0, 0, 1, 1]
            logps = [-0.5 - 0.125 * k, -1.25, 0.0, 0.0, 0.0, -0.75, -2.0 + 0.25 * group]
            samples.append(Sample(
                group_index=group, sample_index=k, prompt=f"{group}+{k}", tokens=prompt + response,
                response_length=len(response), loss_mask=mask, rollout_log_probs=logps,
                reward=float(group == k), status=SampleStatus.COMPLETED if k == 0 else SampleStatus.TRUNCATED,
                weight_versions=["3"], label=str(group + k), response="ab=xyz" + str(group),
                advantage=0.5 if group == k else -0.5, metadata={"tool_calls": 1, "turns": (1, 2)}))
    return samples


write_dump("tests/data/dumps/v1_multi_turn.rld", 7, v1_samples(),
           config_facts={"n_samples_per_prompt": 2, "writer_commit": "0c6461c"})
