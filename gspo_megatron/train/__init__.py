"""The trainer, by the words of its loop (``loop.py``, one screen):

    startup/      config, its checks, run directories, prompts and rewards, the policy's construction
    sampling/     where each step's rollout comes from: the engine, generation rounds, scoring, dynamic sampling,
                  partial rollouts, the rollout source (sync, one_step_off, async)
    update/       old / reference log-prob passes, advantages, the loss, routing replay, packing, the schedules
    weight_sync/  every rank's side of sending the trained weights to the rollout engine
    resilience/   non-finite steps, preemption, torchrun restarts, the soak run's fault injection
    records/      checkpoints, metrics, plots, progress
"""
