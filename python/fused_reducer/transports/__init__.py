"""Transports: the choice between NCCL, gloo and shared memory, shared-memory naming and sweeping,
the store exchanges (transport.py) and torchrun restarts (elastic.py). Imports only the base."""
