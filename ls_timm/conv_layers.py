"""The convolution layers of CvT*-LS's projections: CvT's depthwise conv + BatchNorm ("dw_bn") for queries, keys and
values, and the weight-standardised conv before the dynamic projection (Appendix E); both fold into a plain conv for
inference (``timm.utils.reparameterize_model``)."""

import torch
from torch import Tensor, nn

__all__ = ["ConvBn", "StdConv2d"]


def _plain_conv(conv: nn.Conv2d, weight: Tensor, bias: Tensor | None) -> nn.Conv2d:
    """An ``nn.Conv2d`` with ``conv``'s geometry holding ``weight`` and ``bias`` (a fused conv)."""
    fused = nn.Conv2d(
        conv.in_channels,
        conv.out_channels,
        conv.kernel_size,
        conv.stride,
        conv.padding,
        conv.dilation,
        conv.groups,
        bias is not None,
        conv.padding_mode,
        device=weight.device,
        dtype=weight.dtype,
    )
    with torch.no_grad():
        fused.weight.copy_(weight)
        if bias is not None:
            fused.bias.copy_(bias)
    return fused


class StdConv2d(nn.Conv2d):
    """Conv2d with weight standardisation (Qiao et al., arXiv:1903.10520): each filter is normalised to zero mean,
    unit variance before use (CvT*-LS's dynamic projection, Appendix E). Closed form: ``F.batch_norm`` on the
    weights is orders of magnitude slower on CPU for depthwise filters."""

    def __init__(self, *args, eps: float = 1e-5, **kwargs):
        super().__init__(*args, **kwargs)
        self.eps = eps

    def standardized_weight(self) -> Tensor:
        w = self.weight
        return (w - w.mean((1, 2, 3), keepdim=True)) * torch.rsqrt(
            w.var((1, 2, 3), unbiased=False, keepdim=True) + self.eps
        )

    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, self.standardized_weight(), self.bias)

    def fuse(self) -> nn.Conv2d:
        """A plain conv with the standardised weights, for inference (``timm.utils.reparameterize_model``)."""
        return _plain_conv(self, self.standardized_weight(), self.bias)


class ConvBn(nn.Sequential):
    """Depthwise conv then BatchNorm (CvT's "dw_bn" projection). In eval mode the BatchNorm's affine map is folded
    into the conv weights and bias: one pass over the map instead of two, same result."""

    def folded(self) -> tuple[Tensor, Tensor]:
        """The conv weight and bias with the BatchNorm's running statistics and affine map folded in."""
        conv, bn = self
        scale = bn.weight * torch.rsqrt(bn.running_var + bn.eps)
        return conv.weight * scale.view(-1, 1, 1, 1), bn.bias - bn.running_mean * scale

    def forward(self, x: Tensor) -> Tensor:
        conv, bn = self
        return bn(conv(x)) if self.training else conv._conv_forward(x, *self.folded())

    def fuse(self) -> nn.Conv2d:
        """The eval-mode conv, folded once, for inference (``timm.utils.reparameterize_model``): no per-call fold."""
        return _plain_conv(self[0], *self.folded())
