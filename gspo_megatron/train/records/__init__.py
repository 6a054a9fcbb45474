"""Records: what a run leaves behind: checkpoints (``checkpoint``), metrics (``metrics_log``), plots, progress."""
