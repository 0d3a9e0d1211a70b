"""Export: `export_bundle` (pipeline.py, what mtp-export runs), one module per platform
(executorch, onnx, coreml: the rows of mtp_edge/platforms.py), what an export is asked and what
a platform module gets (platform.py), the loading that the exporting process and the child that
lowers share (loading.py, lowering_parent.py, lowering_child.py), and the bundle writer."""
