"""Storage: atomic publishing, the streaming writer and the validating reader."""

from jckpt.storage.publish import StagingFile, reclaim_staging
from jckpt.storage.reader import COUNTS, CheckpointReader, open_checkpoint
from jckpt.storage.writer import ArraySource, CopySource, write_checkpoint

__all__ = ['COUNTS', 'ArraySource', 'CheckpointReader', 'CopySource', 'StagingFile',
           'open_checkpoint', 'reclaim_staging', 'write_checkpoint']
