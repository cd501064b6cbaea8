"""Model converters (`model.converters`): modules swapped on the built model before any parallelism is applied,
on the path the trainer and the memory estimator share (torchtitan/components/model_parts.py)."""
