"""The rank's training state and one method per control-channel command.

Owns the model, its reference copy, the optimizer and scheduler (and, with PPO, the critic: `critic`) between
commands, and where they are
(`offload`: off the device between steps in colocation). Invariants: every rank runs the same commands in the
same order (the coordinator serialises them), so each collective here is entered by all ranks; a rank's shard
may differ but never its number of optimizer steps. A command that reads the state finds it on the device: one
that arrives while it is offloaded (a checkpoint save, a weight export for an engine's recovery) brings it
back for the command and offloads it again after (`handle`).
"""

from __future__ import annotations

import datetime
import functools
import os
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from workers import protocol
from workers.protocol.train_settings import LoraSettings, TrainSettings
from workers.shared_torch.token_scores import token_scores
from workers.train_rank import (
    checkpoint,
    determinism,
    distill,
    lora,
    packing,
    returns,
    tinker_ops,
    vision,
    weight_buckets,
    weight_export,
)
from workers.train_rank.batching import MicroBatch
from workers.train_rank.critic import Critic
from workers.train_rank.model import enable_activation_checkpointing, load_causal_lm
from workers.train_rank.offload import StateOffload
from workers.train_rank.optim import build_optimizer, build_scheduler, clip_gradients, lr_schedule
from workers.train_rank.parallel import FullySharded, Replicated, shard_model, use_fsdp
from workers.train_rank.placement import load_sharded
from workers.train_rank.sft_loss import loss_function
from workers.train_rank.tis_hook import TisHook

#: in place of a step's old logprobs: the step runs on the policy that defines them (the rollout's first step)
SAME_POLICY = object()


class NotInitialised(RuntimeError):
    """A command that needs the model arrived before `init`."""


class Trainer:
    def __init__(self, *, rank: int, world_size: int, device: torch.device) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.settings: TrainSettings | None = None
        self.model: Any = None
        self.reference: Any = None
        self.parallel: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.pad_token_id = 0
        self.image_tokens: tuple[int, int] | None = None  # a VLM's (image token id, spatial merge size)
        self.sender = weight_buckets.WeightSender()
        self.tis_hook: TisHook | None = None
        self.state: StateOffload | None = None
        self.lora: LoraSettings | None = None
        self.distiller: distill.Distiller | None = None
        self.critic: Critic | None = None
        #: rank 0, --update-weight-mode delta: (version, CPU copy of its weights) the next delta is taken against
        self.delta_base: tuple[str, dict[str, torch.Tensor]] | None = None
        self.steps_done = 0

    # ------------------------------------------------------------------------------------------ commands

    def init(self, command: protocol.InitCommand) -> protocol.InitReply:
        settings = command.settings
        torch.manual_seed(settings.seed)
        determinism.apply(settings)
        dtype = getattr(torch, settings.model.dtype)
        self.lora = settings.model.lora
        model = self._load(settings, settings.model.path, dtype, trainable=True, adapters=self.lora)
        if settings.loss.needs_reference:
            self.reference = self._load_reference(settings, dtype)
        if settings.opd is not None:
            teacher = (self._load_frozen(settings, settings.opd.teacher_path, dtype)
                       if settings.opd.teacher_path else None)
            self.distiller = distill.Distiller(settings.opd, teacher)
        self.parallel = (FullySharded(model, self.device) if use_fsdp(settings.parallel.data_parallel, self.device)
                         else Replicated(model))
        self.model = model
        self.critic = Critic(settings, self.device) if settings.critic is not None else None
        self.optimizer = build_optimizer(
            model,
            lr=settings.optimizer.lr,
            weight_decay=settings.optimizer.weight_decay,
            betas=(settings.optimizer.adam_beta1, settings.optimizer.adam_beta2),
            eps=settings.optimizer.adam_eps,
        )
        self.scheduler = build_scheduler(self.optimizer, lr_schedule(settings.optimizer))
        pad = getattr(model.config.get_text_config(), "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else 0
        vision_config = getattr(model.config, "vision_config", None)  # a vision-language model (docs/vlm.md)
        self.image_tokens = None if vision_config is None else (int(model.config.image_token_id),
                                                                int(vision_config.spatial_merge_size))
        if settings.loss.tis_function_path is not None and settings.loss.use_tis:
            self.tis_hook = TisHook.load(settings.loss.tis_function_path, settings.loss.hook_args)
        if self.state is not None:
            self.state.discard()  # a re-init (train FT) replaces a state offloaded before it
        self.state = StateOffload(model=model, optimizer=self.optimizer, reference=self.reference,
                                  device=self.device, offload_dir=settings.memory.offload_dir,
                                  memory_margin_bytes=settings.memory.train_memory_margin_bytes,
                                  critic=self.critic.model if self.critic is not None else None,
                                  critic_optimizer=self.critic.optimizer if self.critic is not None else None)
        self.settings = settings
        trainable, total = lora.trainable_counts(model)
        return protocol.InitReply(num_parameters=total, trainable_parameters=trainable, device=str(self.device))

    def _load(self, settings: TrainSettings, path: str, dtype: torch.dtype, *, trainable: bool,
              adapters: LoraSettings | None = None) -> Any:
        """Sharded: built on the meta device and loaded shard by shard (`placement`); else whole on the device.
        `adapters`: LoRA adapters injected before sharding (FSDP2 and the replicas' broadcast see them)."""
        if not use_fsdp(settings.parallel.data_parallel, self.device):
            model = load_causal_lm(path, dtype=dtype, device=self.device,
                                   attn_implementation=settings.model.attn_implementation, trainable=trainable)
            if adapters is not None:
                lora.apply_lora(model, adapters)
            if trainable and settings.model.gradient_checkpointing:
                enable_activation_checkpointing(model)
            return model
        compute_dtype = getattr(torch, settings.model.compute_dtype) if settings.model.compute_dtype else None

        def shard(model: Any) -> None:
            if trainable and settings.model.gradient_checkpointing:
                enable_activation_checkpointing(model)
            shard_model(model, device=self.device, compute_dtype=compute_dtype)

        return load_sharded(
            path, dtype=dtype, device=self.device, shard=shard, attn_implementation=settings.model.attn_implementation,
            trainable=trainable,
            # the adapters' structure on the meta model; on rank 0's full copy their weights too (broadcast)
            adapt=(lambda model: lora.inject_lora(model, adapters)) if adapters is not None else None,
            adapt_full=(lambda model: lora.apply_lora(model, adapters)) if adapters is not None else None)

    def _load_reference(self, settings: TrainSettings, dtype: torch.dtype) -> Any:
        """The frozen reference, sharded as the policy: `reference_path` when it is a Hugging Face directory;
        the policy's architecture with a rayless checkpoint's weights when it is one; else the policy's start."""
        return self._load_frozen(settings, settings.model.reference_path or settings.model.path, dtype)

    def _load_frozen(self, settings: TrainSettings, source: str, dtype: torch.dtype) -> Any:
        """A frozen model (the reference, or on-policy distillation's teacher) from a Hugging Face directory or
        a rayless checkpoint (the policy's architecture with its weights)."""
        from_checkpoint = checkpoint.is_checkpoint(source)
        # a LoRA run's checkpoint: its adapters on the Hugging Face base, injected before any sharding
        adapters = checkpoint.checkpoint_adapters(source) if from_checkpoint else None
        reference = self._load(settings, settings.model.path if from_checkpoint else source, dtype, trainable=False,
                               adapters=msgspec.convert(adapters, LoraSettings) if adapters is not None else None)
        if adapters is not None:
            reference.requires_grad_(False)
        if from_checkpoint:
            checkpoint.load_model_weights(source, reference)
        return reference

    def train(self, command: protocol.TrainCommand) -> protocol.TrainResult:
        settings, _, _ = self._require()
        if len(command.steps) != len(command.step_loss_tokens):
            raise ValueError(
                f"train command has {len(command.steps)} steps but {len(command.step_loss_tokens)} token counts"
            )
        command.attach_images()  # each distinct image came once in the command's table
        batches = [self._micro_batches(samples) for samples in command.steps]
        # slime's old logprobs: the policy before this rollout's first update, so the ratio of every step of
        # the rollout is taken against the same policy. The first step runs on that policy itself, so its old
        # logprobs are its own forward's, detached (SAME_POLICY): no second forward of the same weights — except
        # with --lora-dropout, where the old logprobs are a forward-only pass with dropout off (miles').
        recompute = settings.loss.recomputes_old_log_probs
        reuse_first = self.lora is None or self.lora.dropout == 0
        with lora.dropout_off(self.model):
            old: list[list[Any]] = [
                [(SAME_POLICY if index == 0 and reuse_first else self._log_probs(batch)) if recompute else None
                 for batch in step]
                for index, step in enumerate(batches)]
        if settings.returns is not None:
            self._token_advantages(batches)
        # slime's --num-critic-only-steps: the first rollouts train the critic alone (the policy stays as it is)
        policy_trains = settings.critic is None or command.rollout_id >= settings.critic.critic_only_steps
        steps = []
        for step_batches, step_old, global_tokens in zip(batches, old, command.step_loss_tokens, strict=True):
            critic_sums = self.critic.train_step(step_batches, int(global_tokens)) if self.critic is not None else {}
            metrics = (self._train_step(step_batches, step_old, int(global_tokens)) if policy_trains
                       else self._critic_only_step(step_batches))
            metrics.extra.update(critic_sums)
            steps.append(metrics)
            self._after_step(settings)
        return protocol.TrainResult(steps)

    def _token_advantages(self, batches: list[list[MicroBatch]]) -> None:
        """Per-token advantages in place of the samples' scalar rewards (`returns`): GAE on the critic's values
        before any update of this rollout (`ppo`) or REINFORCE++'s discounted returns; whitened over every
        rank's loss tokens with --normalize-advantages (a collective: every rank runs it once per command)."""
        settings, _, _ = self._require()
        spec = settings.returns
        assert spec is not None
        flat = [batch for step in batches for batch in step]
        for batch in flat:
            if self.critic is not None:
                batch.old_values = self.critic.old_values(batch)
            rewards = batch.advantages.detach().cpu().view(-1)
            mask = batch.loss_mask.detach().cpu().view(-1)
            values = batch.old_values.detach().cpu().view(-1) if batch.old_values is not None else None
            advantages = torch.zeros_like(rewards)
            targets = torch.zeros_like(rewards)
            for start, end in batch.spans:
                if end <= start:
                    continue
                reward = float(rewards[start])
                if values is not None:
                    advantages[start:end], targets[start:end] = returns.gae(
                        returns.token_rewards(reward, end - start), values[start:end], gamma=spec.gamma,
                        lambd=spec.lambd)
                else:
                    advantages[start:end] = returns.reinforce_returns(reward, mask[start:end], gamma=spec.gamma)
            batch.advantages = advantages.view_as(batch.loss_mask).to(batch.loss_mask.device)
            if values is not None:
                batch.returns = targets.view_as(batch.loss_mask).to(batch.loss_mask.device)
        if spec.normalize:
            whitened = returns.whiten([batch.advantages for batch in flat], [batch.loss_mask for batch in flat])
            for batch, advantages in zip(flat, whitened, strict=True):
                batch.advantages = advantages

    def _critic_only_step(self, micro_batches: list[MicroBatch]) -> protocol.StepMetrics:
        """A step of --num-critic-only-steps for the policy: nothing trained, its tokens counted."""
        _, _, optimizer = self._require()
        return protocol.StepMetrics(
            loss=0.0, pg_loss=0.0, loss_tokens=float(sum(float(b.loss_mask.sum()) for b in micro_batches)),
            clipped_tokens=0.0, entropy_sum=0.0, kl_sum=0.0, logprob_abs_diff_sum=0.0,
            num_tokens=float(sum(b.num_tokens for b in micro_batches)), logprob_abs_diff_max=0.0, grad_norm=0.0,
            lr=float(optimizer.param_groups[0]["lr"]), step_time_s=0.0)

    def _after_step(self, settings: TrainSettings) -> None:
        """After the first step (model load, first gathers) the process group's timeout is shortened, as
        torchtitan does: a rank that hangs later is reported in `train_pg_timeout_s`, not the start-up's."""
        self.steps_done += 1
        if self.steps_done == 1 and torch.distributed.is_initialized() and settings.parallel.train_pg_timeout_s:
            from torch.distributed.distributed_c10d import _set_pg_timeout

            _set_pg_timeout(datetime.timedelta(seconds=settings.parallel.train_pg_timeout_s))

    def _micro_batches(self, samples: list[protocol.WireSample]) -> list[MicroBatch]:
        """Packed micro-batches: first-fit-decreasing bins (or `micro_batch_size` groups), as many on every
        sharded rank, and at least one: a rank given no sample in a step (a global batch smaller than the ranks)
        runs one empty micro-batch, so its step is an ordinary one of no loss tokens."""
        settings, _, _ = self._require()
        groups = packing.plan(samples, max_tokens=settings.batching.max_tokens_per_micro_batch,
                              micro_batch_size=settings.batching.micro_batch_size)
        count = self.parallel.agree_count(max(len(groups), 1))
        if count > len(groups):
            groups = packing.split_to_count(groups, [len(sample.tokens) for sample in samples], count)
        batches = []
        for group, batch in zip(groups, packing.pack_groups(samples, groups, self.pad_token_id), strict=True):
            if self.image_tokens is not None:
                vision.attach_vision(batch, [samples[i] for i in group], self.model, *self.image_tokens)
            elif any(samples[i].images is not None for i in group):
                raise ValueError("a sample carries images but the model is not a vision-language model")
            if self.distiller is not None and self.distiller.spec.top_k > 0:  # top-k: the samples carry the term
                batch.opd_reverse_kl = distill.reverse_kl_tensor([samples[i] for i in group], batch.spans,
                                                                 batch.loss_mask.shape)
            elif self.distiller is not None and self.distiller.teacher is None:  # sglang: the samples carry them
                batch.teacher_log_probs = distill.teacher_tensor([samples[i] for i in group], batch.spans,
                                                                 batch.loss_mask.shape)
            batches.append(batch.to(self.device))
        return batches

    def _scores(self, batch: MicroBatch, model: Any, *, with_entropy: bool, entropy_grad: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        settings, _, _ = self._require()
        return token_scores(model, input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                            position_ids=batch.position_ids, chunk_size=settings.batching.log_probs_chunk_size,
                            with_entropy=with_entropy, entropy_grad=entropy_grad, scored=batch.response_positions(),
                            vision=batch.vision)

    @torch.no_grad()
    def _log_probs(self, batch: MicroBatch, model: Any = None) -> torch.Tensor:
        return self._scores(batch, self.model if model is None else model, with_entropy=False)[0]

    def _train_step(
        self, micro_batches: list[MicroBatch], old_log_probs: list[Any], global_tokens: int,
    ) -> protocol.StepMetrics:
        settings, model, optimizer = self._require()
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {"num_tokens": 0.0}
        maxima: dict[str, float] = {}
        for batch, old in zip(micro_batches, old_log_probs, strict=True):
            log_probs, entropy = self._scores(batch, model, with_entropy=True, entropy_grad=bool(settings.loss.entropy_coef))
            assert entropy is not None
            if old is SAME_POLICY:
                old = log_probs.detach()
            ref_log_probs = self._log_probs(batch, self.reference) if self.reference is not None else None
            advantages, opd_sums = self._distilled_advantages(batch, old)
            loss, batch_sums, batch_maxima = loss_function(settings.loss.loss_type)(
                log_probs=log_probs,
                rollout_log_probs=batch.rollout_log_probs,
                advantages=advantages,
                loss_mask=batch.loss_mask,
                global_loss_tokens=global_tokens,
                config=settings.loss,
                entropy=entropy,
                old_log_probs=old,
                ref_log_probs=ref_log_probs,
                tis_hook=None if self.tis_hook is None else functools.partial(
                    self.tis_hook, spans=batch.spans, total_lengths=batch.total_lengths),
                sample_ids=batch.sample_ids,
            )
            loss.backward()
            batch_sums.update(opd_sums)
            for key, value in batch_sums.items():
                sums[key] = sums.get(key, 0.0) + value
            for key, value in batch_maxima.items():
                maxima[key] = max(maxima.get(key, 0.0), value)
            sums["num_tokens"] += batch.num_tokens
        extra = {key: sums.pop(key) for key in [key for key in sums
                                                if key.startswith("tis_hook/") or key == distill.METRIC]}
        self.parallel.reduce_gradients()
        grad_norm = clip_gradients(model, settings.optimizer.clip_grad)
        lr = float(optimizer.param_groups[0]["lr"])
        optimizer.step()
        self.scheduler.step()
        return protocol.StepMetrics(
            **sums, **maxima, grad_norm=grad_norm, lr=lr, step_time_s=time.perf_counter() - started, extra=extra
        )

    def _distilled_advantages(self, batch: MicroBatch, old: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """The advantages with on-policy distillation's term (slime's: against the logprobs the ratio uses)."""
        if self.distiller is None:
            return batch.advantages, {}
        if batch.opd_reverse_kl is not None:  # miles' top-k OPD: the term came computed with the samples
            return self.distiller.advantages(advantages=batch.advantages, student_log_probs=None,
                                             teacher_log_probs=None, loss_mask=batch.loss_mask,
                                             reverse_kl=batch.opd_reverse_kl)
        student = batch.rollout_log_probs if old is None else old
        teacher = (self._log_probs(batch, self.distiller.teacher) if self.distiller.teacher is not None
                   else batch.teacher_log_probs)
        assert teacher is not None  # sglang: filled by `_micro_batches`
        return self.distiller.advantages(advantages=batch.advantages, student_log_probs=student,
                                         teacher_log_probs=teacher, loss_mask=batch.loss_mask)

    def save(self, command: protocol.SaveCommand) -> protocol.SaveReply:
        _, model, optimizer = self._require()
        path = checkpoint.save_checkpoint(
            command.directory,
            command.rollout_id,
            model=model,
            optimizer=optimizer,
            scheduler=self.scheduler,
            extra=command.extra,
            retain_interval=self._retain_interval,
            adapters=self.lora.record() if self.lora is not None else None,
            write_files=self._write_adapter if self.lora is not None else None,
            base_model=self._base_model_record(),
            publish=command.publish,
            critic=self._critic_state(),
        )
        return protocol.SaveReply(path=str(path))

    def _critic_state(self) -> checkpoint.CriticState | None:
        critic = self.critic
        return None if critic is None else checkpoint.CriticState(critic.model, critic.optimizer, critic.scheduler)

    @property
    def _retain_interval(self) -> int | None:
        return self.settings.checkpoint.save_retain_interval if self.settings is not None else None

    def publish(self, command: protocol.PublishCommand) -> protocol.PublishReply:
        """Rank 0: the complete `tmp-<id>` becomes the checkpoint `latest` names (file operations only)."""
        if self.rank != 0:
            return protocol.PublishReply()
        path = checkpoint.publish_checkpoint(command.directory, command.rollout_id,
                                             retain_interval=self._retain_interval)
        return protocol.PublishReply(path=str(path))

    def _base_model_record(self) -> dict[str, Any]:
        """What a checkpoint records of the model it trains, so `rayless export` needs no flag to rebuild it."""
        assert self.settings is not None
        model = self.settings.model
        return {"hf_checkpoint": os.path.abspath(model.path), "dtype": model.dtype}

    def save_hf(self, command: protocol.SaveHfCommand) -> protocol.SaveHfReply:
        """`--save-hf`: the weights an engine would load now (merged, with LoRA), as a Hugging Face directory
        (`weight_export.write_hf_directory`), a LoRA run's adapter in `adapter/` beside them. Collective."""
        settings, model, _ = self._require()
        state = weight_export.full_state_dict(model, sharded=self.parallel.sharded)
        adapter = lora.adapter_state(model) if self.lora is not None else None
        if self.rank != 0:
            return protocol.SaveHfReply()
        spec = self.lora

        def write_adapter(directory: Path) -> None:
            if adapter is not None and spec is not None:
                lora.write_adapter_files(adapter, spec, directory / lora.ADAPTER_DIR,
                                         base_model_path=os.path.abspath(settings.model.path))

        path = weight_export.write_hf_directory(state, source_dir=settings.model.path, directory=command.directory,
                                                write_extra=write_adapter)
        return protocol.SaveHfReply(path=str(path))

    def _write_adapter(self, directory: Any) -> None:
        """A LoRA checkpoint's adapters also in the PEFT format, in `<checkpoint>/adapter/`."""
        assert self.lora is not None and self.settings is not None
        lora.write_adapter(self.model, self.lora, directory / lora.ADAPTER_DIR, base_model_path=self.settings.model.path,
                           write=self.rank == 0)

    def load(self, command: protocol.LoadCommand) -> protocol.LoadReply:
        _, model, optimizer = self._require()
        loaded = checkpoint.load_checkpoint(
            command.path, model=model, optimizer=optimizer, scheduler=self.scheduler,
            adapters=self.lora.record() if self.lora is not None else None, critic=self._critic_state(),
        )
        if command.weights_only:
            optimizer.state.clear()  # the moments start afresh, as a new optimizer's
        return protocol.LoadReply(rollout_id=loaded.rollout_id, extra=loaded.extra, path=str(loaded.path))

    def export_weights(self, command: protocol.ExportWeightsCommand) -> protocol.ExportWeightsReply:
        settings, model, _ = self._require()
        state = weight_export.full_state_dict(model, sharded=self.parallel.sharded)
        if self.rank != 0:
            return protocol.ExportWeightsReply()
        if command.delta_encoding:
            return self._export_delta(command, state)
        path = weight_export.write_snapshot(
            state,
            source_dir=settings.model.path,
            directory=command.directory,
            weight_version=command.weight_version,
            keep=command.keep,
        )
        return protocol.ExportWeightsReply(path=str(path), manifest=_metas(weight_export.manifest(state)))

    def _export_delta(self, command: protocol.ExportWeightsCommand,
                      state: dict[str, torch.Tensor]) -> protocol.ExportWeightsReply:
        """Rank 0, `--update-weight-mode delta`: the changed tensors against its copy of the base version's
        weights, or a full snapshot when it holds no copy of that version; then these weights are the copy."""
        from workers.shared_torch import weight_delta

        base = self.delta_base
        if base is not None and base[0] == command.delta_base_version:
            path, changed = weight_delta.write_delta(
                state, base[1], directory=command.directory, weight_version=command.weight_version,
                base_version=command.delta_base_version, encoding=command.delta_encoding,
            )
            weight_delta.prune_deltas(Path(command.directory), keep=command.keep, protect=path)
            reply = protocol.ExportWeightsReply(path=str(path), delta=True, changed=list(changed))
        else:
            settings, _, _ = self._require()
            path = weight_export.write_snapshot(state, source_dir=settings.model.path, directory=command.directory,
                                                weight_version=command.weight_version, keep=command.keep)
            reply = protocol.ExportWeightsReply(path=str(path), manifest=_metas(weight_export.manifest(state)),
                                                changed=list(state))
        # A copy, not the gathered tensors themselves: those may alias the live parameters (unsharded models).
        self.delta_base = (command.weight_version, {name: t.clone() for name, t in state.items()})
        return reply

    def weight_manifest(self, command: protocol.WeightManifestCommand) -> protocol.WeightManifestReply:
        _, model, _ = self._require()
        buckets = weight_buckets.bucket_manifest(model, command.bucket_bytes)
        return protocol.WeightManifestReply(buckets=[_metas(bucket) for bucket in buckets])

    def broadcast_weights(self, command: protocol.BroadcastWeightsCommand) -> protocol.BroadcastWeightsReply:
        _, model, _ = self._require()
        return weight_buckets.broadcast_weights(
            model,
            self.sender,
            rank=self.rank,
            train_device=self.device,
            # FSDP shards are gathered by every rank together; replicas need only rank 0.
            collective=bool(self.parallel.sharded) and self.world_size > 1,
            master_address=command.master_address,
            master_port=command.master_port,
            world_size=command.world_size,
            group_name=command.group_name,
            backend=command.backend,
            timeout_s=command.timeout_s,
            bucket_bytes=command.bucket_bytes,
            load_format=command.load_format or None,
        )

    def destroy_weight_group(self, command: protocol.DestroyWeightGroupCommand) -> protocol.DestroyWeightGroupReply:
        return protocol.DestroyWeightGroupReply(self.sender.destroy(command.group_name) if self.rank == 0 else False)

    def offload(self, command: protocol.OffloadCommand) -> protocol.StateMoveReply:
        self._require()
        assert self.state is not None
        return protocol.OffloadReply.of(self.state.offload(verify=command.verify))

    def onload(self, command: protocol.OnloadCommand) -> protocol.StateMoveReply:
        self._require()
        assert self.state is not None
        return protocol.OnloadReply.of(self.state.onload(verify=command.verify))

    def forward_backward(self, command: protocol.ForwardBackwardCommand) -> protocol.ForwardBackwardReply:
        """The Tinker service's forward(/backward): gradients accumulate until `optim_step` (`tinker_ops`)."""
        _, model, _ = self._require()
        rounds = self.parallel.agree_count(len(command.data)) if self.parallel.sharded else None
        return tinker_ops.forward_backward(model, command, self.device, rounds)

    def optim_step(self, command: protocol.OptimStepCommand) -> protocol.OptimStepReply:
        settings, model, optimizer = self._require()
        reply = tinker_ops.optim_step(model, self.parallel, optimizer, command)
        self._after_step(settings)
        return reply

    # ------------------------------------------------------------------------------------------- helpers

    def _require(self) -> tuple[TrainSettings, Any, torch.optim.Optimizer]:
        if self.settings is None or self.model is None or self.optimizer is None:
            raise NotInitialised("the trainer got a command before 'init'; call TrainGroup.init first")
        return self.settings, self.model, self.optimizer


def _metas(entries: list[list[Any]]) -> list[protocol.TensorMeta]:
    """[name, dtype, shape] lists as the reply's (name, dtype, shape) tuples."""
    return [(str(name), str(dtype), [int(d) for d in shape]) for name, dtype, shape in entries]
