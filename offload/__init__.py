"""Run models larger than memory: component offload, block streaming with prefetch, a disk tier.

A leaf package (it imports neither ``dit_core`` nor ``serve``): the engine composes it
through ``dit_core.offloading``. Tiers: the *device* (where compute runs), *host* memory
(pinned on CUDA) and *disk* (safetensors files read per block). See ``policy`` for the
policies and ``streamer`` for how blocks stream.
"""

from .components import ComponentOffloader, ComponentStats
from .errors import OffloadConfigError, OffloadError, WeightFileError
from .heap import check_threshold
from .reuse import check_choice as check_cpu_allocator
from .lazy import block_prefixes, find_blocks, load_without_blocks
from .mapped import MappedSource
from .policy import OffloadPolicy, blocks_for_budget, check_budget
from .safetensors_file import TensorEntry, index_folder, read_header, read_into
from .sources import DiskSource, HostSource
from .streamer import BlockStreamer, StreamStats

__all__ = [
    "BlockStreamer", "ComponentOffloader", "ComponentStats", "DiskSource", "HostSource", "MappedSource", "OffloadConfigError",
    "OffloadError", "OffloadPolicy", "StreamStats", "TensorEntry", "WeightFileError", "block_prefixes",
    "blocks_for_budget", "check_budget", "check_cpu_allocator", "check_threshold", "find_blocks", "index_folder", "load_without_blocks", "read_header",
    "read_into",
]
