"""Thin wrapper around ``ragen-mega convert megatron-to-hf`` (same arguments, see --help)."""
import sys

from ragen_mega.backends.megatron.convert import main

if __name__ == "__main__":
    sys.exit(main(["megatron-to-hf", *sys.argv[1:]]))
