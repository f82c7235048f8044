"""`--eval-config`: slime's eval YAML (defaults + datasets), read into `EvalDatasetSpec`s.

Owns the schema of that file and its reading. The file (YAML or JSON; miles' `base64:<YAML in base64>` value
too) is a mapping, optionally under a top-level `eval:` key:

    eval:
      defaults: {max_response_len: 16384, top_p: 0.7}     # optional; any dataset key but name/path
      datasets:                                            # a list of entries with `name`, or a mapping
        - {name: aime, path: data/aime.jsonl, rm_type: deepscaler, n_samples_per_eval_prompt: 16}
        - {name: gpqa, path: data/gpqa.jsonl, rm_type: gpqa, temperature: 0.6}

Invariants: every value goes through the flags' own converter (`fields.convert`: the same types, choices and
ranges as a flag); an unknown key, a key slime has but rayless does not support, a missing `name` or `path`,
or a repeated name is a `ConfigError` naming the file, the dataset and the key. A dataset entry wins over
`defaults`; what neither sets stays None here and falls back to the eval and rollout flags later
(`coordinator.eval.settings`). Dataset paths are relative to the working directory, as slime reads them.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.config import values
from coordinator.config.fields import ConfigError, FlagSpec, convert, flag, resolve_specs

BASE64_PREFIX = "base64:"
MAX_FILE_BYTES = 1 << 20


def _rm_types() -> list[str]:
    from coordinator.rewards.rules import rm_type_names

    return rm_type_names()


@dataclass(frozen=True)
class EvalDatasetSpec:
    """One eval dataset as the user named it; None = not set here (the flags decide)."""

    name: str = flag("", help="metric name: eval/<name>/...")
    path: str = flag("", help="a JSONL or Parquet file, or builtin:<task>")
    rm_type: str | None = flag(None, help="reward type of this dataset", choices=_rm_types)
    custom_rm_path: str | None = flag(None, help="custom reward of this dataset", parse=values.hook_path)
    input_key: str | None = flag(None, help="prompt field", secret=False)
    label_key: str | None = flag(None, help="label field", secret=False)
    metadata_key: str | None = flag(None, help="metadata field", secret=False)
    apply_chat_template: bool | None = flag(None, help="wrap prompts with the chat template")
    n_samples_per_eval_prompt: int | None = flag(None, help="samples per prompt", minimum=1)
    temperature: float | None = flag(None, help="sampling temperature", minimum=0)
    top_p: float | None = flag(None, help="nucleus sampling", above=0, maximum=1)
    top_k: int | None = flag(None, help="top-k (-1 = off)", minimum=1, also=(-1,))
    max_response_len: int | None = flag(None, help="max new tokens", minimum=1)
    min_new_tokens: int | None = flag(None, help="min new tokens", minimum=0)
    repetition_penalty: float | None = flag(None, help="repetition penalty", above=0)
    stop: tuple[str, ...] | None = flag(None, help="stop strings")
    stop_token_ids: tuple[int, ...] | None = flag(None, help="stop token ids", minimum=0)
    #: merged into every record's metadata (slime's `metadata_overrides`); not a flag-like value
    metadata_overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.metadata_overrides)


#: slime `EvalDatasetConfig` fields rayless does not implement: refused with this reason, not as unknown.
UNSUPPORTED_KEYS = {
    "tool_key": "tool schemas in prompts are not supported",
    "multimodal_keys": "a per-dataset multimodal_keys is not read yet (the run's --multimodal-keys applies to every "
                       "eval dataset, slime's default)",
    "apply_chat_template_kwargs": "chat-template keyword arguments are not supported",
    "skip_special_tokens": "responses are always decoded without special tokens",
    "no_stop_trim": "the response text is decoded from the token ids",
    "custom_generate_function_path": "eval generates with the built-in request code",
    "app_service": "not supported",
    "eval_task_timeout": "not supported",
    "min_eval_samples": "not supported",
    "eval_early_stop_remaining": "not supported",
    "eval_early_stop_idle_timeout": "not supported",
    "message_processor": "not supported",
    "reward_model": "use rm_type or custom_rm_path",
    "remote_environment": "not supported",
}


def _specs() -> dict[str, FlagSpec]:
    return {spec.name: spec for spec in resolve_specs(EvalDatasetSpec, "eval-config")}


def describe(value: str) -> str:
    """How messages name the `--eval-config` value (a base64 value is not repeated in full)."""
    return "--eval-config base64:…" if value.startswith(BASE64_PREFIX) else f"--eval-config {value}"


def read_text(value: str) -> str:
    """The YAML text of an `--eval-config` value: a file's content, or the decoded `base64:` payload."""
    origin = describe(value)
    if value.startswith(BASE64_PREFIX):
        try:
            raw = base64.b64decode(value[len(BASE64_PREFIX):], validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(f"{origin}: the text after 'base64:' is not base64") from None
    else:
        path = Path(value)
        if not path.is_file():
            raise ConfigError(f"{origin}: no such file")
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ConfigError(f"{origin}: larger than {MAX_FILE_BYTES} bytes; an eval config is a small YAML file")
        raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{origin}: not UTF-8 text") from None


def _load(value: str, origin: str) -> Any:
    """The YAML of an `--eval-config` value, without anchors or aliases (`workers.boundary.yaml_input`)."""
    from coordinator.config.yaml_files import load_config_yaml

    return load_config_yaml(read_text(value), origin)


def read_eval_config(value: str) -> tuple[EvalDatasetSpec, ...]:
    """The datasets of an `--eval-config` value, each with the file's `defaults` under its own keys."""
    origin = describe(value)
    data = _load(value, origin)
    if isinstance(data, Mapping) and set(data) == {"eval"}:
        data = data["eval"]
    if not isinstance(data, Mapping):
        raise ConfigError(f"{origin}: expected a mapping with 'datasets' (optionally under 'eval'), "
                          f"got {type(data).__name__}")
    extra = sorted(str(key) for key in data if key not in ("defaults", "datasets", "delegate"))
    if extra:
        raise ConfigError(f"{origin}: unknown top-level key(s) {', '.join(map(repr, extra))}; expected "
                          "'defaults', 'datasets' and miles' 'delegate' (optionally under 'eval')")
    _check_delegate(data.get("delegate"), origin)
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, Mapping):
        raise ConfigError(f"{origin}: 'defaults' must be a mapping, got {type(defaults).__name__}")
    for key in ("name", "path"):
        if key in defaults:
            raise ConfigError(f"{origin}: defaults: key {key!r} belongs to each dataset, not to the defaults")
    entries = _dataset_entries(data.get("datasets"), origin)
    specs = []
    for index, (label, entry) in enumerate(entries):
        specs.append(_dataset(dict(defaults), entry, f"{origin}: datasets[{index}]{label}", origin))
    names = [spec.name for spec in specs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(f"{origin}: dataset name(s) {', '.join(map(repr, repeated))} given twice; each names "
                          "its metrics (eval/<name>/...)")
    return tuple(specs)


def _dataset_entries(datasets: Any, origin: str) -> list[tuple[str, Mapping[str, Any]]]:
    if isinstance(datasets, Mapping):  # name -> config
        entries = []
        for name, entry in datasets.items():
            if entry is None:
                entry = {}
            if not isinstance(entry, Mapping):
                raise ConfigError(f"{origin}: datasets.{name}: expected a mapping, got {type(entry).__name__}")
            entries.append((f" ({name})", {"name": name, **entry}))
        return entries
    if not isinstance(datasets, list) or not datasets:
        raise ConfigError(f"{origin}: 'datasets' must be a non-empty list (or a mapping name -> config)")
    entries = []
    for index, entry in enumerate(datasets):
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{origin}: datasets[{index}]: expected a mapping, got {type(entry).__name__}")
        name = entry.get("name")
        entries.append((f" ({name})" if isinstance(name, str) else "", entry))
    return entries


def _dataset(defaults: dict[str, Any], entry: Mapping[str, Any], where: str, origin: str) -> EvalDatasetSpec:
    specs = _specs()
    values_by_key: dict[str, Any] = {}
    for source, mapping in (("defaults", defaults), ("", entry)):
        for key, raw in mapping.items():
            place = f"{origin}: defaults" if source else where
            key_text = str(key)
            if key_text == "metadata_overrides":
                if not isinstance(raw, Mapping) or not all(isinstance(k, str) for k in raw):
                    raise ConfigError(f"{place}: key 'metadata_overrides' must map names to values")
                values_by_key[key_text] = tuple({**dict(values_by_key.get(key_text, ())), **raw}.items())
                continue
            if key_text in UNSUPPORTED_KEYS:
                raise ConfigError(f"{place}: key {key_text!r} (a slime eval-config key) is not supported by "
                                  f"rayless: {UNSUPPORTED_KEYS[key_text]}")
            spec = specs.get(key_text)
            if spec is None:
                known = ", ".join([*specs, "metadata_overrides"])
                raise ConfigError(f"{place}: unknown key {key_text!r}; known keys: {known}")
            if raw is None and spec.optional:
                continue
            values_by_key[key_text] = convert(spec, raw, f"{place}: key {key_text!r}")
    for required in ("name", "path"):
        if not values_by_key.get(required):
            raise ConfigError(f"{where}: key {required!r} is required (a non-empty string)")
    return dataclasses.replace(EvalDatasetSpec(), **values_by_key)


def _check_delegate(entries: Any, origin: str) -> None:
    """miles' `delegate`: task groups an external evaluator runs, read by the `--eval-function-path` that
    calls it (miles' delegate eval reads `args.eval_config` itself); here only their shape is checked."""
    if entries is None:
        return
    if not isinstance(entries, list) or not all(isinstance(entry, Mapping) for entry in entries):
        raise ConfigError(f"{origin}: 'delegate' must be a list of mappings (miles' external eval task groups)")
    for index, entry in enumerate(entries):
        if not isinstance(entry.get("name"), str) or not entry["name"]:
            raise ConfigError(f"{origin}: delegate[{index}]: needs a 'name'")


def delegate_names(value: str) -> list[str]:
    """The names of miles' `delegate` task groups in an `--eval-config` value (after `read_eval_config`
    accepted it)."""
    data = _load(value, describe(value))
    if isinstance(data, Mapping) and set(data) == {"eval"}:
        data = data["eval"]
    entries = data.get("delegate") if isinstance(data, Mapping) else None
    return [str(entry["name"]) for entry in entries or ()]

