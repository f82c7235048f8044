"""coordinator/config/upstream_flags.tsv against rayless' parser: each row's disposition is what the parser
does with the flag, so a regenerated table (a new upstream commit) that changes anything is a reviewed diff.

Also the regeneration's static reader on small argparse sources (literal, f-string and dataclass flags), and the
messages: a refused flag names its feature and why; "unknown" says which upstream versions were checked.
"""

from __future__ import annotations

import ast
import json
import textwrap

import pytest

from coordinator.config.fields import ConfigError
from coordinator.config.megatron import CATEGORIES
from coordinator.config.parser import known_flags, parse_config
from coordinator.config.porting import porting_notice
from coordinator.config.upstream import DISPOSITIONS, RENAMED, upstream_rows
from tools.upstream_flags import extract

ROWS = upstream_rows()
BASE = ["--hf-checkpoint", "/nonexistent-model", "--rollout-num-engines", "1", "--num-rollout", "1",
        "--rollout-batch-size", "1", "--prompt-data", "/nonexistent.jsonl"]


def _value_for(row_arity: str) -> list[str]:
    if row_arity == "switch":
        return []
    return ["1"] * (int(row_arity) if row_arity.isdigit() else 1)


def test_every_row_is_decided_and_every_origin_known() -> None:
    assert len(ROWS) > 1000  # slime + miles + Megatron-LM + sglang-router + SGLang
    for row in ROWS.values():
        assert row.disposition in DISPOSITIONS and row.disposition != "review", row
        assert set(row.origins) <= {"slime", "miles", "megatron", "sglang-router", "sglang"}, row
        if row.disposition == "ignored":
            assert row.category in CATEGORIES, row
        if row.disposition in ("refused", "mapped"):
            assert len(row.note) > 20, row  # the feature and why / the notice line


def test_implemented_and_mapped_rows_are_flags_of_rayless_and_no_flag_of_rayless_is_refused() -> None:
    """Both directions: a branch that adds a flag (LoRA's, say) must flip its row in the same change."""
    from coordinator.config.megatron import CATEGORY_OF

    known = set(known_flags())
    for row in ROWS.values():
        if row.disposition in ("implemented", "mapped") and not row.flag.startswith(("--sglang-", "--router-")):
            assert row.flag in known or RENAMED.get(row.flag) in known, row
        if row.flag in known:  # the Megatron slice's flags are ignored; every other flag of rayless is taken
            expected = ("ignored",) if row.flag[2:].replace("-", "_") in CATEGORY_OF else ("implemented", "mapped")
            assert row.disposition in expected, row


def test_each_ignored_and_refused_row_does_what_it_says() -> None:
    """All ignored rows on one command line parse, each kept for the notice; all refused rows on one command
    line fail with one message naming each flag with its row's reason (two parses: fast)."""
    known = set(known_flags())
    rows = [row for row in ROWS.values() if row.flag not in known]
    ignored = [row for row in rows if row.disposition == "ignored"]
    refused = [row for row in rows if row.disposition == "refused"]
    config = parse_config([*BASE, *(token for row in ignored for token in (row.flag, *_value_for(row.arity)))])
    assert set(config.upstream_ignored) == set(ignored)
    with pytest.raises(ConfigError) as caught:
        parse_config([*BASE, *(token for row in refused for token in (row.flag, *_value_for(row.arity)))])
    message = str(caught.value)
    for row in refused:
        line = next(line for line in message.splitlines() if f" {row.flag} " in f" {line} ")
        assert line.endswith(row.note), (row, line)


def test_an_ignored_flag_is_in_the_grouped_notice_with_why() -> None:
    config = parse_config([*BASE, "--fp8-format", "e4m3", "--use-gated-attention", "--moe-shared-expert-gate",
                           "--wandb-dir", "/tmp/w"])
    notice = porting_notice(config)
    assert notice is not None
    for flag in ("--fp8-format", "--use-gated-attention", "--moe-shared-expert-gate", "--wandb-dir"):
        assert flag in notice
    assert CATEGORIES["logging"] in notice and "no meaning under FSDP2" in notice


def test_miles_dashboard_flags_are_known_and_said_not_called_unknown() -> None:
    # miles' parser adds them from miles/dashboard/args.py (miles' scripts/run_qwen3_dense.py gives
    # --use-miles-dashboard); the regeneration reads that file too
    import fnmatch

    from tools.upstream_flags.sources import MILES

    assert any(fnmatch.fnmatch("miles/dashboard/args.py", pattern) for pattern in MILES.patterns)
    config = parse_config([*BASE, "--use-miles-dashboard", "--dashboard-sglang-scrape-mode", "router",
                           "--dashboard-flush-interval", "5"])
    notice = porting_notice(config) or ""
    assert "--use-miles-dashboard" in notice and "--dashboard-sglang-scrape-mode" in notice
    assert "dashboard telemetry" in notice


def test_refusals_name_the_feature_and_why_grouped() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config([*BASE, "--teacher-port", "1", "--buffer-filter-path", "m:f",
                      "--enable-mtp-training", "--update-weight-delta-keep-files"])
    message = str(caught.value)
    assert "--teacher-port (slime): slime's earlier teacher-distillation server" in message
    assert "rollout buffer filter" in message and "MTP training" in message and "delta" in message
    assert "unknown" not in message


def test_unknown_means_unknown_to_every_upstream_and_names_the_versions() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config([*BASE, "--not-a-flag-anywhere"])
    message = str(caught.value)
    assert "--not-a-flag-anywhere" in message
    for name in ("slime", "miles", "Megatron-LM", "sglang-router"):
        assert name in message
    assert "624b824" in message  # the slime commit the table was read at


def test_train_backend_fsdp_is_accepted_and_megatron_mapped_with_a_notice() -> None:
    fsdp = parse_config([*BASE, "--train-backend", "fsdp"])
    assert fsdp.train.train_backend == "fsdp"
    assert "--train-backend" not in (porting_notice(fsdp) or "")
    megatron = parse_config([*BASE, "--train-backend", "megatron"])
    assert ROWS["--train-backend"].note in (porting_notice(megatron) or "")
    with pytest.raises(ConfigError, match="--train-backend"):
        parse_config([*BASE, "--train-backend", "deepspeed"])


def test_train_env_vars_reach_the_ranks_environment_and_bad_json_is_refused() -> None:
    config = parse_config([*BASE, "--train-env-vars", json.dumps({"NCCL_DEBUG": "INFO", "X_N": 3, "Y": True})])
    assert config.train.train_env == (("NCCL_DEBUG", "INFO"), ("X_N", "3"), ("Y", "true"))
    for bad in ("[1, 2]", "{not json", '{"A": [1]}', '{"A=B": "1"}'):
        with pytest.raises(ConfigError, match="--train-env-vars"):
            parse_config([*BASE, "--train-env-vars", bad])


def test_router_flags_are_passed_to_sglang_router_without_the_prefix() -> None:
    config = parse_config([*BASE, "--use-sglang-router", "--router-prefill-policy", "random",
                           "--router-health-check-interval-secs", "5", "--router-dp-aware"])
    assert config.router_passthrough == ("--prefill-policy", "random", "--health-check-interval-secs", "5",
                                         "--dp-aware")


def test_offload_and_per_token_loss_are_mapped() -> None:
    config = parse_config([*BASE, "--offload", "--calculate-per-token-loss"])
    assert config.cluster.offload_train and config.cluster.offload_rollout
    notice = porting_notice(config) or ""
    assert ROWS["--offload"].note in notice and ROWS["--calculate-per-token-loss"].note in notice


def test_miles_router_is_our_own_dispatch_with_a_notice_and_its_middleware_is_refused() -> None:
    config = parse_config([*BASE, "--use-miles-router", "--use-sglang-router", "--miles-router-timeout", "30"])
    notice = porting_notice(config) or ""
    assert ROWS["--use-miles-router"].note in notice and "--miles-router-timeout" in notice
    assert not config.sglang.launches_router  # miles' start_router runs its own router instead of sglang-router
    assert parse_config([*BASE, "--use-sglang-router"]).sglang.launches_router
    with pytest.raises(ConfigError) as caught:
        parse_config([*BASE, "--use-miles-router", "--miles-router-middleware-paths", "my.Middleware"])
    assert "--miles-router-middleware-paths (miles): miles' router middleware" in str(caught.value)
    assert "rayless has no router middleware" in str(caught.value)


# ---------------------------------------------------------------------------------------------------------
# The regeneration's reader
# ---------------------------------------------------------------------------------------------------------
def test_the_reader_takes_literals_f_strings_actions_and_nargs() -> None:
    source = textwrap.dedent('''
        def add(parser, prefix="router-"):
            parser.add_argument("--plain", type=int)
            parser.add_argument("--switch", action="store_true")
            parser.add_argument("--many", nargs="+")
            parser.add_argument("--maybe", nargs="?")
            parser.add_argument(f"--{prefix}policy", choices=["random"])
            parser.add_argument("--both", action=argparse.BooleanOptionalAction)
            reset_arg(parser, "--reset", type=str)
    ''')
    flags = extract.add_argument_flags(ast.parse(source), {"prefix": ("router-",)})
    assert flags == {"--plain": "value", "--switch": "switch", "--many": "values", "--maybe": "optional",
                     "--router-policy": "value", "--both": "switch", "--no-both": "switch", "--reset": "value"}


def test_the_reader_follows_megatrons_dataclass_factory() -> None:
    source = textwrap.dedent('''
        @dataclass
        class Base:
            hidden_size: int = 0
        @dataclass
        class Config(Base):
            off: bool = False
            on: bool = True
            layers: list[int] = field(default_factory=list)
            hidden: int = field(default=0, init=False)
            renamed: int = field(default=1, metadata={"argparse_meta": {"arg_names": ["--other-name"]}})
            skipped: int = 3
    ''')
    tree = ast.parse(source)
    classes = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    flags = extract.megatron_factory_flags(classes["Config"], classes.get, ["skipped"])
    assert flags == {"--hidden-size": "value", "--off": "switch", "--no-on": "switch", "--disable-on": "switch",
                     "--layers": "values", "--other-name": "value"}


def test_a_flag_slime_or_miles_retired_is_named_as_such_never_unknown() -> None:
    """Older launch scripts pass flags upstream removed before the commits the table reads (slime's
    rollout-buffer example still passes --ref-micro-batch-size): each has a row saying so, ignored where it only
    tuned memory or the router, read under its current name where upstream renamed it, refused with what
    replaced it otherwise."""
    retired = {flag: row for flag, row in ROWS.items() if "retired" in row.note}
    assert len(retired) >= 33 and all(set(row.origins) <= {"slime", "miles"} for row in retired.values())
    config = parse_config([*BASE, "--ref-micro-batch-size", "4", "--use-http2"])
    notice = porting_notice(config)
    assert notice is not None and "--ref-micro-batch-size" in notice and "--use-http2" in notice
    with pytest.raises(ConfigError) as caught:
        parse_config([*BASE, "--enable-off-policy-correction", "--update-rollout-weights-interval", "2"])
    message = str(caught.value)
    assert "use --use-tis" in message and "--update-weights-interval" in message and "unknown" not in message


def test_a_flag_upstream_renamed_is_read_as_its_current_name_and_said() -> None:
    """slime renamed --sampling-batch-size (to --over-sampling-batch-size) and --rollout-num-gpus-per-node (to
    --num-gpus-per-node): a script from before passes the old name, alone or as --old=value."""
    old = parse_config([*BASE, "--rollout-batch-size", "4", "--sampling-batch-size", "8",
                        "--rollout-num-gpus-per-node=4"])
    new = parse_config([*BASE, "--rollout-batch-size", "4", "--over-sampling-batch-size", "8",
                        "--num-gpus-per-node", "4"])
    assert old.rollout.over_sampling_batch_size == new.rollout.over_sampling_batch_size == 8
    assert old.flat() == new.flat() and old.given == new.given
    assert old.renamed_flags == (("--sampling-batch-size", "--over-sampling-batch-size"),
                                 ("--rollout-num-gpus-per-node", "--num-gpus-per-node"))
    notice = porting_notice(old)
    assert notice is not None and "--sampling-batch-size → --over-sampling-batch-size (renamed upstream" in notice
    assert "--rollout-num-gpus-per-node → --num-gpus-per-node" in notice
    assert all(ROWS[flag].disposition == "mapped" for flag in RENAMED)
