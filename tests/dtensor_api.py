"""DTensor's public names for the tests, on every supported torch: torch 2.4
has them only in the private ``torch.distributed._tensor`` (torch 2.5 made
``torch.distributed.tensor`` public)."""
try:
    from dtensor_api import DTensor, Replicate, Shard, distribute_tensor
except ImportError:  # torch 2.4
    from torch.distributed._tensor import (  # type: ignore[no-redef]
        DTensor,
        Replicate,
        Shard,
        distribute_tensor,
    )

__all__ = ["DTensor", "Replicate", "Shard", "distribute_tensor"]
