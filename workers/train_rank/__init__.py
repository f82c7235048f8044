"""The training rank: `python -m workers.train_rank`, launched by torchrun, one process per data-parallel rank.

One concern per module (torchtitan style): `__main__` wires the process (control channel, process group,
command loop); `settings` validates the coordinator's init config; `model` loads the Hugging Face model
(no torch.distributed); `parallel` applies data parallelism (FSDP2 on CUDA, gloo replicas on CPU);
`batching` packs samples into micro-batches and recomputes logprobs; `loss` is the policy-gradient loss;
`optim` the optimizer, scheduler and clipping; `checkpoint` the resumable state; `weight_export` the HF
snapshot for disk sync; `weight_buckets` the bucketed broadcast to engines over a weight-update group;
`trainer` holds the state and runs each command.

Nothing here imports `coordinator`.
"""
