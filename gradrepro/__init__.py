"""gradrepro: rerunnable, checkable reproductions of gradient-signal failures in PyTorch."""

__version__ = "0.1.0"
