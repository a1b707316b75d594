"""The GPT model used for actor, reference and critic.

megatron-core's ``GPTModel`` ends in the output layer (and optionally a cross-entropy loss).  RL
needs other heads -- chunked vocab-parallel log-probs and entropy for the actor and reference, a
value head for the critic -- so this subclass returns the final hidden states (after the final
norm) from the last pipeline stage and lets the caller apply the head.  Everything else
(embeddings, decoder, pipeline stages, checkpoint layout) is megatron-core's.

Relies on ``GPTModel._postprocess`` (megatron-core 0.19.2: ``gpt_model.py`` ``forward`` ends in
``return self._postprocess(...)``), checked by the model tests.  Why GPTModel and not 0.19's
``HybridModel``: docs/architecture.md.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel


class RLGPTModel(GPTModel):
    def _postprocess(self, hidden_states, *args, **kwargs):
        if self.mtp_process:
            raise NotImplementedError("multi-token prediction heads are not supported")
        return hidden_states

    def output_weight(self) -> torch.Tensor:
        """This rank's ``[vocab/TP, hidden]`` output projection (tied or not)."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.output_layer.weight
