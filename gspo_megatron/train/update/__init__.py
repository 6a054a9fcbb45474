"""Update: the passes over a rollout (old and reference log-probs, the minibatch updates), the row plans and micro
batches they run on, advantages, the loss inside Megatron's schedules, routing record and replay, recompute."""
