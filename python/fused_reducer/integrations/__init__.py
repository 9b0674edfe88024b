"""Thin adapters for host libraries: Lightning (lightning.py), Hugging Face accelerate
(accelerate.py) and transformers (transformers.py), torch.distributed.pipelining (pipelining.py).
They translate the host's settings into FusedReducer's arguments and use only the public API."""
