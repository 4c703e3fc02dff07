"""specpilot decoding core: sampling -> verify -> speculative_step -> generate."""
from .errors import SpecPilotError
from .loop import (
    DecodeState,
    Generation,
    GenerationStats,
    StepResult,
    generate,
    speculative_step,
    start,
)
from .policies import (
    ConfidenceStop,
    HeuristicK,
    LengthPolicy,
    NoSpeculation,
    StaticK,
)
from .policy_spec import parse_policy
from .sampling import Sampling

__all__ = [
    "SpecPilotError", "DecodeState", "Generation", "GenerationStats", "StepResult", "generate",
    "speculative_step", "start", "ConfidenceStop", "HeuristicK", "LengthPolicy", "NoSpeculation",
    "StaticK", "parse_policy", "Sampling",
]
