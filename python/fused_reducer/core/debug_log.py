"""FUSED_REDUCER_DEBUG=1: layout changes and rebuilds logged to the ``fused_reducer`` logger
(tuning decisions are logged by the tuning layer)."""
import logging
import os

import torch.distributed as dist

log = logging.getLogger("fused_reducer")

DEBUG_ENV = "FUSED_REDUCER_DEBUG"


def debug_enabled():
    """FUSED_REDUCER_DEBUG=1: debug records of the 'fused_reducer' logger are shown on stderr
    (a handler is added unless the application configured one)."""
    if os.environ.get(DEBUG_ENV, "").strip() in ("", "0"):
        return False
    if log.level == logging.NOTSET or log.level > logging.DEBUG:
        log.setLevel(logging.DEBUG)
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[fused_reducer %(levelname)s] %(message)s"))
        log.addHandler(handler)
    return True


class LayoutLog:
    """Logs a model's layout when it is attached and after each rebuild, once."""

    def __init__(self):
        self._rebuilds_seen = 0

    def attached(self, model):
        self._rebuilds_seen = 0
        _log_layout(model, "initial layout")

    def after_prepare(self, model):
        rebuilds = model.stats()["rebuilds"]
        if rebuilds != self._rebuilds_seen:
            self._rebuilds_seen = rebuilds
            _log_layout(model, f"layout rebuilt (rebuild {rebuilds})")


def _log_layout(model, what):
    sizes = model.bucket_sizes()
    log.debug("rank %d: %s: first_bucket_bytes=%d bucket_cap_bytes=%d last_bucket_bytes=%d; "
              "%d buckets (MiB, launch order) %s", dist.get_rank(model.process_group), what,
              model.first_bucket_bytes, model.bucket_cap_bytes, model.last_bucket_bytes,
              len(sizes), [round(b / 2**20, 3) for b in sizes])
