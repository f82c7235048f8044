"""The `rayless` command: `train`, `engine`, `make-tiny-model`, `export`, `dump`, `reward`, `status`, `stacks`
and `tinker-server`.

Owns argument dispatch and exit statuses only: 0 success, 1 a failure during the run, 2 bad flags (reported
before any process is launched or port opened). Each subcommand's work lives in its own module and is imported
lazily, so `rayless --help` and flag errors stay fast and never import torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn

USAGE = """usage: rayless COMMAND [ARGS]

commands:
  train             run RL post-training (rollouts on engines, training on torchrun ranks); --help for flags
  engine            serve a Hugging Face model with the SGLang HTTP API (on the CPU, or --device cuda)
  make-tiny-model   write a tiny local Hugging Face model directory (nothing fetched from a hub)
  export            CKPT OUT: a checkpoint of --save as a Hugging Face model directory (on the CPU)
  dump              show | verify | convert rollout dumps
  reward            score: run a built-in reward type over a JSONL file (--compare T2: where two differ)
  status            a run's status: from its status server (--status-port) or its run directory
  stacks            the live Python stacks of a running job's coordinator (its event-loop tasks), ranks and engines
  tinker-server     serve the Tinker training API (the official `tinker` SDK) on local ranks and engines
"""


#: the environment every rayless process tree runs with unless the user set the variable: the coordinator calls
#: the tokenizer's batch API on its event loop, a group's few prompts or responses at a time, where the Rust
#: tokenizer's thread pool costs more than it saves (waking its threads: 74 µs against 3 for 8 four-token
#: responses; ms-long stalls of the loop on a loaded machine) — and engines and ranks inherit it
PROCESS_ENVIRONMENT = {"TOKENIZERS_PARALLELISM": "false"}


def apply_process_environment() -> None:
    """Set `PROCESS_ENVIRONMENT`'s variables the user did not set (the tokenizers library reads its variable at
    each batch call, so this holds from here on in this process and in every process it starts)."""
    for name, value in PROCESS_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def main(argv: Sequence[str] | None = None) -> int:
    apply_process_environment()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "train":
        return train_main(rest)
    if command == "engine":
        from workers.engine import main as engine_main

        return engine_main(rest)
    if command == "make-tiny-model":
        return make_tiny_model_main(rest)
    if command == "export":
        from workers.train_rank.export import main as export_main

        return export_main(rest)
    if command == "dump":
        from replay.tools import main as dump_main

        return dump_main(rest)
    if command == "reward":
        from coordinator.rewards.score import main as reward_main

        return reward_main(rest)
    if command == "status":
        from coordinator.status.command import main as status_main

        return status_main(rest)
    if command == "stacks":
        from coordinator.observe.stacks import main as stacks_main

        return stacks_main(rest)
    if command == "tinker-server":
        from coordinator.tinker.cli import main as tinker_main

        return tinker_main(rest)
    print(f"rayless: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


def train_main(argv: Sequence[str]) -> int:
    """Parse, check against the machine (files, hooks, backends), plan the placement, then run. Exit 2 before
    any launch on bad flags or a plan this node cannot hold; `--dry-run` reports the checks and the plan and
    launches nothing. Secrets given on the command line are masked in everything printed here.

    Multi-node (`--actor-num-nodes N`): the same command runs on every node; the launcher's environment says
    which node this is (`coordinator.plan.layout`). Node 0 runs the coordinator; any other node runs only its
    share of the plan (`coordinator.nodes.agent`), connected back to node 0."""
    from coordinator.checks.resolve import resolve
    from coordinator.config import ConfigError, ConfigWarning, parse_config
    from coordinator.config.secrets import config_secrets, mask_text, secret_values_in_argv

    secrets = secret_values_in_argv(argv)
    layout_warnings: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        try:
            # the layout, the checks, the rollout count and the plan, in that order (`checks.resolve`)
            resolved = resolve(parse_config(argv))
            config, layout, plan = resolved.config, resolved.layout, resolved.plan
            layout_warnings = list(resolved.warnings)
            if layout is not None and layout.token.value is not None:
                secrets.add(layout.token.value)
        except ConfigError as error:
            print(f"rayless train: error: {mask_text(str(error), secrets)}", file=sys.stderr)
            return 2
    from coordinator.config.porting import PortingNotice

    for warning in caught:
        kind = "notice" if issubclass(warning.category, PortingNotice) else "warning"
        print(f"rayless train: {kind}: {mask_text(str(warning.message), secrets)}", file=sys.stderr)
    if config.debug.dry_run:
        from coordinator.checks.dry_run import dry_run

        secrets |= config_secrets(config)
        return dry_run(config, mask=lambda text: mask_text(text, secrets), layout=layout,
                       layout_warnings=layout_warnings)
    assert plan is not None  # `resolve` plans every config it resolves for a launch
    if layout is not None and not layout.is_coordinator:
        from coordinator.nodes.agent import run_node_sync

        return run_node_sync(config, plan)

    from coordinator.run import run_training_sync

    return run_training_sync(config, plan, argv=argv)


def make_tiny_model_main(argv: Sequence[str]) -> int:
    from workers.tiny_model import TinyModelSpec
    from workers.tiny_vlm import FAMILIES as VLM_FAMILIES

    defaults = TinyModelSpec()
    parser = argparse.ArgumentParser(prog="rayless make-tiny-model",
                                     description="Write a tiny Qwen3-family model with a character tokenizer.")
    parser.add_argument("directory")
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--num-hidden-layers", type=int, default=defaults.num_hidden_layers)
    parser.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)
    parser.add_argument("--num-attention-heads", type=int, default=defaults.num_attention_heads)
    parser.add_argument("--num-key-value-heads", type=int, default=defaults.num_key_value_heads)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--words", nargs="+", default=[], metavar="WORD",
                        help="whole words that are one token each (tool tags such as '<search>')")
    parser.add_argument("--untied-head", action="store_true",
                        help="an output head of its own (tie_word_embeddings false), starting as a copy of the "
                        "embeddings, so LoRA can adapt it (--target-modules ...,lm_head)")
    parser.add_argument("--vlm", action="store_true",
                        help="a tiny vision-language model (Qwen2.5-VL unless --vlm-family says) and its image "
                        "processor (docs/vlm.md); takes --seed only")
    parser.add_argument("--vlm-family", choices=VLM_FAMILIES, default=None,
                        help="the tiny vision-language model's family (config.json's model_type); implies --vlm")
    options = parser.parse_args(list(argv))
    if options.vlm or options.vlm_family:
        return _make_tiny_vlm(options, parser)

    from workers.tiny_model import build_tiny_model, count_parameters

    shape = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
             "seed")  # each the flag of its name
    spec = TinyModelSpec(**{name: getattr(options, name) for name in shape}, words=tuple(options.words),
                         untied_head=options.untied_head)
    directory = build_tiny_model(options.directory, spec)
    print(f"wrote {directory} ({count_parameters(directory):,} parameters)")
    return 0


def _make_tiny_vlm(options: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from workers.tiny_model import count_parameters
    from workers.tiny_vlm import TinyVlmSpec, build_tiny_vlm

    shaped = [flag for flag, given in (("--words", options.words), ("--untied-head", options.untied_head)) if given]
    if shaped:
        parser.error(f"--vlm builds a fixed tiny shape; {', '.join(shaped)} is for the text model only")
    family = options.vlm_family or TinyVlmSpec.family
    directory = build_tiny_vlm(options.directory, TinyVlmSpec(seed=options.seed, family=family))
    print(f"wrote {directory} ({count_parameters(directory):,} parameters, vision-language {family})")
    return 0


def run_and_exit() -> NoReturn:
    """The `rayless` command (and `python -m coordinator.cli`): `main`, then an exit without the interpreter's
    teardown of what it imported (torch and transformers for `train`: ~1.2 CPU-s, and on a loaded machine
    seconds past the stop that signal handling promises, with every launched process already stopped). The logs
    and stdio are flushed first; an error raised out of `main` propagates as usual.

    A reader that stops reading (`rayless status RUN | head -1`, `rayless dump show D | less` quit early) ends
    the command quietly with exit 0, for every subcommand: what was asked for was read, and a BrokenPipeError
    traceback would only hide it."""
    try:
        code = main()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:
        code = _reader_gone()
    os._exit(code if isinstance(code, int) else 0)


def _reader_gone() -> int:
    """The pipe's reader closed it: point stdout and stderr at /dev/null, so the interpreter's last flush of
    what is still buffered cannot raise again, and exit 0."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):  # a stream without a descriptor (replaced by a caller): nothing to redirect
            pass
    os.close(devnull)
    return 0


if __name__ == "__main__":
    run_and_exit()
