"""Deployment: ONNX export, FP16, INT8 calibration and TensorRT engines (DESIGN.md section 6)."""
