"""Mixture of experts on megatron-core: the config mapping, our router, and routing replay.

megatron-core brings the MoE layer itself -- router, token dispatchers (alltoall, allgather),
experts (``SequentialMLP`` on the local spec, TransformerEngine's grouped GEMM on the TE spec),
shared experts, expert parallelism -- and all of it runs on CPU with gloo.  This module adds what
RL needs around it, in :class:`RLTopKRouter`, a ``TopKRouter`` swapped in through the layer spec:

* **Losses normalised like the policy loss.**  megatron's own load-balancing and z-losses assume
  its loss scaling (a count returned by the loss function, divided in ``finalize_model_grads``);
  ours divides every loss on the host by the mini-batch's token count (``engine/forward.py``), so
  megatron's are switched off and the router computes them itself: the load-balancing loss per
  micro-batch (``aux_loss``) or per sequence (``seq_aux_loss``), and the z-loss, over real tokens
  (padding excluded), weighted by tokens and divided by the tokens of the whole forward pass
  (:func:`moe_pass`).  They are always measured (``actor/moe_aux_loss``, ``actor/moe_z_loss``);
  they reach the gradient only with ``model.moe.aux_loss_coeff`` / ``z_loss_coeff`` > 0.
* **Routing replay.**  While the rollout engine (``rollout.engine=megatron``) generates, each
  router stores the experts it picked for every token it routes, keyed by (sample, position)
  (:func:`moe_rollout`); the recordings travel with the samples (:func:`gather_rollout_routing`) and
  are loaded before the step's forwards (:func:`load_routing`).  A recording pass over the finished
  samples (the old-log-prob forward) does the same where no engine recorded them.  The keys do not
  depend on how the batch was cut or laid out; a store is exchanged over the TP x DP x CP ranks of
  each pipeline stage.  A replaying pass routes every real token to its recorded experts (the
  routing weights are recomputed from the current logits at those experts, as megatron's
  ``RouterReplay`` does) and counts the tokens whose own top-k differs
  (``actor/routing_replay_mismatch``).  With full activation recompute the routers remember what
  they used in the forward and use it again when backward recomputes the layer.

The router hooks megatron-core 0.19.2 in two places: ``MoESubmodules.router`` (the router class a
spec builds) and the ``router_replay`` object ``topk_routing_with_score_function`` asks for its
top-k (:class:`_TopK`, the interface of megatron's own ``RouterReplay``, whose instances are
process-global).  Which tokens a router call sees comes from the micro-batch: ``engine/forward.py``
calls each chunk's ``microbatch_hooks`` before its forward.  The statistics stay on the device
until :func:`moe_metrics` reads them; only the recording pass copies routing to the host (one copy
per MoE layer and micro-batch).

One module per concern: :mod:`.config`, :mod:`.tokens`, :mod:`.state`, :mod:`.router`.
"""

from __future__ import annotations

from megatron_rl.models.moe.config import (  # noqa: F401
    ROUTER_DTYPES,
    moe_transformer_kwargs,
    router_class,
)
from megatron_rl.models.moe.router import (  # noqa: F401
    DEFAULT_LOSSES,
    STATS,
    LossSettings,
    RLTopKRouter,
    _TopK,
)
from megatron_rl.models.moe.state import (  # noqa: F401
    MoEState,
    attach_moe_state,
    gather_rollout_routing,
    load_routing,
    moe_metrics,
    moe_pass,
    moe_rollout,
    moe_state,
)
from megatron_rl.models.moe.tokens import (  # noqa: F401
    TokenMap,
    inference_token_map,
    map_for_count,
    token_map,
)
