"""The rank's state leaving the device between steps and coming back bit-identical (issue 12 item 3), in this
process: on CPU the state is spilled to a file and the resident set drops by its size; a step after the round
trip is bit-identical to a step without one; a command that needs the state while it is offloaded (an export
for an engine's recovery) brings it back for the command and leaves it offloaded."""

from __future__ import annotations

from pathlib import Path

import torch
from msgspec.structs import replace

from tests.support.train_samples import synthetic_samples
from tests.support.train_settings import init_command
from workers import protocol
from workers.host_memory import resident_bytes
from workers.train_rank.commands import handle
from workers.train_rank.offload import StateOffload
from workers.train_rank.trainer import Trainer

torch.set_num_threads(1)


def trainer(model_dir: Path, offload_dir: Path) -> Trainer:
    rank = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    rank.init(init_command({"model_path": str(model_dir), "lr": 1e-3, "max_tokens_per_micro_batch": 32,
                                    "seed": 3, "use_kl_loss": True, "offload_dir": str(offload_dir)}))
    return rank


def step(rank: Trainer, samples: list[protocol.WireSample]) -> protocol.StepMetrics:
    answer = handle(rank, protocol.TrainCommand(0, [samples], [sum(len(s.loss_mask) for s in samples)]))
    assert isinstance(answer, protocol.TrainResult)
    return answer.steps[0]


def state_of(rank: Trainer) -> dict[str, torch.Tensor]:
    assert rank.state is not None
    return {name: tensor.clone() for name, tensor in rank.state.tensors().items()}


def test_a_step_after_an_offload_round_trip_is_bit_identical_to_one_without(tiny_model_dir: Path,
                                                                              tmp_path: Path) -> None:
    samples = synthetic_samples(tiny_model_dir, 6, seed=4)
    plain, swapped = trainer(tiny_model_dir, tmp_path / "a"), trainer(tiny_model_dir, tmp_path / "b")
    for rank in (plain, swapped):
        step(rank, samples)  # the optimizer state exists from here on
    before = state_of(swapped)
    assert any(name.startswith("optimizer/") for name in before) and any(".grad/" in n for n in before)
    assert any(name.startswith("reference/") for name in before)  # the KL's reference model moves too
    out = handle(swapped, protocol.OffloadCommand(verify=True))
    assert swapped.state.offloaded and out.state_bytes == sum(t.numel() * t.element_size() for t in before.values())
    assert all(p.numel() == 0 for p in swapped.model.parameters()) and list((tmp_path / "b").iterdir())
    back = handle(swapped, protocol.OnloadCommand(verify=True))
    assert isinstance(out, protocol.OffloadReply) and isinstance(back, protocol.OnloadReply)
    assert back.digest == out.digest and out.digest is not None and not list((tmp_path / "b").iterdir())
    after = state_of(swapped)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    # the next step of both is the same to the bit: optimizer state, gradients and parameters all came back
    first, second = step(plain, samples), step(swapped, samples)
    assert replace(first, step_time_s=0.0) == replace(second, step_time_s=0.0)
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), swapped.model.parameters(), strict=True))


def test_offload_on_cpu_gives_the_state_bytes_back_to_the_system(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024),
                                torch.nn.Linear(1024, 1024))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    state = StateOffload(model=model, optimizer=optimizer, reference=None, device=torch.device("cpu"),
                         offload_dir=str(tmp_path))
    resident = resident_bytes()
    moved = state.offload()
    drop = resident - resident_bytes()
    # parameters, gradients, exp_avg, exp_avg_sq, and AdamW's step count per parameter tensor
    assert moved["state_bytes"] == 4 * 3 * (1024 * 1024 + 1024) * 4 + 6 * 4
    assert drop >= 0.8 * moved["state_bytes"], f"RSS fell {drop / 2**20:.1f} MiB of {moved['state_bytes'] / 2**20:.1f}"
    state.onload()
    optimizer.step()  # usable again


def test_a_command_needing_the_state_while_offloaded_brings_it_back_for_the_command(tiny_model_dir: Path,
                                                                                   tmp_path: Path) -> None:
    rank = trainer(tiny_model_dir, tmp_path / "offload")
    before = state_of(rank)
    handle(rank, protocol.OffloadCommand())
    out = handle(rank, protocol.ExportWeightsCommand(directory=str(tmp_path / "snapshots"), weight_version="1"))
    assert rank.state.offloaded  # and offloaded again after the export
    from safetensors.torch import load_file

    assert isinstance(out, protocol.ExportWeightsReply) and out.manifest
    exported = load_file(str(Path(out.path) / "model.safetensors"))
    for name, tensor in exported.items():
        key = f"model/{name}"
        if key in before:
            assert torch.equal(tensor, before[key]), name
    handle(rank, protocol.OnloadCommand())
    assert all(torch.equal(state_of(rank)[k], before[k]) for k in before)
