"""What a training run of a draft head is given (``TrainSettings``) and what it reports (``TrainReport``), for both
head formats and the loop they share (``loop.optimise``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainSettings:
    draft_vocab_size: int = 8192
    intermediate_size: int = 0  # 0: the target's
    window: int = 384  # positions per training example (longer sequences are cut)
    batch_size: int = 8
    learning_rate: float = 5e-4
    weight_decay: float = 0.0
    ce_weight: float = 0.1
    feature_noise: float = 0.05
    epochs: int = 24
    # Training-time test (EAGLE-3, HASS): the head also learns from its own predicted features, as it drafts.
    unroll_steps: int = 1  # 1: teacher-forced only (EAGLE-1); k: k draft steps per position
    max_minutes: float = 30.0
    # The head's matmuls in bfloat16 (torch.autocast), weights and optimiser state in fp32, for CPUs that run
    # bf16 natively (AMX, AVX512-BF16); losses and accuracy are computed in fp32.
    autocast_bf16: bool = False
    checkpoint_every: int = 100
    seed: int = 0
    # A head file to start from (its weights and draft vocabulary) instead of a fresh head: more epochs for a
    # head whose run stopped at its time budget. "" starts afresh.
    init_from: str = ""


@dataclass
class TrainReport:
    steps: int
    epochs_done: float
    minutes: float
    final_loss: float
    final_feature_loss: float
    final_token_accuracy: float  # training batches, teacher-forced, depth 1
    final_accuracy_by_step: list[float]  # training batches, each unrolled draft step
    resumed_from_step: int
