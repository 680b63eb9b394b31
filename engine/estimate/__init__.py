"""Memory estimator and strategy advisor: `tiers estimate` and `tiers tune` (Note [peak memory estimate])."""

from engine.estimate.estimator import Estimate, EstimateSettings, RankBudgets, StrategyEstimate, estimate
from engine.estimate.model_spec import ModelSpecError, build_model, model_factory
from engine.estimate.model_states import ModelStates, TrainableParam, model_states
from engine.estimate.report import format_estimate
from engine.estimate.strategies import Strategy, candidate_strategies

__all__ = ["Estimate", "EstimateSettings", "ModelSpecError", "ModelStates", "RankBudgets", "Strategy",
           "StrategyEstimate", "TrainableParam", "build_model", "candidate_strategies", "estimate", "format_estimate",
           "model_factory", "model_states"]
