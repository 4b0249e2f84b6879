"""routetool: profile and validate MoE top-k router kernels on captured gating traces."""

__version__ = "0.1.0"
