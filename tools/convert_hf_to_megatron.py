"""Thin wrapper around ``ragen-mega convert hf-to-megatron`` (same arguments, see --help)."""
import sys

from ragen_mega.backends.megatron.convert import main

if __name__ == "__main__":
    sys.exit(main(["hf-to-megatron", *sys.argv[1:]]))
