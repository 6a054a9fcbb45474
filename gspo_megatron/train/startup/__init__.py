"""Start-up: the config (typed, checked before any process group starts), run directories, the model directory,
prompts and rewards, and the policy's construction (with its speed settings)."""
