"""``ragen-mega``: one command, a subcommand per job.

Each subcommand lives in the module that implements it and exposes ``main(argv) -> int``; this file
only dispatches, importing lazily so ``ragen-mega play`` never imports megatron or sglang.
"""
from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "play": ("ragen_mega.envs.play", "play an environment by hand, seeing the model's text"),
    "env-server": ("ragen_mega.envs.server", "serve an env over HTTP for remote rollouts (env.remote)"),
    "prepare-model": ("ragen_mega.models.prepare", "write a local HF model directory (no hub)"),
    "convert": ("ragen_mega.backends.megatron.convert", "convert checkpoints HF <-> Megatron"),
    "train": ("ragen_mega.train", "train with StarPO / StarPO-S (CONFIG.yaml [key=value ...])"),
    "config": ("ragen_mega.config_command", "a config resolved, as YAML (CONFIG.yaml [key=value "
               "...]), or every key's default and help (--keys [PREFIX])"),
    "sft": ("ragen_mega.sft", "supervised warm start on the same trainer (CONFIG.yaml [key=value ...])"),
    "eval": ("ragen_mega.evaluate", "held-out evaluation of a checkpoint (CONFIG.yaml --checkpoint PATH)"),
    "plot": ("ragen_mega.plot", "curves of runs' metrics.jsonl as a PNG (RUN_DIR ... --out FILE.png)"),
    "sweep": ("ragen_mega.sweep", "variants x seeds of one config, one run each (SWEEP.yaml); "
              "--sbatch: a Slurm job array; --report: IQM and intervals across seeds"),
    "view": ("ragen_mega.view", "the trajectory viewer: a run's episodes, turn by turn, in a browser"),
    "plan": ("ragen_mega.plan", "a run's layout and per-GPU memory, checked without a GPU "
             "(CONFIG.yaml [key=value ...] [--nodes N --gpus-per-node G --gpu-mem 80GiB])"),
}


def _usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "usage: ragen-mega COMMAND [ARGS...]\n\ncommands:\n" + "\n".join(lines) + \
        "\n\n`ragen-mega COMMAND --help` shows a command's own options."


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"ragen-mega: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
