"""The prompt data source (JSONL / Parquet, keys, chat template, shuffle, epochs, resume) and the tasks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.data.source import DataSourceError, PromptDataSource, PromptRecord, read_prompt_file
from coordinator.data.tasks import (
    BUILTIN_TASK_SIZE,
    builtin_task_name,
    get_task,
    make_copy_prompts,
    make_first_digit_prompts,
    make_reverse_prompts,
    open_prompt_source,
    write_task_jsonl,
)


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def numbered(tmp_path: Path, n: int) -> Path:
    return write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"p{i}", "label": str(i)} for i in range(n)])


def test_jsonl_reads_prompt_label_metadata(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"q": "what is 2+2?", "a": 4, "m": {"source": "x"}})
        + "\n\n"  # a blank line is skipped
        + json.dumps({"q": [{"role": "user", "content": "hi"}], "a": "yes", "m": '{"k": 1}'})
        + "\n",
        encoding="utf-8",
    )
    records = read_prompt_file(path, input_key="q", label_key="a", metadata_key="m")
    assert type(records[0].label) is int  # the JSON type kept, as slime's Sample.label = data[label_key]
    assert records == [
        PromptRecord(prompt="what is 2+2?", label=4, metadata={"source": "x"}, index=0),
        PromptRecord(prompt=[{"role": "user", "content": "hi"}], label="yes", metadata={"k": 1}, index=1),
    ]


def test_parquet_reads_like_jsonl(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(
        pa.table(
            {"prompt": ["a", "b", "c"], "label": ["1", "2", "3"], "meta": [{"i": 0}, {"i": 1}, {"i": 2}]}
        ),
        path,
    )
    source = PromptDataSource(path, label_key="label", metadata_key="meta", shuffle=False, seed=0)
    taken = source.take(3)
    assert [(r.prompt, r.label, r.metadata, r.index) for r in taken] == [
        ("a", "1", {"i": 0}, 0),
        ("b", "2", {"i": 1}, 1),
        ("c", "3", {"i": 2}, 2),
    ]


def test_missing_key_names_file_line_and_key(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "label": "1"}, {"prompt": "b"}])
    with pytest.raises(DataSourceError, match=r"d\.jsonl:2: key 'label' \(--label-key\) is missing"):
        PromptDataSource(path, label_key="label", shuffle=False, seed=0)
    with pytest.raises(DataSourceError, match=r"d\.jsonl:1: key 'question' \(--input-key\) is missing"):
        PromptDataSource(path, input_key="question", shuffle=False, seed=0)


def test_missing_key_in_parquet_names_row(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a"]}), path)
    with pytest.raises(DataSourceError, match=r"d\.parquet: row 1: key 'prompt' \(--input-key\) is missing"):
        read_prompt_file(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "a"}\n{not json\n', r":2: not valid JSON"),
        ('["a"]\n', r":1: each line must be a JSON object"),
        ('{"prompt": 3}\n', r":1: input key 'prompt' holds int"),
        ('{"prompt": [{"content": "x"}]}\n', r":1: .*chat messages"),
        ('{"prompt": "a", "m": [1]}\n', r":1: metadata key 'm' holds list"),
        ("\n", r"holds no records"),
    ],
)
def test_malformed_files_fail_clearly(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataSourceError, match=message):
        read_prompt_file(path, metadata_key="m" if '"m"' in content else None)


def test_missing_file_names_flag(tmp_path: Path) -> None:
    with pytest.raises(DataSourceError, match=r"--prompt-data .*nope\.jsonl.*no such file"):
        PromptDataSource(tmp_path / "nope.jsonl", shuffle=True, seed=0)


def test_unshuffled_epochs_repeat_file_order(tmp_path: Path) -> None:
    source = PromptDataSource(numbered(tmp_path, 4), shuffle=False, seed=0)
    assert [r.index for r in source.take(6)] == [0, 1, 2, 3, 0, 1]
    assert (source.epoch, source.position) == (1, 2)
    assert [r.index for r in source.take(10)] == [2, 3, 0, 1, 2, 3, 0, 1, 2, 3]
    assert (source.epoch, source.position) == (3, 4)


def test_shuffle_is_a_permutation_per_epoch_and_differs_between_epochs(tmp_path: Path) -> None:
    source = PromptDataSource(numbered(tmp_path, 50), shuffle=True, seed=7)
    epochs = [[r.index for r in source.take(50)] for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(50))
    assert epochs[0] != list(range(50))
    assert epochs[0] != epochs[1] != epochs[2]


def test_shuffle_is_deterministic_in_seed(tmp_path: Path) -> None:
    path = numbered(tmp_path, 30)
    first = [r.index for r in PromptDataSource(path, shuffle=True, seed=3).take(75)]
    again = [r.index for r in PromptDataSource(path, shuffle=True, seed=3).take(75)]
    other = [r.index for r in PromptDataSource(path, shuffle=True, seed=4).take(75)]
    assert first == again
    assert first != other


@pytest.mark.parametrize("stop_after", [0, 5, 7, 20, 23])
def test_resume_continues_the_same_order(tmp_path: Path, stop_after: int) -> None:
    path = numbered(tmp_path, 7)
    reference = [r.index for r in PromptDataSource(path, shuffle=True, seed=11).take(stop_after + 15)]

    original = PromptDataSource(path, shuffle=True, seed=11)
    before = [r.index for r in original.take(stop_after)]
    state = json.loads(json.dumps(original.state_dict()))  # checkpoints store it as plain data
    resumed = PromptDataSource(path, shuffle=True, seed=11)
    resumed.load_state_dict(state)
    after = [r.index for r in resumed.take(15)]

    assert before + after == reference
    assert [r.index for r in original.take(15)] == after


def test_resume_refuses_other_data_or_seed(tmp_path: Path) -> None:
    source = PromptDataSource(numbered(tmp_path, 5), shuffle=True, seed=1)
    source.take(3)
    state = source.state_dict()
    other_path = write_jsonl(tmp_path / "other.jsonl", [{"prompt": "x"}] * 6)
    with pytest.raises(DataSourceError, match=r"had 5 records.*has 6.*same --prompt-data"):
        PromptDataSource(other_path, shuffle=True, seed=1).load_state_dict(state)
    with pytest.raises(DataSourceError, match=r"seed 1 .*seed 2 .*--rollout-seed"):
        PromptDataSource(tmp_path / "data.jsonl", shuffle=True, seed=2).load_state_dict(state)
    with pytest.raises(DataSourceError, match=r"malformed"):
        source.load_state_dict({"epoch": 0})


def test_taken_records_are_copies(tmp_path: Path) -> None:
    source = PromptDataSource.from_records(
        [PromptRecord(prompt="a", label="1", metadata={"k": 1})], shuffle=False, seed=0
    )
    first = source.take(1)[0]
    first.metadata["k"] = 99
    assert source.take(1)[0].metadata == {"k": 1}


def test_chat_template_with_tiny_tokenizer(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"prompt": "1 2 3="},
            {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        ],
    )
    source = PromptDataSource(path, apply_chat_template=True, tokenizer=tokenizer, shuffle=False, seed=0)
    plain, chat = source.take(2)
    assert plain.prompt == "<|im_start|>user\n1 2 3=<|im_end|>\n<|im_start|>assistant\n"
    assert chat.prompt == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    # Without the template the messages are handed on untouched.
    raw = PromptDataSource(path, shuffle=False, seed=0).take(2)
    assert raw[1].prompt == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_tool_key_hands_each_rows_tools_to_the_chat_template_as_slime(tmp_path: Path, tiny_model_dir: Path) -> None:
    """slime's --tool-key: the column's list (or JSON text of one) is `tools=` of apply_chat_template and
    `metadata["tools"]`; a row without it gets tools=None; a non-list is refused naming the key."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    # a real template that renders tools (the tiny one ignores them)
    tokenizer.chat_template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
                               "{% endif %}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    calc = {"type": "function", "function": {"name": "calc", "parameters": {}}}
    path = write_jsonl(tmp_path / "tools.jsonl", [{"prompt": "1+2", "tools": [calc]},
                                                  {"prompt": "3+4", "tools": json.dumps([calc, calc])},
                                                  {"prompt": "5+6"}])
    first, second, third = PromptDataSource(path, apply_chat_template=True, tokenizer=tokenizer, shuffle=False,
                                            seed=0, tool_key="tools").take(3)
    assert (first.prompt, second.prompt, third.prompt) == ("TOOLS:calc;[user]1+2", "TOOLS:calc;calc;[user]3+4",
                                                           "[user]5+6")
    assert first.metadata == {"tools": [calc]} and "tools" not in third.metadata
    untouched = PromptDataSource(path, apply_chat_template=True, tokenizer=tokenizer, shuffle=False, seed=0).take(1)
    assert untouched[0].prompt == "[user]1+2"  # without --tool-key the column is not read
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x", "tools": {"name": "calc"}}])
    with pytest.raises(DataSourceError, match=r"tool key 'tools' \(--tool-key\) holds dict; expected a list"):
        PromptDataSource(bad, shuffle=False, seed=0, tool_key="tools")


def test_chat_template_without_tokenizer_fails(tmp_path: Path) -> None:
    with pytest.raises(DataSourceError, match=r"--apply-chat-template needs a tokenizer"):
        PromptDataSource(numbered(tmp_path, 2), apply_chat_template=True, shuffle=False, seed=0)


def test_take_rejects_negative() -> None:
    source = PromptDataSource.from_records(make_first_digit_prompts(3, seed=0), shuffle=True, seed=0)
    assert source.take(0) == []
    with pytest.raises(ValueError, match="non-negative"):
        source.take(-1)


# ------------------------------------------------------------------------------------------------- tasks


def test_first_digit_prompts() -> None:
    records = make_first_digit_prompts(200, seed=5)
    assert records == make_first_digit_prompts(200, seed=5)
    assert records != make_first_digit_prompts(200, seed=6)
    for record in records:
        assert isinstance(record.prompt, str)
        digits = record.prompt[:-1].split(" ")
        assert record.prompt.endswith("=") and len(record.prompt) == 6
        assert all(len(d) == 1 and d.isdigit() for d in digits) and len(digits) == 3
        assert record.label == digits[0]
        assert record.metadata == {"task": "first_digit"}
    assert {record.label for record in records} == set("0123456789")


def test_copy_and_reverse_labels() -> None:
    for copy, reverse in zip(make_copy_prompts(20, seed=1), make_reverse_prompts(20, seed=1), strict=True):
        digits = copy.prompt[:-1].replace(" ", "")
        assert copy.prompt == reverse.prompt
        assert copy.label == digits
        assert reverse.label == digits[::-1]
    assert get_task("reverse").rm_type == "char_match"
    with pytest.raises(ValueError, match=r"unknown built-in task 'sum'.*first_digit"):
        get_task("sum")


def test_written_task_reads_back(tmp_path: Path) -> None:
    path = write_task_jsonl(tmp_path / "sub" / "first.jsonl", "first_digit", 16, seed=2)
    source = PromptDataSource(path, label_key="label", metadata_key="metadata", shuffle=False, seed=0)
    assert source.take(16) == make_first_digit_prompts(16, seed=2)


def test_open_prompt_source_builtin_and_file(tmp_path: Path) -> None:
    builtin = open_prompt_source("builtin:reverse", shuffle=True, seed=9)
    assert len(builtin) == BUILTIN_TASK_SIZE
    again = open_prompt_source("builtin:reverse", shuffle=True, seed=9)
    assert builtin.take(40) == again.take(40)
    assert builtin_task_name("builtin:first_digit") == "first_digit"
    assert builtin_task_name(str(tmp_path / "x.jsonl")) is None
    with pytest.raises(ValueError, match=r"unknown built-in task 'nope'"):
        open_prompt_source("builtin:nope", shuffle=False, seed=0)
    from_file = open_prompt_source(str(numbered(tmp_path, 3)), label_key="label", shuffle=False, seed=0)
    assert [record.label for record in from_file.take(4)] == ["0", "1", "2", "0"]
