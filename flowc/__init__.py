"""flowc: an ahead-of-time compiler from ONNX (and a small DSL) to standalone CUDA C++."""

__version__ = "0.1.0"
