"""The layers of ``prepfuse.models.reference_clients``, one module per source project: each
source's attention-input preparation, cache write, SDPA over the step's tokens and output
projection, one model class per source family (``prepfuse.models.reference_clients``' docstring
says what each spelling is). ``common`` holds what several modules share.

Names, ops, casts and layouts follow the source's own code; where a line is not from the
source (a cache where it has none, a host-side table rebuild done once up front) a comment
says so. Every model takes ``(x, step, caches)``: ``step`` a dict of the step's metadata in
the source's own form (Python-int offsets, positions, slots, block tables), ``caches`` the
source's cache tensors; its output is ``x`` plus each layer's attention output.
"""

from __future__ import annotations

from prepfuse.models.references.common import FP8, Sizes
from prepfuse.models.references.flash_attn import FlashAttn
from prepfuse.models.references.gemma_pytorch import Gemma
from prepfuse.models.references.lightllm import Lightllm
from prepfuse.models.references.litgpt import LitGPT
from prepfuse.models.references.lmdeploy import Lmdeploy
from prepfuse.models.references.megatron import Megatron
from prepfuse.models.references.meta import MetaLlama
from prepfuse.models.references.mistral import Mistral
from prepfuse.models.references.tgi import Tgi
from prepfuse.models.references.torchtitan import Torchtitan
from prepfuse.models.references.trtllm import TensorRTLLM

__all__ = ["FP8", "MODELS", "Sizes"]

MODELS = {
    "meta-llama": MetaLlama, "mistral": Mistral, "torchtitan": Torchtitan, "litgpt": LitGPT, "gemma": Gemma,
    "lmdeploy": Lmdeploy, "tgi": Tgi, "flash-attn": FlashAttn, "megatron": Megatron, "trtllm": TensorRTLLM,
    "lightllm": Lightllm,
}
