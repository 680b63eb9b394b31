"""The features initialize() builds, in the order it applies them to the model (Note [feature objects]): a new
parallelism adds its package's Feature here, where its build must come (after the features whose hooks it reads)."""

from engine.activation_checkpointing.feature import ActivationCheckpointingFeature
from engine.moe.feature import ExpertFeature
from engine.pipeline.feature import LayerMajorFeature, PipelineFeature
from engine.sequence_parallel.feature import SequenceFeature
from engine.tensor_parallel.feature import TensorParallelFeature

FEATURES = (TensorParallelFeature, ExpertFeature, SequenceFeature, ActivationCheckpointingFeature, PipelineFeature,
            LayerMajorFeature)
