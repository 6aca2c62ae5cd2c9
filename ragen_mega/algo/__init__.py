"""Advantages, losses and the StarPO-S filter: pure tensor functions, no I/O, no distributed
state (the trainer reduces metrics and normalizers across ranks itself)."""
