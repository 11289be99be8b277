"""Lossless speculative decoding over Hugging Face causal LMs."""

from engine.arms import MAX_K, MIN_K, OFF, Arm
from engine.drafters import Capabilities, Drafter, HybridDrafter, ModelDrafter, NGramDrafter
from engine.engine import BatchSession, SpeculativeEngine
from engine.errors import EngineError, IncompatibleDrafterError, InvalidRequestError
from engine.feature import FeatureDrafter, FeatureHead
from engine.layer_skip import LayerSkipDrafter
from engine.results import BatchRequest, BatchResult, GenerationMetrics, GenerationResult
from engine.sampling import SamplingParams
from engine.schedule import ConstantK, HeuristicK, KSchedule, RoundControl
from engine.streaming import Streamer

__all__ = [
    "Arm", "OFF", "BatchRequest", "BatchResult", "BatchSession", "MIN_K", "MAX_K", "Capabilities", "Drafter",
    "HybridDrafter", "ModelDrafter", "NGramDrafter", "FeatureDrafter", "FeatureHead", "LayerSkipDrafter",
    "GenerationMetrics", "GenerationResult", "SpeculativeEngine", "EngineError",
    "IncompatibleDrafterError", "InvalidRequestError", "SamplingParams", "ConstantK",
    "HeuristicK", "KSchedule", "RoundControl", "Streamer",
]
