"""What `--deterministic-mode` changes on a rank: one pinned thread count, deterministic torch algorithms, and
every random source seeded from the run's seed.

Owns `apply`, called once at `init` before the model is built (so initialisation and dropout draw from the
seeded generators). Invariant: with `determinism.threads` None nothing is changed. One sample per
micro-batch, the other half of the mode, is the coordinator's setting (`micro_batch_size` 1), so the ranks
score each sample exactly as the engine rescores it (`workers.engine.rescoring`).
"""

from __future__ import annotations

import os
import random

import torch

from workers.protocol.train_settings import TrainSettings


def apply(settings: TrainSettings) -> None:
    threads = settings.determinism.threads
    if threads is None:
        return
    # A reduction split over another number of threads adds in another order; the engine pins the same count.
    torch.set_num_threads(threads)
    # cuBLAS is deterministic only with a fixed workspace (read when its first handle is made, after this).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Megatron's deterministic mode: the same switches (cuDNN is the GPU's; on CPU they change nothing).
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    random.seed(settings.seed)
    torch.manual_seed(settings.seed)
