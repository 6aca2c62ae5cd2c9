"""Colocated weight sync on CPU hands tensors over by shared-memory file (torch's
``file_system`` strategy): every receiving process (each TP rank of each engine) must get bytes
of its own, or the file is unlinked under the later readers (three engines failed with
``unable to open shared memory object``). Real processes read one bucket one after another, as
the engines' ranks do."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ragen_mega.backends.sglang.payloads import engine_payload, pickle_for_receiver

# read the tensor, then let it go, as an engine does once the weights are loaded
READ = ("import pickle, sys, torch\n"
        "obj = pickle.loads(sys.stdin.buffer.read())\n"
        "flat = obj['flattened_tensor'] if isinstance(obj, dict) else obj[0][1]\n"
        "total = float(flat.view(torch.float32).sum())\n"
        "del obj, flat\n"
        "print(total)\n")


@pytest.mark.parametrize("flattened", [False, True])
def test_every_receiver_reads_the_bucket(flattened):
    weight = torch.arange(4096, dtype=torch.float32)
    payload = engine_payload([("w", weight)], flattened=flattened)
    for reader in range(3):  # three engines at TP 1 (the third read failed)
        done = subprocess.run([sys.executable, "-c", READ], input=pickle_for_receiver(payload),
                              capture_output=True, timeout=120)
        assert done.returncode == 0, (reader, done.stderr.decode()[-2000:])
        assert float(done.stdout) == float(weight.sum()), reader
