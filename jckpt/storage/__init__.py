"""Storage: bytes on media, behind a backend (local files, or objects in a store by URL).

Atomic publishing (`publish`), the streaming writer and
in-place region writes (`writer`,
`regions`), the validating reader and lazy reads
(`reader`, `lazy`), the directory form
(`directory`), writer leases (`lease`),
the backend seam (`backend`), and one
`open_checkpoint` for a file or a directory. Nothing here imports JAX.
"""

from jckpt.storage.backend import LOCAL, Backend, LocalBackend, backend_for
from jckpt.storage.checkpoint import open_checkpoint
from jckpt.storage.directory import DirectoryReader
from jckpt.storage.object_store import configure
from jckpt.storage.publish import StagingFile, reclaim_staging
from jckpt.storage.reader import COUNTS, CheckpointReader
from jckpt.storage.writer import ArraySource, CopySource, write_checkpoint

__all__ = ['COUNTS', 'LOCAL', 'ArraySource', 'Backend', 'CheckpointReader', 'CopySource',
           'DirectoryReader', 'LocalBackend', 'StagingFile', 'backend_for', 'configure', 'open_checkpoint',
           'reclaim_staging', 'write_checkpoint']
