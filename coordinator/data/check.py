"""The start-up check of a whole prompt or eval data file: every line read once, streaming, before launch.

Owns `check_data_file`. Invariant: memory is one line (or one Parquet batch) and the records seen are
counted, not kept; the outcome is the record count, or one `DataSourceError` naming the first bad line as
`file:line: reason` and how many further lines are bad — the same rules the run's reader applies
(`coordinator.data.lines` for decoding, `source.build_record` for keys and kinds, `chats` for a chat's roles
and contents, content parts only where the run's chat template takes them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from coordinator.data.chats import UNKNOWN, TemplateForms
from coordinator.data.lines import DEFAULT_MAX_LINE_BYTES, iter_rows
from coordinator.data.source import DataSourceError, build_record
from workers.boundary.errors import BoundaryError


@dataclass(frozen=True)
class RecordKeys:
    """The keys a run reads from each record (`--input-key`, `--label-key`, `--metadata-key`)."""

    input_key: str = "prompt"
    label_key: str | None = None
    metadata_key: str | None = None
    raw_prompts: bool = False  # a custom generate function reads prompts of any JSON value
    #: slime's --multimodal-keys: each row's images are decoded (one at a time, bounded) and counted too
    multimodal_keys: dict[str, str] | None = None


def check_data_file(path: str | Path, keys: RecordKeys, *, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                    template_forms: Callable[[], TemplateForms] | None = None) -> int:
    """The number of records in `path`; DataSourceError for the first bad line (with the count of the rest).
    `template_forms`: when the run applies a chat template, what it takes — asked once, at the first chat
    holding content parts or a null content (it loads the tokenizer)."""
    path = Path(path)
    asked: list[TemplateForms] = []

    def forms(row: object) -> TemplateForms:
        if template_forms is None or not _holds_optional_forms(row, keys.input_key):
            return UNKNOWN
        if not asked:
            asked.append(template_forms())
        return asked[0]

    if not path.is_file():
        raise DataSourceError(f"{path}: no such file")
    records, bad, first = 0, 0, ""
    try:
        for where, row in iter_rows(path, max_line_bytes):
            reason = str(row) if isinstance(row, BoundaryError) else _record_problem(where, row, keys, records,
                                                                                     forms(row), path.parent)
            if reason is None:
                records += 1
                continue
            bad += 1
            first = first or reason
    except BoundaryError as error:
        raise DataSourceError(str(error)) from None
    if bad:
        more = f" (and {bad - 1} further bad line(s) of {records + bad})" if bad > 1 else ""
        raise DataSourceError(first + more)
    if not records:
        raise DataSourceError(f"{path}: the file holds no records")
    return records


def _holds_optional_forms(row: object, input_key: str) -> bool:
    """Whether the row's prompt is a chat with a message whose content is a list of parts or null."""
    chat = row.get(input_key) if isinstance(row, dict) else None
    return isinstance(chat, list) and any(isinstance(m, dict) and (m.get("content") is None or
                                                                    isinstance(m.get("content"), list)) for m in chat)


def _record_problem(where: str, row: dict[str, object], keys: RecordKeys, index: int,
                    forms: TemplateForms, base_dir: Path) -> str | None:
    try:
        build_record(where, row, input_key=keys.input_key, label_key=keys.label_key,
                     metadata_key=keys.metadata_key, index=index, raw_prompts=keys.raw_prompts,
                     forms=forms, multimodal_keys=keys.multimodal_keys, base_dir=base_dir)
    except DataSourceError as error:
        return str(error)
    return None
