"""Weight sync: every trainer rank's side of sending the trained weights to the rollout engine (``sync``), and the
pipeline stages' tensors gathered onto the first stage for the engines that take them through rank 0
(``pipeline``). The engine's side is ``rollout.weight_sync`` / ``rollout.sglang_engine``; the export, ``model.bridge``."""
