"""DTensor's public names for the tests, on every supported torch: torch 2.4
has them only in the private ``torch.distributed._tensor`` (torch 2.5 made
``torch.distributed.tensor`` public)."""
try:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
except ImportError:  # torch 2.4
    from torch.distributed._tensor import (  # type: ignore[no-redef]
        DTensor,
        Replicate,
        Shard,
        distribute_tensor,
    )

__all__ = ["DTensor", "Replicate", "Shard", "distribute_tensor", "distribute_held"]


def distribute_held(full, mesh, placements):
    """``full`` laid out on ``mesh`` when every rank already holds all of it:
    no communication (torch's ``src_data_rank=None``, torch >= 2.5); on torch
    2.4, which lacks that argument, this rank's piece cut from ``full`` and
    wrapped with ``DTensor.from_local``."""
    import inspect

    placements = list(placements)
    if "src_data_rank" in inspect.signature(distribute_tensor).parameters:
        return distribute_tensor(full, mesh, placements, src_data_rank=None)
    from torch.distributed._tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    if len(offset) < full.dim():  # a rank outside the mesh holds nothing
        shape, offset = (0,) * full.dim(), (0,) * full.dim()
    piece = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
    return DTensor.from_local(piece.contiguous(), mesh, placements, run_check=False,
                              shape=full.shape, stride=full.stride())
