"""Import of slime/miles `.pt` dumps: plain data converts exactly, a reduce payload is refused and never runs."""

from __future__ import annotations

import pickle  # noqa: TID251 - builds malicious test inputs; never used to read anything in rayless
from pathlib import Path
from typing import Any

import pytest
import torch

from replay.format import DumpError
from replay.reader import read_dump
from replay.sample import SampleStatus
from replay.torch_import import convert_torch_dump, import_torch_dump
from tests.support.replay_inputs import MarkerPayload


def slime_sample(index: int, **overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "index": index,
        "group_index": index // 2,
        "prompt": "What is 2+2?",
        "tokens": torch.tensor([11, 12, 13, 40 + index]),
        "response": "4",
        "response_length": 2,
        "label": "4",
        "reward": 1.0,
        "loss_mask": [1, 0],
        "rollout_log_probs": torch.tensor([-0.125, -0.5], dtype=torch.float32),
        "status": "completed",
        "metadata": {"source": "gsm8k"},
        "weight_versions": ["3"],
        "aborted": False,
    }
    base.update(overrides)
    return base


def test_torch_save_dump_converts_exactly(tmp_path: Path) -> None:
    src = tmp_path / "rollout_4.pt"
    torch.save(
        {"rollout_id": 4, "samples": [slime_sample(i) for i in range(4)], "metadata": {"model": "q"}}, src
    )
    dst = convert_torch_dump(src, tmp_path / "4.rld")
    dump = read_dump(dst)
    assert dump.header.rollout_id == 4
    assert dump.header.config["source_metadata"] == {"model": "q"}
    first = dump.samples[1]
    assert first.tokens == [11, 12, 13, 41]
    assert first.rollout_log_probs == [-0.125, -0.5]
    assert (first.group_index, first.sample_index, first.status) == (0, 1, SampleStatus.COMPLETED)
    assert first.loss_mask == [1, 0] and first.reward == 1.0 and first.weight_versions == ["3"]
    assert first.metadata == {"source": "gsm8k", "slime": {"aborted": False, "index": 1}}


def test_conversion_choices(tmp_path: Path) -> None:
    src = tmp_path / "r.pt"
    samples = [
        slime_sample(
            0,
            group_index=None,
            loss_mask=None,
            status="failed",
            prompt=[{"role": "user", "content": "hi"}],
            label={"answer": 4},
            reward={"acc": 1, "fmt": 0.5},
        ),
        slime_sample(1, group_index=None, rollout_log_probs=None),
    ]
    torch.save({"rollout_id": 2, "samples": samples}, src)
    with pytest.raises(DumpError, match=r"sample #1: has no rollout_log_probs.*--allow-missing-logprobs"):
        import_torch_dump(src, n_samples_per_prompt=2)
    with pytest.raises(DumpError, match="has no group_index; pass --n-samples-per-prompt"):
        import_torch_dump(src, allow_missing_logprobs=True)
    _, got, _ = import_torch_dump(src, n_samples_per_prompt=2, allow_missing_logprobs=True)
    assert got[0].loss_mask == [1, 1]  # missing mask → all ones
    assert got[0].status is SampleStatus.ABORTED and got[0].metadata["slime_status"] == "failed"
    assert got[0].prompt == "user: hi" and got[0].metadata["prompt_messages"] == [
        {"role": "user", "content": "hi"}
    ]
    assert got[0].label == '{"answer": 4}' and got[0].metadata["label_is_json"] is True
    assert got[0].reward == {"acc": 1.0, "fmt": 0.5}
    assert got[1].rollout_log_probs == [0.0, 0.0] and got[1].metadata["rollout_log_probs_missing"] is True
    assert [s.group_index for s in got] == [0, 0]


def test_wrong_lengths_in_source_are_refused(tmp_path: Path) -> None:
    src = tmp_path / "r.pt"
    torch.save({"rollout_id": 0, "samples": [slime_sample(0, loss_mask=[1, 1, 1])]}, src)
    with pytest.raises(DumpError, match=r"r\.pt: sample 0/0: loss_mask has 3 entries, response_length is 2"):
        import_torch_dump(src)


def test_bare_pickle_of_plain_data_is_read(tmp_path: Path) -> None:
    # Some forks call pickle.dump on the sample dicts (no tensors); read by the restricted unpickler.
    src = tmp_path / "r.pkl"
    plain = [{**slime_sample(i), "tokens": [1, 2, 3], "rollout_log_probs": [-1.0, -2.0]} for i in range(2)]
    src.write_bytes(pickle.dumps(plain, protocol=5))
    rollout_id, got, _ = import_torch_dump(src, rollout_id=9)
    assert rollout_id == 9 and [s.rollout_log_probs for s in got] == [[-1.0, -2.0]] * 2


@pytest.mark.parametrize(
    "container", ["torch.save", "torch.save lists", "pickle protocol 2", "pickle protocol 5"]
)
def test_reduce_payload_is_refused_and_never_runs(tmp_path: Path, container: str) -> None:
    marker = tmp_path / "pwned"
    src = tmp_path / "evil.pt"
    evil = slime_sample(0, metadata={"x": MarkerPayload(marker)})
    if container == "torch.save":  # holds tensors: torch's weights-only unpickler refuses the payload
        torch.save({"rollout_id": 0, "samples": [evil]}, src)
    else:
        # Plain lists only, so the payload is the one thing the loader has to refuse (for torch.save
        # files this is our plain unpickler's fast path).
        evil.update(tokens=[1, 2, 3, 4], rollout_log_probs=[-1.0, -1.0])
    if container == "torch.save lists":
        torch.save({"rollout_id": 0, "samples": [evil]}, src)
    elif container.startswith("pickle"):
        src.write_bytes(pickle.dumps({"rollout_id": 0, "samples": [evil]}, protocol=int(container[-1])))
    with pytest.raises(DumpError, match=r"refused to load .*evil\.pt.*(open|io).*it was not executed"):
        import_torch_dump(src)
    with pytest.raises(DumpError):
        convert_torch_dump(src, tmp_path / "0.rld")
    assert not marker.exists()
    assert not (tmp_path / "0.rld").exists()
    # Handed to our own reader by mistake, it is not a dump at all (and still never unpickled).
    with pytest.raises(DumpError, match="not a rayless dump"):
        read_dump(src)
    assert not marker.exists()


def test_bare_pickle_with_tensors_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "t.pkl"
    src.write_bytes(pickle.dumps({"rollout_id": 0, "samples": [slime_sample(0)]}, protocol=2))
    with pytest.raises(DumpError, match=r"torch global torch\._utils\._rebuild_tensor_v2 in a bare pickle"):
        import_torch_dump(src)


def test_unreadable_sources(tmp_path: Path) -> None:
    empty = tmp_path / "e.pt"
    empty.write_bytes(b"")
    with pytest.raises(DumpError, match="empty file"):
        import_torch_dump(empty)
    with pytest.raises(DumpError, match="is a directory"):
        import_torch_dump(tmp_path)
    junk = tmp_path / "j.pt"
    junk.write_bytes(b"\x00garbage")
    with pytest.raises(DumpError, match=r"neither a torch\.save file nor a readable pickle"):
        import_torch_dump(junk)
    wrong_shape = tmp_path / "w.pt"
    torch.save({"rollout_id": 1}, wrong_shape)
    with pytest.raises(DumpError, match="expected a dict with 'rollout_id' and 'samples'"):
        import_torch_dump(wrong_shape)
