"""The target's hidden states at named layers, for draft heads that read more than the last one (EAGLE-3).

A session's draft head names the layers it reads (``feature_layers``, sent with the session's Prefill): layer
``k`` is the residual stream entering decoder layer ``k`` (0: the token embeddings), which is what vLLM's
``eagle_aux_hidden_state_layer_ids`` name and what transformers returns as ``hidden_states[k]`` for
``k`` below the layer count. No layers named: the final hidden state after the model's norm, as before, on a
path this module never touches, so the single-feature step stays as cheap as it was.

A step keeps the named layers' rows only for the rows a session asked features for (``LayerCapture``): one
[rows, hidden] copy per layer, taken as the forward passes it. Each session then gets its own layers in its
own order, concatenated per row ([rows, layers * hidden]), the input an EAGLE-3 head's ``fc`` reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def check_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """``layers`` as a tuple; ValueError naming the bad id when one is not a decoder layer of this target."""
    for layer in layers:
        if not 0 <= layer < num_layers:
            raise ValueError(
                f"feature layer {layer} is not one of this target's decoder layers (0 to {num_layers - 1}): "
                "the draft head was made for another target"
            )
    return tuple(int(layer) for layer in layers)


@dataclass
class LayerCapture:
    """What a step keeps of the residual stream entering each of ``layers``, at ``rows`` of the step."""

    layers: tuple[int, ...]  # sorted, distinct
    rows: torch.Tensor  # [n] step rows whose layer states are read back
    kept: dict[int, torch.Tensor] = field(default_factory=dict)

    def offer(self, index: int, x: torch.Tensor) -> None:
        """The forward's hidden states [T, hidden] entering layer ``index``: kept (its rows) if named."""
        if index in self.layers:
            self.kept[index] = x.index_select(0, self.rows).float()

    def stacked(self) -> torch.Tensor:
        """[n, len(layers), hidden] float32, the layers in ``layers`` order."""
        return torch.stack([self.kept[layer] for layer in self.layers], dim=1)


def union_of(wanted: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """Every layer some session of a step names, sorted."""
    return tuple(sorted({layer for layers in wanted for layer in layers}))


def session_rows(stacked: torch.Tensor, union: tuple[int, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """A session's rows of ``stacked`` [n, len(union), hidden] as [n, len(layers) * hidden]: its layers
    concatenated in its own order."""
    picked = stacked[:, [union.index(layer) for layer in layers]]
    return picked.reshape(stacked.shape[0], -1)
