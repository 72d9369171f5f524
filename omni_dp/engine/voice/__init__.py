"""Piper-format voices (a VITS ONNX graph + its JSON config) as stages of the built-in engine.

Two stages: `preprocess` (text → sentences → espeak-ng phonemes → the voice's phoneme ids, on
the CPU) and `voice` (phoneme ids → waveform, one sentence at a time, with onnxruntime: its CUDA
execution provider on a GPU, the CPU one otherwise). Phonemes come from the `espeak-ng` program
run as a separate process: nothing GPL-licensed is imported into this Apache-2.0 package
(docs/voice.md).
"""
