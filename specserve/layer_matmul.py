"""The decoder layers' linear products, in whichever of two equal forms is faster for few rows here.

``specserve.head_matmul`` found that on an AVX2-only AMD EPYC (fp32, the MKL that torch 2.13 ships)
``F.linear`` at 2-8 rows costs far more than one row, and ``(W @ x.T).T`` does not. The same holds for the
decoder layers' projections, which carry most of a forward's weights: with SmolLM2-135M's 30 layers
streamed from memory, one row costs about 2.1 ms a layer in either form, 2-4 rows about 2.9-3.5 ms in
``F.linear`` and 1.4-1.5 ms in ``(W @ x.T).T``. That is what made one draft node cost 1.4x a plain forward
on such a CPU, and the verifier's trees small.

``install_layer_matmul`` swaps every ``nn.Linear`` under a module for a ``FormedLinear`` over the same
parameters; all of them share one ``LayerMatmul``, whose row counts are chosen by timing every linear of
the model in turn in both forms (``head_matmul.time_forms``). One row (plain decoding) always uses
``F.linear``, so its numbers do not change. Both forms take the same dot products over the same weights:
only the summation order inside a dot product may differ, as it already does between batch sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from specserve.head_matmul import FORMS, describe_rows, faster_rows, head_product, time_forms


@dataclass
class LayerMatmul:
    """The row counts (of ``head_matmul.ROW_COUNTS``) whose layer products use ``(W @ x.T).T``; shared, mutable."""

    transposed_rows: frozenset[int] = field(default_factory=frozenset)

    def describe(self) -> str:
        return describe_rows(self.transposed_rows)


class FormedLinear(nn.Module):
    """An ``nn.Linear``'s weight and bias, multiplied in the form its shared ``LayerMatmul`` picks for the rows."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int

    def __init__(self, linear: nn.Linear | FormedLinear, forms: LayerMatmul) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.forms = forms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return head_product(x, self.weight, self.forms.transposed_rows, self.bias)


def install_layer_matmul(root: nn.Module, form: str) -> LayerMatmul:
    """Route every ``nn.Linear`` under ``root`` through one ``LayerMatmul``; 'auto' times both forms here.

    The parameters stay the same objects under the same names, so state dicts and ``.to()`` are unaffected.
    'linear' keeps ``F.linear`` everywhere, as GPUs do. A model holds one choice: installing again (a second
    verifier over the same model, as the benchmarks build) makes the new choice, in the same ``LayerMatmul``.
    """
    if form not in FORMS:
        raise ValueError(f"layer matmul form {form!r}: choose one of {', '.join(FORMS)}")
    installed = [m.forms for m in root.modules() if isinstance(m, FormedLinear)]
    forms = installed[0] if installed else LayerMatmul()
    weights: list[torch.Tensor] = []
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            # Plain nn.Linear only: a subclass may compute something else.
            if isinstance(child, FormedLinear) or type(child) is nn.Linear:
                if not isinstance(child, FormedLinear) or child.forms is not forms:
                    setattr(parent, name, FormedLinear(child, forms))
                weights.append(child.weight.detach())
    forms.transposed_rows = frozenset()  # F.linear while timing and where 'linear' is asked
    if form == "auto" and weights and weights[0].device.type == "cpu":
        forms.transposed_rows = faster_rows(time_forms(weights))
    return forms
