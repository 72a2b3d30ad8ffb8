"""Object storage: a store over local folders, S3 and MinIO, and the batch, metrics and
checkpoint stores on top of it, one module each (`object_store`, `batch_store`,
`metrics_log`, `checkpoint_store`; `layout` names a run folder's keys).

The supported URL schemes are listed in `ratchet/catalog/storage_schemes.py`: that is where a
backend is added. This package's `__init__` imports nothing, so a torch-free module of it
(`layout`, `keys`, `schemes`) loads neither torch (batch_store) nor fsspec and the S3 clients:
import each name from the module that defines it.
"""
