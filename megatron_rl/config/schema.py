"""The typed configuration schema (omegaconf structured configs).

One dataclass per node.  Every field has a default and a one-line ``help`` in its metadata; the
config reference in ``docs/config.md`` is generated from these, so a key documented there always
exists here.  Parallel sizes live in :class:`ParallelConfig` only; the data-parallel size is
derived from the world size and never configured.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional


def _f(default: Any, help: str, **kw):  # noqa: A002 - "help" reads best in the schema
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class RunConfig:
    name: str = _f("megatron_rl", "Run name; the run directory is <dir>/<name>.")
    dir: str = _f("runs", "Parent directory of run directories.")
    seed: int = _f(1234, "Seed for weights, data order, sampling and dropout-free RNG streams.")


@dataclass
class ParallelConfig:
    tp: int = _f(1, "Tensor-parallel size.")
    pp: int = _f(1, "Pipeline-parallel size.")
    vpp: Optional[int] = _f(None, "Virtual pipeline stages per pipeline rank (interleaved 1F1B); null = off.")
    cp: int = _f(1, "Context-parallel size: each sequence is split over this many ranks (zigzag).")
    sequence_parallel: bool = _f(False, "Shard activations outside attention/MLP over the TP group (needs tp>1).")
    cp_comm_type: str = _f("p2p", "CP attention communication: p2p (ring), all_gather; with TE also a2a, a2a+p2p.")
    batch_p2p_comm: Optional[bool] = _f(
        None, "Batch pipeline send/recv; null = auto (off for PP=2 with VPP, where megatron-core is wrong)."
    )


@dataclass
class DistributedConfig:
    backend: str = _f("auto", "torch.distributed backend: auto (nccl on GPU, gloo on CPU), nccl, gloo.")
    timeout_s: int = _f(600, "Collective timeout; a hung or dead rank ends the job after this long.")
    nproc: int = _f(1, "Processes to start on this machine when not launched by torchrun or srun.")
    device: str = _f("auto", "auto (cuda if available), cuda, cpu.")


@dataclass
class RecomputeConfig:
    granularity: Optional[str] = _f(None, "Activation recompute: null, full, selective.")
    method: str = _f("uniform", "With full recompute: uniform or block.")
    num_layers: int = _f(1, "With full recompute: layers per recompute unit (uniform) or per stage (block).")
    modules: list = _f(["core_attn"], "With selective recompute: core_attn, mlp, layernorm, moe_act.")


@dataclass
class ModelConfig:
    hf_path: Optional[str] = _f(None, "Local Hugging Face model directory to import (config + safetensors).")
    num_layers: int = _f(2, "Transformer layers.")
    hidden_size: int = _f(64, "Hidden size.")
    ffn_hidden_size: int = _f(128, "MLP intermediate size.")
    num_attention_heads: int = _f(4, "Attention heads.")
    num_query_groups: Optional[int] = _f(None, "KV heads for GQA; null = num_attention_heads.")
    kv_channels: Optional[int] = _f(None, "Head dimension; null = hidden_size / num_attention_heads.")
    vocab_size: int = _f(128, "Vocabulary size (padded internally for TP; padding never reaches log-probs).")
    make_vocab_size_divisible_by: int = _f(128, "Pad the vocabulary to a multiple of this times tp.")
    max_position_embeddings: int = _f(4096, "Longest sequence the rotary embedding is built for.")
    normalization: str = _f("RMSNorm", "RMSNorm or LayerNorm.")
    norm_epsilon: float = _f(1e-6, "Norm epsilon.")
    activation: str = _f("swiglu", "MLP activation: swiglu, gelu.")
    add_bias_linear: bool = _f(False, "Biases in all linear layers.")
    add_qkv_bias: bool = _f(False, "Bias in the QKV projection only (Qwen2).")
    qk_layernorm: bool = _f(False, "RMSNorm on queries and keys per head (Qwen3).")
    tie_word_embeddings: bool = _f(False, "Share input embedding and output layer weights.")
    rotary_base: float = _f(10000.0, "RoPE theta.")
    rope_scaling_factor: Optional[float] = _f(None, "Llama-3 style RoPE scaling factor; null = off.")
    params_dtype: str = _f("auto", "Parameter dtype: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16.")
    transformer_impl: str = _f("auto", "Layer implementation: auto, transformer_engine, local.")
    init_method_std: float = _f(0.02, "Std of the random weight init (when no checkpoint is loaded).")
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)


@dataclass
class BatchConfig:
    max_tokens_per_rank: Optional[int] = _f(
        None, "Token budget per micro-batch per rank (dynamic batch size); null = fixed micro_batch_size."
    )
    micro_batch_size: int = _f(1, "Sequences per micro-batch when no token budget is set.")
    packing: bool = _f(True, "Pack sequences into one THD row (no padding waste); false = padded BSHD rows.")
    logprob_chunk_size: int = _f(1024, "Tokens per chunk of the vocab-parallel log-prob/entropy computation.")


@dataclass
class OptimConfig:
    lr: float = _f(1e-5, "Peak learning rate.")
    min_lr: float = _f(0.0, "Final learning rate of the cosine schedule.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_beta1: float = _f(0.9, "Adam beta1.")
    adam_beta2: float = _f(0.999, "Adam beta2.")
    adam_eps: float = _f(1e-8, "Adam epsilon.")
    clip_grad: float = _f(1.0, "Global gradient-norm clip; 0 = off.")
    warmup_steps: int = _f(0, "Linear warm-up steps.")
    schedule: str = _f("constant", "LR schedule after warm-up: constant, cosine.")
    use_distributed_optimizer: bool = _f(False, "Shard optimizer state over data-parallel ranks.")


@dataclass
class DataConfig:
    train_path: str = _f("task:digit_sum", "Prompt file (JSONL/Parquet) or a built-in task (task:digit_sum).")
    tokenizer: Optional[str] = _f(None, "'char', or a local HF tokenizer dir; null = model.hf_path, else 'char'.")
    max_prompt_tokens: int = _f(512, "Longer prompts are dropped (and counted in the log).")
    prompt_key: str = _f("prompt", "Record key of the prompt text.")
    answer_key: str = _f("answer", "Record key of the reference answer (for verifiable rewards).")
    messages_key: str = _f("messages", "Record key of chat messages (rendered with the chat template).")
    shuffle: bool = _f(True, "Shuffle prompts each epoch (seeded, resumable).")


@dataclass
class RolloutConfig:
    engine: str = _f("torch", "Generation engine: torch (KV-cache decoder on a full copy of the actor's weights on every rank) or tp_sharded (the same decoder on each rank's tensor-parallel shard: weights and KV cache / TP).")
    n: int = _f(4, "Samples per prompt (the group for GRPO/RLOO).")
    max_new_tokens: int = _f(64, "Longest response.")
    temperature: float = _f(1.0, "Sampling temperature (also used to recompute log-probs).")
    top_p: float = _f(1.0, "Nucleus sampling; 1 = off.")
    top_k: int = _f(0, "Top-k sampling; 0 = off.")
    stop: list = _f([], "Extra stop strings (EOS always stops).")
    max_batch_size: int = _f(64, "Sequences generated together.")


@dataclass
class RewardConfig:
    fn: str = _f("digit_sum", "Registered reward name or 'package.module:function'.")
    kwargs: dict = _f({}, "Keyword arguments passed to the reward function.")


@dataclass
class AlgorithmConfig:
    advantage: str = _f("gae", "Advantage estimator: gae (PPO with a critic), grpo, rloo.")
    gamma: float = _f(1.0, "GAE discount.")
    lam: float = _f(0.95, "GAE lambda.")
    whiten_advantages: bool = _f(True, "Whiten GAE advantages over the batch.")
    norm_by_std: bool = _f(True, "GRPO: divide by the group's std.")
    clip_low: float = _f(0.2, "PPO ratio clip below 1.")
    clip_high: float = _f(0.2, "PPO ratio clip above 1 (asymmetric clipping when != clip_low).")
    dual_clip: Optional[float] = _f(None, "Dual-clip bound for negative advantages (e.g. 3); null = off.")
    value_clip: Optional[float] = _f(0.2, "Critic value clipping around the old values; null = off.")
    loss_agg: str = _f("token-mean", "token-mean, seq-mean-token-sum, seq-mean-token-mean.")
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient.")
    kl_coef: float = _f(0.0, "KL(actor || reference) coefficient; 0 = no reference model.")
    kl_kind: str = _f("k3", "KL estimator: k1, k2, k3 (low_var_kl).")
    kl_in_reward: bool = _f(False, "Subtract the KL from the token rewards instead of adding it to the loss.")
    kl_controller: str = _f("fixed", "fixed or adaptive (in-reward KL only).")
    kl_target: Optional[float] = _f(None, "Adaptive controller target KL.")
    kl_horizon: Optional[float] = _f(None, "Adaptive controller horizon.")
    ppo_epochs: int = _f(1, "Passes over each rollout batch.")
    mini_batches: int = _f(1, "Optimizer steps per pass (the batch is cut into this many mini-batches).")


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    init_checkpoint: Optional[str] = _f(None, "megatron_rl checkpoint (step dir) to start from instead of model.hf_path.")


@dataclass
class CriticConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    hf_path: Optional[str] = _f(None, "Reward-model / value checkpoint for the critic; null = start from the actor's weights.")


@dataclass
class TrainerConfig:
    steps: int = _f(20, "PPO steps (rollout + update).")
    prompts_per_step: int = _f(16, "Prompts per step (each sampled rollout.n times).")
    sft_warmup_steps: int = _f(0, "Supervised steps on prompt+answer before RL (teaches a tiny model the format).")
    sft_lr: float = _f(1e-3, "Learning rate of the supervised warm-up.")
    sft_answers: str = _f("true", "Warm-up targets: true (the answers), shuffled (other prompts' answers: format only).")
    save_every: int = _f(0, "Checkpoint every N steps (0 = only at the end and on SIGTERM/SIGUSR1).")
    keep_last: int = _f(2, "Checkpoints kept.")
    resume: str = _f("auto", "auto (latest checkpoint in the run dir), never, or a checkpoint path.")
    log_every: int = _f(1, "Console progress every N steps.")
    plot: bool = _f(True, "Write plot.png (reward, KL, losses) at the end; needs matplotlib.")
    offload: bool = _f(False, "Keep models not used by the running phase (weights, grads, optimizer) in host memory.")
    tensorboard: bool = _f(False, "Also log to TensorBoard (<run_dir>/tb).")
    wandb: bool = _f(False, "Also log to Weights & Biases.")


@dataclass
class SmokeConfig:
    """The smoke job trains with actor.optim."""

    steps: int = _f(8, "Optimizer steps of the smoke job.")
    seq_length: int = _f(64, "Tokens per sequence.")
    micro_batch_size: int = _f(2, "Sequences per micro-batch.")
    num_microbatches: int = _f(4, "Micro-batches per step (per data-parallel rank).")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    smoke: SmokeConfig = field(default_factory=SmokeConfig)


def iter_fields(cls=Config, prefix: str = ""):
    """Yield ``(dotted_key, field, default)`` for every leaf of the schema."""
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            yield from iter_fields(type(default), key + ".")
        else:
            yield key, f, default
