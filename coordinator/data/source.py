"""The prompt data source: JSONL / Parquet prompts (or an in-memory list), shuffled per epoch, resumable.

Owns the order in which prompts are handed to rollouts. Invariant: the order is a pure function of
(seed, epoch, position) and the data, so `load_state_dict(state_dict())` on a fresh source built from the
same data and seed continues with exactly the prompts the original would have returned next.

Within an epoch every record is returned exactly once; epoch `e` uses the permutation drawn from
`random.Random(f"rayless-data:{seed}:{e}")` (or the file order when `shuffle` is false).

Files are read once at construction with plain I/O (start-up, before the event loop is busy), each line
through the boundary layer (`coordinator.data.lines`). The chat
template is applied when records are taken (a few prompts per rollout), not to the whole file up front.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from coordinator.data.chats import UNKNOWN, TemplateForms, chat_problem
from coordinator.data.lines import DEFAULT_MAX_LINE_BYTES, iter_rows, line_limits
from coordinator.data.media import MediaError, load_images, multimodal_prompt
from replay.sample import SampleError
from replay.sample import label_value as sample_label_value
from workers.boundary.errors import BoundaryError
from workers.boundary.json_input import JsonObject, JsonValue, decode_json
from workers.errors import RaylessError

ChatMessages = list[dict[str, Any]]
STATE_VERSION = 1


class DataSourceError(RaylessError, ValueError):
    """Prompt data that cannot be read or used as asked (bad file, missing key, wrong type, bad state)."""


class ChatTokenizer(Protocol):
    def apply_chat_template(self, conversation: JsonValue, **kwargs: object) -> str | list[int]: ...


@dataclass
class PromptRecord:
    """One prompt: its text (or chat messages when no template is applied), label and metadata."""

    prompt: str | ChatMessages
    #: The data file's JSON value unchanged (`replay.sample.label_value`): text, a number, a list or an object.
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    # Position in the data (row / non-blank line order); stable across epochs and resumes.
    index: int = -1
    #: slime's --multimodal-keys: the prompt's images in prompt order; as read, kept encoded
    #: (`coordinator.data.media.ImageRef`); as taken (`PromptDataSource.take`), decoded PIL images
    images: tuple[Any, ...] = ()


def label_value(value: JsonValue, *, where: str, key: str) -> JsonValue:
    """`replay.sample.label_value` (the one rule, shared with `rayless reward score`) as a DataSourceError."""
    try:
        return sample_label_value(value, where=where, key=key)
    except SampleError as error:
        raise DataSourceError(str(error)) from None


def _check_prompt(value: JsonValue, *, where: str, key: str, forms: TemplateForms = UNKNOWN,
                  loose: bool = False) -> str | ChatMessages:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        reason = chat_problem(value, forms=forms, loose=loose)
        if reason is not None:
            raise DataSourceError(f"{where}: input key {key!r} is a list, so it must be chat messages: {reason}")
        return value
    raise DataSourceError(
        f"{where}: input key {key!r} holds {type(value).__name__}; expected a string or a list of chat messages"
    )


def _check_metadata(value: JsonValue, *, where: str, key: str) -> JsonObject:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = decode_json(value, where, line_limits(4 * len(value) + 1))
        except BoundaryError as error:
            raise DataSourceError(f"{where}: metadata key {key!r} is a string but not JSON: {error.reason}") from None
    if not isinstance(value, dict):
        raise DataSourceError(
            f"{where}: metadata key {key!r} holds {type(value).__name__}; expected an object (dict)"
        )
    return value


def read_prompt_file(
    path: str | Path,
    *,
    input_key: str = "prompt",
    label_key: str | None = None,
    metadata_key: str | None = None,
    limit: int | None = None,
    raw_prompts: bool = False,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    tool_key: str | None = None,
    multimodal_keys: dict[str, str] | None = None,
) -> list[PromptRecord]:
    """Read the records of a `.parquet` file or a JSONL file (any other suffix), checking the keys: every
    record, or the first `limit`. `raw_prompts`: a prompt may be any JSON value (a custom generate function
    reads it: tau-bench's task index), as slime keeps it. The first bad line is a DataSourceError naming it
    (`coordinator.data.check` reports every bad line of a file at start-up)."""
    path = Path(path)
    if not path.is_file():
        raise DataSourceError(f"--prompt-data {str(path)!r}: no such file")
    records: list[PromptRecord] = []
    try:
        for where, row in iter_rows(path, max_line_bytes):
            if limit is not None and len(records) >= limit:
                break
            if isinstance(row, BoundaryError):
                raise DataSourceError(str(row))
            records.append(build_record(where, row, input_key=input_key, label_key=label_key,
                                        metadata_key=metadata_key, index=len(records), raw_prompts=raw_prompts,
                                        tool_key=tool_key, multimodal_keys=multimodal_keys,
                                        base_dir=path.parent))
    except BoundaryError as error:
        raise DataSourceError(str(error)) from None
    if not records:
        raise DataSourceError(f"--prompt-data {str(path)!r}: the file holds no records")
    return records


def build_record(where: str, row: JsonObject, *, input_key: str, label_key: str | None,
                 metadata_key: str | None, index: int, raw_prompts: bool = False,
                 forms: TemplateForms = UNKNOWN, tool_key: str | None = None,
                 multimodal_keys: dict[str, str] | None = None, base_dir: Path | None = None) -> PromptRecord:
    """One row as a record: the keys the run reads present, each value of a kind it can use (a chat's roles
    and contents as `coordinator.data.chats` has them; `forms`: what the run's chat template takes, when
    known). slime's `--tool-key`: a row's tools (a list, or JSON text of one; optional per row) go to
    `metadata["tools"]`."""
    keys = [("--input-key", input_key)]
    keys += [("--label-key", label_key)] if label_key is not None else []
    keys += [("--metadata-key", metadata_key)] if metadata_key is not None else []
    for flag, key in keys:
        if key not in row:
            raise DataSourceError(f"{where}: key {key!r} ({flag}) is missing; the record has {sorted(row)}")
    value = row[input_key]
    raw = raw_prompts and not isinstance(value, str | list) and value is not None
    metadata = _check_metadata(row[metadata_key], where=where, key=metadata_key) if metadata_key is not None else {}
    if tool_key is not None and row.get(tool_key) is not None:
        metadata = {**metadata, "tools": _check_tools(row[tool_key], where=where, key=tool_key)}
    prompt = value if raw else _check_prompt(value, where=where, key=input_key, forms=forms, loose=raw_prompts)
    images: tuple[Any, ...] = ()
    if multimodal_keys and not raw:  # slime's: the row's media, and its prompt as a chat with image parts
        try:
            prompt, images = multimodal_prompt(prompt, row, where, multimodal_keys, base_dir)
        except MediaError as error:
            raise DataSourceError(str(error)) from None
    return PromptRecord(
        prompt=prompt,
        label=label_value(row[label_key], where=where, key=label_key) if label_key is not None else None,
        metadata=metadata,
        index=index,
        images=images,
    )


def _check_tools(value: JsonValue, *, where: str, key: str) -> list[JsonValue]:
    """slime's rule: the tools column holds a list (JSON text of one is parsed)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise DataSourceError(f"{where}: tool key {key!r} (--tool-key) holds text that is not JSON: "
                                  f"{error}") from None
    if not isinstance(value, list):
        raise DataSourceError(f"{where}: tool key {key!r} (--tool-key) holds {type(value).__name__}; expected a "
                              "list of tools")
    return value


class PromptDataSource:
    """Hands out prompt records in epochs; `take(n)` is the only way to advance."""

    def __init__(
        self,
        path: str | Path,
        *,
        input_key: str = "prompt",
        label_key: str | None = None,
        metadata_key: str | None = None,
        apply_chat_template: bool = False,
        tokenizer: ChatTokenizer | None = None,
        shuffle: bool,
        seed: int,
        raw_prompts: bool = False,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        tool_key: str | None = None,
        multimodal_keys: dict[str, str] | None = None,
        render_images: bool = True,
    ) -> None:
        records = read_prompt_file(path, input_key=input_key, label_key=label_key, metadata_key=metadata_key,
                                   raw_prompts=raw_prompts, max_line_bytes=max_line_bytes, tool_key=tool_key,
                                   multimodal_keys=multimodal_keys)
        self._setup(
            records,
            apply_chat_template=apply_chat_template,
            tokenizer=tokenizer,
            shuffle=shuffle,
            seed=seed,
            source=str(path),
            tools=tool_key is not None,
            render_images=render_images,
        )

    @classmethod
    def from_records(
        cls,
        records: Sequence[PromptRecord],
        *,
        apply_chat_template: bool = False,
        tokenizer: ChatTokenizer | None = None,
        shuffle: bool,
        seed: int,
        source: str = "<in-memory>",
        render_images: bool = True,
    ) -> PromptDataSource:
        """A source over records built in memory (the built-in tasks); `render_images` as `_setup`'s."""
        checked: list[PromptRecord] = []
        for position, record in enumerate(records):
            where = f"{source}: record {position}"
            checked.append(
                PromptRecord(
                    prompt=_check_prompt(record.prompt, where=where, key="prompt"),
                    label=record.label,
                    metadata=dict(record.metadata),
                    index=position,
                    images=record.images,
                )
            )
        if not checked:
            raise DataSourceError(f"{source}: no records")
        source_object = cls.__new__(cls)
        source_object._setup(
            checked,
            apply_chat_template=apply_chat_template,
            tokenizer=tokenizer,
            shuffle=shuffle,
            seed=seed,
            source=source,
            render_images=render_images,
        )
        return source_object

    def _setup(
        self,
        records: list[PromptRecord],
        *,
        apply_chat_template: bool,
        tokenizer: ChatTokenizer | None,
        shuffle: bool,
        seed: int,
        source: str,
        tools: bool = False,
        render_images: bool = True,
    ) -> None:
        """`tools`: `--tool-key` is given, so a record's `metadata["tools"]` go to the chat template.
        `render_images`: a record with images is rendered with the template whatever `apply_chat_template` says
        (slime's multimodal prompts are conversations); False keeps its chat (the SFT rollout renders it)."""
        if apply_chat_template and tokenizer is None:
            raise DataSourceError(
                "--apply-chat-template needs a tokenizer (from --hf-checkpoint); none was given"
            )
        if apply_chat_template and not hasattr(tokenizer, "apply_chat_template"):
            raise DataSourceError(
                f"--apply-chat-template: tokenizer {type(tokenizer).__name__} has no apply_chat_template"
            )
        self._records = records
        self._apply_chat_template = apply_chat_template
        self._tools = tools
        self._render_images = render_images
        self._tokenizer = tokenizer
        self._shuffle = shuffle
        self._seed = int(seed)
        self._source = source
        self._epoch = 0
        self._position = 0
        self._order = self._order_for(0)

    def __len__(self) -> int:
        return len(self._records)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        """How many records of the current epoch have been handed out."""
        return self._position

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(len(self._records)))
        if self._shuffle:
            # A string seed is hashed with SHA-512 by `random`, so the permutation is stable across runs,
            # processes and PYTHONHASHSEED values.
            random.Random(f"rayless-data:{self._seed}:{epoch}").shuffle(order)
        return order

    def _render(self, record: PromptRecord) -> PromptRecord:
        prompt = record.prompt
        if self._apply_chat_template or (record.images and self._render_images):  # slime: multimodal prompts
            # are always conversations
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            assert self._tokenizer is not None  # checked in _setup
            # slime passes the row's tools (--tool-key) to the template: tools=None when the row has none
            tools = {"tools": record.metadata.get("tools")} if self._tools else {}
            try:
                prompt = self._tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False, **tools
                )
            except Exception as error:
                raise DataSourceError(
                    f"{self._source}: record {record.index}: --apply-chat-template failed: "
                    f"{type(error).__name__}: {error}"
                ) from error
            if not isinstance(prompt, str):
                raise DataSourceError(
                    f"{self._source}: apply_chat_template returned {type(prompt).__name__}, expected text"
                )
        # Copies: callers may mutate metadata of one rollout without changing later epochs.
        try:
            images = load_images(record.images)
        except MediaError as error:
            raise DataSourceError(str(error)) from None
        return PromptRecord(
            prompt=prompt, label=record.label, metadata=dict(record.metadata), index=record.index,
            images=images,
        )

    def take(self, n_groups: int) -> list[PromptRecord]:
        """The next `n_groups` records, crossing into the next epoch (newly shuffled) as needed."""
        if n_groups < 0:
            raise ValueError(f"take() needs a non-negative count, got {n_groups}")
        taken: list[PromptRecord] = []
        while len(taken) < n_groups:
            if self._position >= len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._order_for(self._epoch)
            taken.append(self._render(self._records[self._order[self._position]]))
            self._position += 1
        return taken

    def state_dict(self) -> JsonObject:
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "position": self._position,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "num_records": len(self._records),
        }

    def load_state_dict(self, state: JsonObject) -> None:
        """Continue where the saved source stopped; refuses a state saved over different data or seed."""
        try:
            version, epoch, position = int(state["version"]), int(state["epoch"]), int(state["position"])
            seed, shuffle, num_records = int(state["seed"]), bool(state["shuffle"]), int(state["num_records"])
        except (KeyError, TypeError, ValueError) as error:
            raise DataSourceError(f"data source state {state!r} is malformed: {error!r}") from error
        if version != STATE_VERSION:
            raise DataSourceError(
                f"data source state version {version} is not supported (expected {STATE_VERSION})"
            )
        if num_records != len(self._records):
            raise DataSourceError(
                f"cannot resume: the checkpoint's data source had {num_records} records, {self._source} has "
                f"{len(self._records)}; resume with the same --prompt-data"
            )
        if seed != self._seed or shuffle != self._shuffle:
            raise DataSourceError(
                f"cannot resume: the checkpoint's data order used seed {seed} (shuffle={shuffle}), this run "
                f"uses seed {self._seed} (shuffle={self._shuffle}); resume with the same --rollout-seed"
            )
        if epoch < 0 or not 0 <= position <= num_records:
            raise DataSourceError(f"data source state epoch {epoch} / position {position} is out of range")
        self._epoch = epoch
        self._position = position
        self._order = self._order_for(epoch)
