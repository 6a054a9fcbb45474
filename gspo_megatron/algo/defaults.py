"""The algorithms' constants, each defined once: the loss functions' defaults (``gspo``, ``grpo``, ``kl``,
``metrics``), the loss's configuration (``train.update.loss.LossConfig``) and the YAML's ``algo`` section
(``train.startup.config.AlgoSection``) read them here."""

ALGORITHMS = ("gspo", "gspo_token", "grpo")
# The clip range (eps_low, eps_high) of each algorithm when the config leaves it unset: the GSPO paper's
# sequence-level range (GSPO-token shares it), and its GRPO baseline's token-level one.
CLIP_RANGES = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.27)}
# The log importance ratio is clamped to +-this before exp, so a ratio stays finite (``surrogate``).
MAX_LOG_RATIO = 10.0
# The KL estimator against the reference policy (Schulman's k3: non-negative and unbiased; ``kl``).
KL_ESTIMATOR = "k3"
# GRPO's normalisation: every token weighs the same (``aggregation``).
GRPO_AGGREGATION = "token-mean"
# The behaviour weight's bounds (``correction``): truncated at the upper one (slime's and verl's TIS default 2.0),
# masked outside both (IcePop's 0.5 / 2.0).
CORRECTION_LOW = 0.5
CORRECTION_HIGH = 2.0
