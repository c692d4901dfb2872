"""Deployment: ONNX export, FP16, INT8 calibration and TensorRT engines (docs/ARCHITECTURE.md)."""
