"""Datasets: the file formats ratchet reads (`files.py`), how a prompt becomes token ids
(`prompt_format.py`) and the order prompts are drawn in (`order.py`).

Imports nothing else of ratchet, and pyarrow and transformers only inside functions, so the
config layer (the submit-time check, config/dataset_check.py) and the workers
(workers/prompts.py) read a dataset with the same code without the config importing torch.
"""
