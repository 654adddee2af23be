"""The memory live before a trace's first entry (window.py), put into the simulator.

Each segment comes back at its address with its live blocks where they were; the gaps between
them are cached free blocks, one per gap, since c10 merges free neighbours (`free_block` ->
`try_merge_blocks`). Blocks in no segment that can be rebuilt are allocated in address order.
"""

from __future__ import annotations

import dataclasses

from llamem.allocator.config import AllocatorConfig
from llamem.allocator.simulator import SMALL_SIZE, Block, CachingAllocatorSim
from llamem.allocator.window import StartBlock, StartSegment, StartState
from llamem.units import format_bytes


def restore_start(sim: CachingAllocatorSim, start: StartState, warnings: list[str]) -> dict[int, Block]:
    """Live blocks by their trace address. Raises SimulatedOOM when the loose blocks do not fit."""
    live: dict[int, Block] = {}
    loose = list(start.loose)
    for segment in start.segments:
        pieces = segment_pieces(sim, segment)
        if pieces is None:
            warnings.append(f"the blocks of the segment at {segment.address:#x} overlap or overrun it: "
                            "they are allocated first instead")
            loose.extend(segment.blocks)
            continue
        blocks = sim.restore_segment(segment.stream, segment.small, pieces)
        live.update(zip((p[0] for p in pieces if p[2] is not None), blocks))
    if sim.total_allocated > sim.capacity:
        warnings.append(f"the memory reserved before the trace's first entry ({format_bytes(sim.total_allocated)}) "
                        f"is more than the capacity ({format_bytes(sim.capacity)})")
    for block in sorted(loose, key=lambda b: b.address):
        live[block.address] = sim.malloc(block.requested_size, block.stream)
    return live


def resolve_start(start: StartState, config: AllocatorConfig | None = None) -> StartState:
    """The same state with the sizes the snapshot does not show inferred under `config` (the
    settings the trace was recorded with), so that every replay of it, under any setting, starts
    from one layout."""
    sim = CachingAllocatorSim(config)
    segments = []
    for segment in start.segments:
        pieces = segment_pieces(sim, segment)
        if pieces is not None:
            sizes = {address: size for address, size, requested in pieces if requested is not None}
            segment = dataclasses.replace(segment, blocks=tuple(
                dataclasses.replace(b, size=sizes[b.address]) for b in segment.blocks))
        segments.append(segment)
    return dataclasses.replace(start, segments=tuple(segments))


def segment_pieces(sim: CachingAllocatorSim, segment: StartSegment) -> list[tuple[int, int, int | None]] | None:
    """(address, bytes, requested or None when free) in address order, or None if the blocks do not fit."""
    pieces: list[tuple[int, int, int | None]] = []
    cursor = segment.address
    blocks = sorted(segment.blocks, key=lambda b: b.address)
    for n, block in enumerate(blocks):
        limit = blocks[n + 1].address if n + 1 < len(blocks) else segment.end
        size = block.size or _inferred_size(sim, segment, block, limit)
        if block.address < cursor or size < block.requested_size or block.address + size > limit:
            return None
        if block.address > cursor:
            pieces.append((cursor, block.address - cursor, None))
        pieces.append((block.address, size, block.requested_size))
        cursor = block.address + size
    if cursor < segment.end:
        pieces.append((cursor, segment.end - cursor, None))
    return pieces


def _inferred_size(sim: CachingAllocatorSim, segment: StartSegment, block: StartBlock, limit: int) -> int:
    """A block known only from its free: the rounded request, or the whole gap up to the next live
    block when c10 would not have split the rest off (`should_split`): a block of at least
    max_split_size is never split, and a large-pool remainder of at most 1 MiB stays with the block
    (so every free large-pool block is larger than 1 MiB). What cannot be told: a remainder of at
    most 1 MiB that stayed with the block while the block after it was freed later."""
    room = limit - block.address
    size = min(sim.round_size(block.requested_size), room)
    if not segment.small and (size >= sim.max_split or 0 < room - size <= SMALL_SIZE):
        return room
    return size
