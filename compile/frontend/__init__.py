"""ONNX in: the importer (ONNX -> Relax), the op converters blockforge adds or fixes, and
the model preparation (binding, folding, size checks) before import."""
