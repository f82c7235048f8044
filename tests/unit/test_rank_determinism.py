"""The ranks' half of `--deterministic-mode`: the settings key is validated, and `apply` pins the thread count,
switches torch to deterministic algorithms and seeds the generators (nothing at all when the mode is off)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from workers.protocol.train_settings import DeterminismSettings, ModelSettings, SettingsError, TrainSettings
from workers.train_rank import determinism


@pytest.fixture
def torch_state() -> Iterator[None]:
    threads, algorithms = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(algorithms)


def test_the_thread_count_is_validated() -> None:
    with pytest.raises(SettingsError, match=r"determinism\.threads must be >= 1"):
        DeterminismSettings(threads=0)


def test_apply_pins_threads_algorithms_and_seeds(torch_state: None) -> None:
    torch.set_num_threads(2)
    determinism.apply(TrainSettings(model=ModelSettings(path="/m")))
    assert torch.get_num_threads() == 2 and not torch.are_deterministic_algorithms_enabled()
    settings = TrainSettings(model=ModelSettings(path="/m"), determinism=DeterminismSettings(threads=1), seed=5)
    determinism.apply(settings)
    assert torch.get_num_threads() == 1 and torch.are_deterministic_algorithms_enabled()
    drawn = (random.random(), torch.rand(3).tolist())
    determinism.apply(settings)
    assert (random.random(), torch.rand(3).tolist()) == drawn  # the same seed, the same draws
