"""The one dim-0 row rule equals torch's: ``torch.chunk``'s split, which ``Shard(0)`` and FSDP2 use."""

import torch

from ray_hsdp.sharding.layout import rows_of, rows_per_rank


def test_each_rank_holds_the_rows_torch_chunk_gives_it():
    for rows in (1, 2, 5, 7, 8, 13, 64):
        for world in (1, 2, 3, 4, 8):
            chunks = torch.arange(rows).chunk(world)  # fewer chunks than ranks: the last ranks hold none
            for index in range(world):
                expected = chunks[index].tolist() if index < len(chunks) else []
                assert list(range(rows))[rows_of(rows, world, index)] == expected, (rows, world, index)
            assert rows_per_rank(rows, world) == len(chunks[0])
