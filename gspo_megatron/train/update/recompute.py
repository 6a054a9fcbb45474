"""Activation recompute: the ``recompute`` config section checked, and turned into megatron's TransformerConfig fields.

    selective  megatron recomputes the listed submodules in backward (``recompute_modules``)
    full       whole layers: their inputs are kept, their activations recomputed (``recompute_method`` uniform or
               block, ``recompute_num_layers``)
    none       every activation is kept

``plan`` (plan.memory) counts activations for the same setting.
"""

from __future__ import annotations

from gspo_megatron.parallel.groups import Layout
from gspo_megatron.train.startup.config import Config, ConfigError

GRANULARITIES = ("selective", "full", "none")
METHODS = ("uniform", "block")
MODULES = ("core_attn", "moe", "mlp", "layernorm", "moe_act")
# Modules megatron-core 0.16.1 knows that this package does not offer yet, and why.
_UNUSABLE = {
    "mla_up_proj": "not offered yet for multi-latent attention (no test checks the update step under it, and plan "
                   "does not count it); use recompute.granularity=full",
    "shared_experts": "not offered yet; recompute 'moe' (the whole MoE layer, its shared experts included)",
}


def check_recompute(cfg: Config, hf: dict | None = None, transformer_engine: bool | None = None) -> None:
    """Raise ConfigError naming the ``recompute.*`` field that megatron would reject or that cannot work here.

    ``transformer_engine``: whether TE imports (None: find out); it decides the default of ``model.grouped_gemm``.
    """
    r = cfg.recompute
    te = _transformer_engine() if transformer_engine is None else transformer_engine
    if r.granularity not in GRANULARITIES:
        raise ConfigError(f"recompute.granularity={r.granularity!r} is not one of {GRANULARITIES}")
    if r.granularity == "selective":
        if not r.modules:
            raise ConfigError("recompute.modules is empty with recompute.granularity=selective: list modules "
                              f"from {MODULES}, or set recompute.granularity=none")
        for module in r.modules:
            if module in _UNUSABLE:
                raise ConfigError(f"recompute.modules: {module!r} cannot be used: {_UNUSABLE[module]}")
            if module not in MODULES:
                raise ConfigError(f"recompute.modules: {module!r} is not one of {MODULES}")
        # megatron-core (0.16.1, 0.19.2) refuses moe_act without moe_grouped_gemm: the experts must be TEGroupedMLP.
        grouped = te if cfg.model.grouped_gemm is None else cfg.model.grouped_gemm
        if "moe_act" in r.modules and not grouped:
            why = "model.grouped_gemm=false" if cfg.model.grouped_gemm is False else \
                "model.grouped_gemm=null and TransformerEngine does not import here"
            raise ConfigError(f"recompute.modules: 'moe_act' needs grouped-GEMM experts (megatron's TEGroupedMLP, "
                              f"moe_grouped_gemm=True), but {why}, so the experts are a SequentialMLP: remove "
                              "'moe_act' (or recompute 'moe'), or use TransformerEngine with grouped experts")
        if "layernorm" in r.modules and not te:
            raise ConfigError("recompute.modules: 'layernorm' needs TransformerEngine (megatron-core's "
                              "CheckpointWithoutOutput reads TE's FP8 state); remove it or install the gpu extra")
    if r.granularity == "full":
        if r.method not in METHODS:
            raise ConfigError(f"recompute.method={r.method!r} is not one of {METHODS}")
        per_stage = None
        if hf and hf.get("num_hidden_layers"):
            # the smallest stage bounds it (uneven stages: parallel.first/last_stage_layers)
            layers = hf["num_hidden_layers"]
            per_stage = min(Layout.of(cfg.parallel).stage_layers(layers)) if cfg.parallel.pipeline >= 1 else layers
        if r.num_layers < 1 or (per_stage is not None and r.num_layers > per_stage):
            bound = f"1..{per_stage} (layers per pipeline stage)" if per_stage else ">= 1"
            raise ConfigError(f"recompute.num_layers={r.num_layers} must be in {bound}")
    reroutes = r.granularity == "full" or (r.granularity == "selective" and "moe" in r.modules)
    if cfg.algo.routing_replay and reroutes:
        raise ConfigError(
            f"algo.routing_replay={cfg.algo.routing_replay} with recompute.granularity={r.granularity!r}"
            + (" and recompute.modules containing 'moe'" if r.granularity == "selective" else "")
            + ": the recomputed forward in backward would route again (under pipeline schedules with another "
            "micro batch's replay data); recompute without 'moe' or turn routing replay off"
        )


def transformer_config_fields(cfg: Config) -> dict:
    """The TransformerConfig fields of ``cfg.recompute`` (empty for none)."""
    r = cfg.recompute
    if r.granularity == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": list(r.modules)}
    if r.granularity == "full":
        return {"recompute_granularity": "full", "recompute_method": r.method, "recompute_num_layers": r.num_layers}
    return {}


def _transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True
