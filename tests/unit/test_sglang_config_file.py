"""`--sglang-config` (slime's/miles' YAML of SGLang server groups): read, mapped onto the rollout and eval engine
groups of the plan (each group's overrides on its own engines' command lines), and what rayless cannot serve
refused naming the file and the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coordinator.config import ConfigError, parse_config
from coordinator.plan import GpuInventory, build_plan
from coordinator.plan.render import describe_plan

BASE = ["--hf-checkpoint", "/m", "--rollout-batch-size", "8", "--num-rollout", "2", "--prompt-data",
        "builtin:first_digit", "--run-dir", "/runs/x"]
EVAL = ["--eval-interval", "1", "--eval-prompt-data", "x", "builtin:first_digit", "--eval-hf-dir", "/tmp/eval-hf"]

#: miles' tests/e2e/sglang_config/test_sglang_config.py@31f1ca961: one model, two regular groups of 4 GPUs
MILES_TWO_GROUPS = """\
sglang:
  - name: default
    server_groups:
      - worker_type: regular
        num_gpus: 4
        num_gpus_per_engine: 1
      - worker_type: regular
        num_gpus: 4
        num_gpus_per_engine: 1
"""


#: slime's tests/test_qwen2.5_0.5B_sglang_config.py@624b824a8: one model, engines of two sizes and 2 GPUs
#: reserved by a placeholder group (the script: --colocate on 8 GPUs, --rollout-num-gpus-per-engine 1)
SLIME_MIXED = """\
sglang:
  - name: default
    server_groups:
      - worker_type: regular
        num_gpus: 4
        num_gpus_per_engine: 2
      - worker_type: regular
        num_gpus: 2
        num_gpus_per_engine: 1
      - worker_type: placeholder
        num_gpus: 2
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "sglang.yaml"
    path.write_text(text)
    return str(path)


def plan(*flags: str, gpus: int = 16):
    return build_plan(parse_config([*BASE, *flags]), GpuInventory.of_count(gpus, "injected", injected=True),
                      has_sglang=True)


def args_of(slot) -> list[str]:
    return slot.command()[3:]


def value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_miles_two_groups_are_the_rollout_engines(tmp_path: Path) -> None:
    node = plan("--rollout-num-gpus", "8", "--sglang-config", write(tmp_path, MILES_TWO_GROUPS),
                "--sglang-mem-fraction-static", "0.6", "--debug-rollout-only").local
    assert [slot.name for slot in node.rollout_engines] == [f"rollout-{i}" for i in range(8)]
    assert all(value(args_of(slot), "--mem-fraction-static") == "0.6" for slot in node.rollout_engines)


def test_each_group_s_overrides_reach_its_own_engines_on_top_of_the_sglang_flags(tmp_path: Path) -> None:
    config = write(tmp_path, """\
sglang:
  - name: actor
    num_gpus_per_engine: 2
    server_groups:
      - {worker_type: regular, num_gpus: 4, overrides: {mem_fraction_static: 0.7, enable_metrics: false}}
      - worker_type: regular
        num_gpus: 2
        overrides: {chunked_prefill_size: 4096, context_length: 2048, json_model_override_args: {a: 1}}
  - name: eval
    server_groups:
      - {worker_type: regular, num_gpus: 2, overrides: {cuda_graph_max_bs: 8, log_level: info}}
""")
    node = plan("--rollout-num-gpus", "6", "--rollout-num-gpus-per-engine", "2", "--sglang-config", config,
                "--sglang-mem-fraction-static", "0.5", "--sglang-enable-metrics", "--sglang-context-length", "1024",
                "--eval-num-gpus", "2", "--eval-sglang-cuda-graph-max-bs", "4", "--eval-sglang-log-level", "warn",
                *EVAL).local
    first, second, third = (args_of(slot) for slot in node.rollout_engines)
    for argv in (first, second):  # group 0: its own fraction, --enable-metrics dropped by `false`
        assert value(argv, "--mem-fraction-static") == "0.7" and "--enable-metrics" not in argv
        assert value(argv, "--context-length") == "1024" and value(argv, "--tp-size") == "2"
    assert value(third, "--mem-fraction-static") == "0.5" and "--enable-metrics" in third
    assert value(third, "--chunked-prefill-size") == "4096" and value(third, "--json-model-override-args") == '{"a": 1}'
    assert third.count("--context-length") == 1 and value(third, "--context-length") == "2048"
    # eval: YAML > --eval-sglang-* > --sglang-* (miles' order)
    for slot in node.eval_engines:
        argv = args_of(slot)
        assert value(argv, "--cuda-graph-max-bs") == "8" and value(argv, "--log-level") == "info"
        assert value(argv, "--mem-fraction-static") == "0.5"
    assert [slot.gpus for slot in node.rollout_engines] == [(1, 2), (3, 4), (5, 6)]


def test_a_group_false_drops_an_inherited_eval_override_too(tmp_path: Path) -> None:
    config = write(tmp_path, """\
sglang:
  - name: default
    server_groups: [{worker_type: regular, num_gpus: 1}]
  - name: eval
    server_groups: [{worker_type: regular, num_gpus: 1, overrides: {enable_metrics: false}}]
""")
    node = plan("--rollout-num-gpus", "1", "--sglang-config", config, "--sglang-enable-metrics", "--eval-num-gpus",
                "1", "--eval-sglang-enable-metrics", *EVAL).local
    assert "--enable-metrics" in args_of(node.rollout_engines[0])
    assert "--enable-metrics" not in args_of(node.eval_engines[0])


def test_a_model_path_with_update_weights_is_served_and_updated(tmp_path: Path) -> None:
    # miles' scripts/run_glm5_2_744b_a40b_lora.py@31f1ca961 (--fp8-rollout): the fp8 checkpoint, update_weights on
    config = write(tmp_path, "sglang:\n  - name: default\n    model_path: /m-fp8\n    update_weights: true\n"
                             "    server_groups:\n      - worker_type: regular\n        num_gpus: 2\n")
    node = plan("--rollout-num-gpus", "2", "--sglang-config", config, "--debug-rollout-only").local
    assert [value(args_of(slot), "--model-path") for slot in node.rollout_engines] == ["/m-fp8", "/m-fp8"]


def test_slime_groups_of_two_sizes_and_a_placeholder_colocated(tmp_path: Path) -> None:
    """slime's e2e script: 2 engines of TP 2 on GPUs 0-3, 2 of TP 1 on GPUs 4 and 5, GPUs 6-7 reserved (no
    engine); colocated, the 8 training ranks keep all 8 GPUs."""
    node = plan("--actor-num-gpus-per-node", "8", "--colocate", "--rollout-num-gpus-per-engine", "1",
                "--sglang-config", write(tmp_path, SLIME_MIXED), gpus=8).local
    engines = node.rollout_engines
    assert [slot.name for slot in engines] == [f"rollout-{i}" for i in range(4)]
    assert [slot.gpus for slot in engines] == [(0, 1), (2, 3), (4,), (5,)]
    assert [value(args_of(slot), "--tp-size") for slot in engines] == ["2", "2", "1", "1"]
    assert [value(args_of(slot), "--base-gpu-id") for slot in engines] == ["0", "2", "4", "5"]
    assert [slot.spec.tp_size for slot in engines] == [2, 2, 1, 1]  # each joins the weight-update group so
    assert node.ranks is not None and node.ranks.gpus == tuple(range(8))
    assert node.reserved_gpus == (6, 7)


def test_a_placeholder_holds_its_gpus_apart_from_the_next_fleet(tmp_path: Path) -> None:
    """Not colocated: ranks on GPUs 0-1, the file's 8 GPUs on 2-9 (8-9 reserved), the eval fleet after them;
    a node short of GPUs is refused naming the file and the reserved GPUs."""
    flags = ("--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "8", "--sglang-config",
             write(tmp_path, SLIME_MIXED), "--eval-num-gpus", "1", *EVAL)
    node = plan(*flags, gpus=11).local
    assert [slot.gpus for slot in node.rollout_engines] == [(2, 3), (4, 5), (6,), (7,)]
    assert [slot.gpus for slot in node.eval_engines] == [(10,)]
    with pytest.raises(ConfigError, match=r"needs 11 GPUs.*sglang.yaml \(4 rollout engines of 2\+2\+1\+1 GPUs, 2 "
                                          r"reserved by placeholder groups: 8\)"):
        plan(*flags, gpus=10)
    # without the eval fleet the reserved GPUs 8-9 still count: a node of 9 is short, the plan prints them
    alone = flags[:6]
    with pytest.raises(ConfigError, match=r"needs 10 GPUs"):
        plan(*alone, gpus=9)
    whole = plan(*alone, gpus=10)
    assert whole.local.reserved_gpus == (8, 9) and whole.local.gpus_needed == 10
    assert re.search(r"\n  reserved +8,9 +- +placeholder server groups: no engine$", describe_plan(whole, detail=False),
                     re.M)


def test_slime_distributed_variant_places_after_the_ranks(tmp_path: Path) -> None:
    """slime's tests/test_qwen2.5_0.5B_sglang_config_distributed.py@624b824a8: 4 training GPUs, 4 rollout GPUs as
    a TP-2 engine, a TP-1 engine and a reserved GPU."""
    config = write(tmp_path, "sglang:\n  - name: default\n    server_groups:\n"
                             "      - {worker_type: regular, num_gpus: 2, num_gpus_per_engine: 2}\n"
                             "      - {worker_type: regular, num_gpus: 1, num_gpus_per_engine: 1}\n"
                             "      - {worker_type: placeholder, num_gpus: 1}\n")
    node = plan("--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "1",
                "--sglang-config", config, gpus=8).local
    assert [slot.gpus for slot in node.rollout_engines] == [(4, 5), (6,)]
    assert node.reserved_gpus == (7,) and node.ranks is not None and node.ranks.gpus == (0, 1, 2, 3)


def test_the_eval_model_s_groups_have_their_own_sizes_too(tmp_path: Path) -> None:
    config = write(tmp_path, "sglang:\n  - name: default\n    server_groups: [{worker_type: regular, num_gpus: 2}]\n"
                             "  - name: eval\n    server_groups:\n"
                             "      - {worker_type: regular, num_gpus: 2, num_gpus_per_engine: 2}\n"
                             "      - {worker_type: placeholder, num_gpus: 1}\n"
                             "      - {worker_type: regular, num_gpus: 1}\n")
    node = plan("--rollout-num-gpus", "2", "--sglang-config", config, "--eval-num-gpus", "4", *EVAL).local
    # ranks on GPU 0, the rollout engines on 1-2, the eval model's blocks after them
    assert [(slot.gpus, slot.spec.tp_size) for slot in node.eval_engines] == [((3, 4), 2), ((6,), 1)]
    assert node.reserved_gpus == (5,)


def test_our_engine_on_cuda_refuses_a_tensor_parallel_group(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--engine-backend rayless: our engine runs on one GPU, but "
                                          r"--sglang-config .*sglang.yaml: a server group's num_gpus_per_engine is 2"):
        plan("--rollout-num-gpus", "8", "--sglang-config", write(tmp_path, SLIME_MIXED), "--engine-backend",
             "rayless", "--debug-rollout-only")


def test_cpu_engines_count_num_gpus_as_engines(tmp_path: Path) -> None:
    config = write(tmp_path, MILES_TWO_GROUPS)
    node = plan("--rollout-num-engines", "8", "--sglang-config", config, "--debug-rollout-only", gpus=0).local
    assert len(node.rollout_engines) == 8 and all(slot.choice.device == "cpu" for slot in node.rollout_engines)
    with pytest.raises(ConfigError, match=r"sglang\[0\].server_groups: num_gpus add up to 8, but "
                                          r"--rollout-num-engines is 2"):
        parse_config([*BASE, "--rollout-num-engines", "2", "--sglang-config", config])
    # --rollout-num-engines stands in for the GPUs: slime's file launches its 4 engines there too, none for the
    # placeholder
    node = plan("--rollout-num-engines", "8", "--sglang-config", write(tmp_path, SLIME_MIXED), "--debug-rollout-only",
                gpus=0).local
    assert [slot.name for slot in node.rollout_engines] == [f"rollout-{i}" for i in range(4)]
    assert all(slot.choice.device == "cpu" and slot.spec.tp_size == 1 for slot in node.rollout_engines)


@pytest.mark.parametrize(("yaml_text", "flags", "match"), [
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: prefill, num_gpus: 1}]\n", (),
     r"sglang\[0\].server_groups\[0\].worker_type: prefill: prefill/decode disaggregation is not in rayless"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: placeholder, num_gpus: 2}]\n", (),
     r"sglang\[0\].server_groups: only placeholder groups: the model launches no engine"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 1}, "
     "{worker_type: placeholder, num_gpus: 1}]\n", ("--actor-num-nodes", "2", "--rdzv-endpoint", "10.0.0.1:29500"),
     r"server_groups\[1\].worker_type: placeholder on --actor-num-nodes 2: rayless splits a fleet over the nodes"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 2, num_gpus_per_engine: 2}, "
     "{worker_type: regular, num_gpus: 2}]\n", ("--actor-num-nodes", "2", "--rdzv-endpoint", "10.0.0.1:29500"),
     r"server_groups\[1\].num_gpus_per_engine: 1 differs from sglang\[0\].server_groups\[0\]'s 2 on "
     r"--actor-num-nodes 2"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 3, num_gpus_per_engine: 2}]\n",
     (), r"server_groups\[0\].num_gpus: 3 is not a multiple of the group's engine size 2"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: encoder, num_gpus: 1}]\n", (),
     r"server_groups\[0\].worker_type: encoder: slime's separate multimodal encoder"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 1}]\n"
     "  - name: ref\n    model_path: /ref\n    update_weights: false\n"
     "    server_groups: [{worker_type: regular, num_gpus: 1}]\n", (),
     r"sglang\[1\] \(name 'ref'\): a second model served beside the policy"),
    ("sglang:\n  - name: a\n    model_path: /other\n    server_groups: [{worker_type: regular, num_gpus: 2}]\n", (),
     r"sglang\[0\].model_path: /other differs from --hf-checkpoint.*update_weights: true"),
    ("sglang:\n  - name: a\n    update_weights: false\n    server_groups: [{worker_type: regular, num_gpus: 2}]\n",
     (), r"sglang\[0\].update_weights: false: rollouts from a frozen model"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 2, overrides: {config: x.yaml}}]\n",
     (), r"server_groups\[0\].overrides.config: not overridable per group in rayless: SGLang's own --config"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 2, overrides: {tp_size: 2}}]\n",
     (), r"overrides.tp_size: not overridable per group.*num_gpus_per_engine"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 2, overrides: {api_key: k}}]\n",
     (), r"overrides.api_key: not overridable per group.*--sglang-api-key"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 2, overrides: "
     "{ssl_keyfile_password: k}}]\n", (), r"server_groups\[0\].overrides: a key or secret-looking setting"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 3}]\n", (),
     r"num_gpus add up to 3, but --rollout-num-gpus is 2"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 2, weight: 1}]\n", (),
     r"server_groups\[0\].weight: not a server-group key of slime/miles"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 2}]\n"
     "  - name: eval\n    server_groups: [{worker_type: regular, num_gpus: 1}]\n", (),
     r"sglang\[1\] \(name 'eval'\): an eval model needs the eval fleet"),
    ("models: []\n", (), r"the top level must be a mapping with an `sglang` key"),
    ("sglang: &a\n  - name: x\nb: *a\n", (), r"anchors and aliases"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 2}]\n",
     ("--rollout-external-engine-addrs", "127.0.0.1:1"), r"--sglang-config .* and --rollout-external-engine-addrs: the file describes engines rayless launches"),
])
def test_what_cannot_map_is_refused_naming_the_key(tmp_path: Path, yaml_text: str, flags: tuple[str, ...],
                                                   match: str) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        parse_config([*BASE, "--rollout-num-gpus", "2", "--sglang-config", write(tmp_path, yaml_text), *flags])
    assert str(tmp_path / "sglang.yaml") in str(caught.value)


def test_a_missing_file_is_refused_and_a_train_only_run_does_not_read_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--sglang-config .*nope.yaml: no such file"):
        parse_config([*BASE, "--rollout-num-gpus", "2", "--sglang-config", str(tmp_path / "nope.yaml")])


def test_an_api_key_run_names_one_config_file_on_the_engine_command_line(tmp_path: Path) -> None:
    """The note that a user's sglang config plus a key could give SGLang two `--config` files: `--sglang-config`
    is this file, never SGLang's own `--config`, so each engine names only the 0600 file rayless writes."""
    config = write(tmp_path, "sglang:\n  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 2, "
                             "overrides: {mem_fraction_static: 0.7}}]\n")
    node = plan("--rollout-num-gpus", "2", "--sglang-config", config, "--sglang-api-key", "k" * 24,
                "--debug-rollout-only").local
    for slot in node.rollout_engines:
        argv = args_of(slot)
        assert argv.count("--config") == 1 and "api-key" in value(argv, "--config")
        assert value(argv, "--mem-fraction-static") == "0.7" and "k" * 24 not in " ".join(argv)
