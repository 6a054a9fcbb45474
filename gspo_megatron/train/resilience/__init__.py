"""Resilience: non-finite steps skipped on every rank (``faults``), a scheduler's stop (``preemption``), a dead rank
under ``torchrun --max-restarts`` (``elastic``), and the soak run's fault schedule (``fault_injection``)."""
