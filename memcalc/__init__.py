"""memcalc: per-GPU memory, communication and step time of distributed transformer training."""

__version__ = "0.1.0"
