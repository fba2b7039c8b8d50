"""Plain ``torch.nn.Module`` backbones (no buffers, GroupNorm instead of BatchNorm) used by the reimplemented papers.

Pick one in a config with, for example::

    model:
      backbone:
        class_path: pl_fedsparse.models.LeNetCIFAR
        init_args: {num_classes: 10}
"""

from pl_fedsparse.models.cnn import MLP, CNNFEMNIST, LeNetCIFAR, McMahanCNN
from pl_fedsparse.models.mixture import Mixture
from pl_fedsparse.models.resnet import ResNet18GN
from pl_fedsparse.models.vgg import VGG11GN

__all__ = ["LeNetCIFAR", "CNNFEMNIST", "McMahanCNN", "MLP", "VGG11GN", "ResNet18GN", "Mixture"]
