"""The CUDA caching allocator of PyTorch (c10/cuda/CUDACachingAllocator.cpp), simulated.

Follows `DeviceCachingAllocator::malloc/free/emptyCache` rule by rule:

- sizes round up to 512 bytes (or to 1/N steps of their power-of-two bucket with
  `roundup_power2_divisions`); requests of at most 1 MiB use the small pool and 2 MiB
  segments, up to 10 MiB a 20 MiB segment, larger ones a segment rounded to 2 MiB;
- best fit: the smallest cached block of the same pool and stream that is large enough,
  lowest address on ties, refusing oversize blocks (>= max_split_size) for smaller
  requests and any block more than `max_non_split_rounding_mb` too large for oversize ones;
- a found block is split when the rest is >= 512 bytes (small pool, expandable segments)
  or > 1 MiB (large pool, below max_split_size); frees coalesce with free neighbours in
  the same segment; segments never merge;
- when no cached block fits: garbage collection (only with a memory fraction and a
  threshold), a new segment, then freeing oversize cached blocks, then freeing every
  unsplit cached segment and retrying (`num_alloc_retries`), then the OOM error with
  torch's message;
- `expandable_segments:True`: one virtual segment per pool and stream, mapped and unmapped
  in 2 MiB (small) or 20 MiB (large) pages.

Not simulated: CUDA graph private pools and MemPools, cross-stream frees (`record_stream`
events: frees complete when the trace says `free_completed`); `backend:cudaMallocAsync` is
refused (check_simulated).
"""

from __future__ import annotations

from bisect import bisect_left, insort

from llamem.allocator.config import LARGE_BUFFER, SIZE_MAX, AllocatorConfig, AllocatorConfigError
from llamem.errors import EXIT_DOES_NOT_FIT, LlamemError
from llamem.units import GiB, KiB, MiB, TiB

# c10/cuda/CUDACachingAllocator.cpp (kMinBlockSize, kSmallSize, kSmallBuffer, kMinLargeAlloc, kRoundLarge)
MIN_BLOCK = 512
SMALL_SIZE = 1 * MiB
SMALL_BUFFER = 2 * MiB
MIN_LARGE_ALLOC = 10 * MiB
ROUND_LARGE = 2 * MiB
UNKNOWN_DEVICE_SPAN = 1 * TiB
"""Address space of an expandable segment when the device's total memory is not known: more than
1.125 x the memory of any card made, so that the segment never fills up before the card would."""
STAT_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
              "active_bytes", "inactive_split_bytes", "requested_bytes")
POOL_TYPES = ("all", "small_pool", "large_pool")


def check_simulated(config: AllocatorConfig) -> None:
    """Refuse a backend the simulator would only pretend to model.

    With `backend:cudaMallocAsync` torch hands every allocation to the CUDA driver's stream-ordered
    pool (c10/cuda/CUDAMallocAsyncAllocator.cpp): pooling, splitting and release follow the driver's
    policy, which NVIDIA does not publish, and none of the native allocator's rules apply."""
    if config.backend != "native":
        raise AllocatorConfigError(
            f"backend:{config.backend} cannot be simulated: llamem models PyTorch's native caching allocator, "
            f"and {config.backend} hands memory pooling to the GPU driver, whose policy is not public. "
            f"Drop backend:{config.backend} from the allocator settings (or write backend:native) to simulate "
            "the native allocator.")


class SimulatedOOM(LlamemError):
    """The allocation that would raise torch.OutOfMemoryError, with the message torch would print."""

    exit_code = EXIT_DOES_NOT_FIT

    def __init__(self, message: str, size: int, alloc_size: int):
        self.size = size
        self.alloc_size = alloc_size
        super().__init__(message)


def format_size(size: int) -> str:
    """c10's format_size: bytes, KiB, MiB or GiB with two decimals."""
    if size <= KiB:
        return f"{size} bytes"
    if size <= MiB:
        return f"{size / KiB:.2f} KiB"
    if size <= GiB:
        return f"{size / MiB:.2f} MiB"
    return f"{size / GiB:.2f} GiB"


class Stat:
    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def increase(self, amount: int) -> None:
        self.current += amount
        self.allocated += amount
        if self.current > self.peak:
            self.peak = self.current

    def decrease(self, amount: int) -> None:
        self.current -= amount
        self.freed += amount


class Block:
    __slots__ = ("ptr", "size", "requested", "allocated", "prev", "next", "pool", "stream", "segment", "mapped",
                 "gc_base")

    def __init__(self, ptr: int, size: int, pool: "Pool", stream: int, segment=None):
        self.ptr, self.size, self.pool, self.stream, self.segment = ptr, size, pool, stream, segment
        self.requested = 0
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None
        self.mapped = True
        self.gc_base = 0

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def key(self) -> tuple[int, int, int]:
        return self.stream, self.size, self.ptr


class Pool:
    """Cached free blocks of one pool, ordered as c10's BlockComparator: (stream, size, address)."""

    __slots__ = ("small", "keys", "blocks", "unmapped", "free_calls")

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[tuple[int, int, int]] = []
        self.blocks: dict[tuple[int, int, int], Block] = {}
        self.unmapped: list[Block] = []  # expandable segments' unmapped ranges
        self.free_calls = 0  # get_free_block calls, the clock of garbage collection

    def insert(self, block: Block) -> None:
        key = (block.stream, block.size, block.ptr)
        insort(self.keys, key)
        self.blocks[key] = block
        block.gc_base = self.free_calls

    def remove(self, block: Block) -> None:
        key = (block.stream, block.size, block.ptr)
        del self.keys[bisect_left(self.keys, key)]
        del self.blocks[key]

    def lower_bound(self, stream: int, size: int) -> int:
        return bisect_left(self.keys, (stream, size, -1))

    def __contains__(self, block: Block) -> bool:
        return (block.stream, block.size, block.ptr) in self.blocks


class ExpandableSegment:
    """A virtual address range mapped in pages as needed (`expandable_segments:True`)."""

    __slots__ = ("base", "size", "page")

    def __init__(self, base: int, size: int, page: int):
        self.base, self.size, self.page = base, size, page


class CachingAllocatorSim:
    """One device's caching allocator. Sizes in bytes; `capacity_bytes` is what cudaMalloc can
    still get for this process (the card minus the CUDA context and other processes)."""

    def __init__(self, config: AllocatorConfig | None = None, *, capacity_bytes: int | None = None,
                 device_total_bytes: int | None = None, record_trace: bool = False):
        self.config = config or AllocatorConfig()
        check_simulated(self.config)
        self.capacity = capacity_bytes if capacity_bytes is not None else SIZE_MAX
        self.device_total = device_total_bytes or (capacity_bytes if capacity_bytes is not None else 0)
        self.small = Pool(True)
        self.large = Pool(False)
        self.stats = {name: (Stat(), Stat(), Stat()) for name in STAT_NAMES}
        self.oversize_allocations = Stat()
        self.oversize_segments = Stat()
        self.num_alloc_retries = self.num_ooms = self.num_device_alloc = self.num_device_free = 0
        self.num_sync_all_streams = 0
        self.total_allocated = 0  # reserved bytes, c10's total_allocated_memory
        self.allowed_maximum = SIZE_MAX
        self.set_fraction = False
        self.next_address = 1 << 40
        self.active: set[Block] = set()
        self.expandable: list[ExpandableSegment] = []
        self.record = record_trace
        self.trace: list[dict] = []
        self.max_split = self.config.max_split_size_bytes
        if self.config.per_process_memory_fraction is not None:
            self.set_memory_fraction(self.config.per_process_memory_fraction)

    # Rounding ---------------------------------------------------------------------------
    def round_size(self, size: int) -> int:
        if size < MIN_BLOCK:
            return MIN_BLOCK
        divisions = self.config.divisions_for(size)
        if divisions > 1 and size > MIN_BLOCK * divisions:
            return self._roundup_power2_next_division(size, divisions)
        return MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)

    @staticmethod
    def _roundup_power2_next_division(size: int, divisions: int) -> int:
        if size & (size - 1) == 0:
            return size
        floor2 = 1 << (size.bit_length() - 1)
        step = floor2 >> (divisions.bit_length() - 1)
        if step == 0:
            return floor2 << 1
        rounded = size & ~(step - 1)
        return size if rounded == size else rounded + step

    @staticmethod
    def allocation_size(size: int) -> int:
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return LARGE_BUFFER
        return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)

    def segment_size(self, size: int) -> int:
        """c10's get_allocation_size: the cudaMalloc for a rounded request that no cached block serves."""
        if SMALL_SIZE < size < MIN_LARGE_ALLOC:
            return self.config.large_segment_bytes
        return self.allocation_size(size)

    # Statistics -------------------------------------------------------------------------
    # (Stat.increase / decrease inlined: these run several times per malloc and free.)
    def _inc(self, name: str, pool: Pool, amount: int) -> None:
        stats = self.stats[name]
        for stat in (stats[0], stats[1 if pool.small else 2]):
            stat.current += amount
            stat.allocated += amount
            if stat.current > stat.peak:
                stat.peak = stat.current

    def _dec(self, name: str, pool: Pool, amount: int) -> None:
        stats = self.stats[name]
        for stat in (stats[0], stats[1 if pool.small else 2]):
            stat.current -= amount
            stat.freed += amount

    def _trace(self, action: str, addr: int, size: int, stream: int, **extra) -> None:
        if self.record:
            self.trace.append({"action": action, "addr": addr, "size": size, "stream": stream,
                               "time_us": len(self.trace), "frames": [], **extra})

    @property
    def allocated_bytes(self) -> int:
        return self.stats["allocated_bytes"][0].current

    @property
    def reserved_bytes(self) -> int:
        return self.stats["reserved_bytes"][0].current

    # malloc -----------------------------------------------------------------------------
    def malloc(self, orig_size: int, stream: int = 0) -> Block:
        size = self.round_size(orig_size)
        pool = self.small if size <= SMALL_SIZE else self.large
        alloc_size = self.segment_size(size)
        block = self._get_free_block(pool, size, stream)
        if block is None:
            if self.set_fraction and self.config.garbage_collection_threshold > 0:
                self._garbage_collect()
            block = self._alloc_block(pool, size, alloc_size, stream, retry=False)
            if block is None and self._release_available_cached_blocks(pool, size, stream):
                block = self._alloc_block(pool, size, alloc_size, stream, retry=False)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(pool, size, alloc_size, stream, retry=True)
        if block is None:
            self._raise_oom(size, alloc_size, stream)
        return self._alloc_found_block(block, pool, size, orig_size, stream, self._should_split(block, size))

    def _get_free_block(self, pool: Pool, size: int, stream: int) -> Block | None:
        if self.set_fraction and self.config.garbage_collection_threshold > 0:
            pool.free_calls += 1
        index = pool.lower_bound(stream, size)
        if index >= len(pool.keys) or pool.keys[index][0] != stream:
            return None
        block = pool.blocks[pool.keys[index]]
        if block.segment is not None:
            block = self._best_expandable(pool, index, stream)
        if size < self.max_split and block.size >= self.max_split:
            return None
        if size >= self.max_split and block.size >= size + self.config.max_non_split_rounding_bytes:
            return None
        pool.remove(block)
        return block

    def _best_expandable(self, pool: Pool, index: int, stream: int) -> Block:
        """For best fit, a block followed by unmapped space counts as the size it can grow to."""
        def growable(b: Block) -> int:
            return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

        block = pool.blocks[pool.keys[index]]
        for key in pool.keys[index + 1:]:
            candidate = pool.blocks[key]
            if key[0] != stream or block.segment is None or growable(candidate) >= growable(block):
                break
            block = candidate
        return block

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK
        return size < self.max_split and remaining > SMALL_SIZE

    def _alloc_block(self, pool: Pool, size: int, alloc_size: int, stream: int, retry: bool) -> Block | None:
        if retry:
            self.num_alloc_retries += 1
        if self.set_fraction and self.total_allocated + alloc_size > self.allowed_maximum:
            return None
        if self.config.expandable_segments:
            return self._allocate_expandable(pool, size, stream)
        if self.total_allocated + alloc_size > self.capacity:
            return None
        block = Block(self.next_address, alloc_size, pool, stream)
        self.next_address += alloc_size + SMALL_BUFFER  # segments never touch: they cannot merge
        self.total_allocated += alloc_size
        self._inc("segment", pool, 1)
        self._inc("reserved_bytes", pool, alloc_size)
        if alloc_size >= self.max_split:
            self.oversize_segments.increase(1)
        self.num_device_alloc += 1
        self._trace("segment_alloc", block.ptr, alloc_size, stream)
        return block

    def _alloc_found_block(self, block: Block, pool: Pool, size: int, orig_size: int, stream: int,
                           split: bool) -> Block:
        already_split = block.is_split
        expandable = block.segment is not None
        if split:
            remaining = block
            block = Block(remaining.ptr, size, pool, stream, remaining.segment)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.ptr += size
            remaining.size -= size
            pool.insert(remaining)
            if already_split and not expandable:
                self._dec("inactive_split_bytes", pool, block.size)
            elif not expandable:
                self._inc("inactive_split_bytes", pool, remaining.size)
                self._inc("inactive_split", pool, 1)
        elif already_split and not expandable:
            self._dec("inactive_split_bytes", pool, block.size)
            self._dec("inactive_split", pool, 1)
        block.allocated = True
        block.requested = orig_size
        self.active.add(block)
        self._trace("alloc", block.ptr, orig_size, stream)
        self._inc("allocation", pool, 1)
        self._inc("allocated_bytes", pool, block.size)
        self._inc("active", pool, 1)
        self._inc("active_bytes", pool, block.size)
        self._inc("requested_bytes", pool, orig_size)
        if block.size >= self.max_split:
            self.oversize_allocations.increase(1)
        return block

    # Memory from before a trace -------------------------------------------------------
    def restore_segment(self, stream: int, small: bool, pieces: list[tuple[int, int, int | None]]) -> list[Block]:
        """Put in a segment that existed before the trace, as it was: `pieces` are its blocks in
        address order, (address, bytes, requested bytes) for a live block and (address, bytes,
        None) for a cached free one. Returns the live blocks. Counted in reserved, allocated,
        segment and split statistics (their peaks start there), not as cudaMalloc calls or trace entries."""
        pool = self.small if small else self.large
        blocks, previous = [], None
        for ptr, size, _requested in pieces:
            block = Block(ptr, size, pool, stream)
            block.prev = previous
            if previous is not None:
                previous.next = block
            blocks.append(block)
            previous = block
        total = sum(size for _, size, _ in pieces)
        self.total_allocated += total
        self._inc("segment", pool, 1)
        self._inc("reserved_bytes", pool, total)
        if total >= self.max_split:
            self.oversize_segments.increase(1)
        live = []
        for block, (_, _, requested) in zip(blocks, pieces):
            if requested is None:
                self._restore_free(block, pool, split=len(blocks) > 1)
            else:
                self._restore_live(block, pool, requested)
                live.append(block)
        self.next_address = max(self.next_address, pieces[-1][0] + pieces[-1][1] + SMALL_BUFFER)
        return live

    def _restore_free(self, block: Block, pool: Pool, split: bool) -> None:
        pool.insert(block)
        if split:
            self._inc("inactive_split", pool, 1)
            self._inc("inactive_split_bytes", pool, block.size)

    def _restore_live(self, block: Block, pool: Pool, requested: int) -> None:
        block.allocated = True
        block.requested = requested
        self.active.add(block)
        for name, amount in (("allocation", 1), ("allocated_bytes", block.size), ("active", 1),
                             ("active_bytes", block.size), ("requested_bytes", requested)):
            self._inc(name, pool, amount)
        if block.size >= self.max_split:
            self.oversize_allocations.increase(1)

    # free -------------------------------------------------------------------------------
    def free(self, block: Block) -> None:
        if not block.allocated:
            raise LlamemError(f"double free of block at {block.ptr:#x}")
        pool = block.pool
        block.allocated = False
        self._dec("allocation", pool, 1)
        self._dec("allocated_bytes", pool, block.size)
        self._trace("free_requested", block.ptr, block.requested, block.stream)
        if block.size >= self.max_split:
            self.oversize_allocations.decrease(1)
        self._free_block(block)

    def _free_block(self, block: Block) -> None:
        self._trace("free_completed", block.ptr, block.requested, block.stream)
        pool = block.pool
        original_size, requested = block.size, block.requested
        net_blocks = net_bytes = 0
        for candidate in (block.prev, block.next):
            subsumed = self._try_merge(block, candidate, pool)
            if subsumed:
                net_blocks -= 1
                net_bytes -= subsumed
        self.active.discard(block)
        pool.insert(block)
        if block.is_split:
            net_blocks += 1
            net_bytes += block.size
        if block.segment is None:
            if net_blocks > 0:
                self._inc("inactive_split", pool, net_blocks)
            elif net_blocks < 0:
                self._dec("inactive_split", pool, -net_blocks)
            if net_bytes > 0:
                self._inc("inactive_split_bytes", pool, net_bytes)
            elif net_bytes < 0:
                self._dec("inactive_split_bytes", pool, -net_bytes)
        self._dec("active", pool, 1)
        self._dec("active_bytes", pool, original_size)
        self._dec("requested_bytes", pool, requested)

    def _try_merge(self, dst: Block, src: Block | None, pool: Pool) -> int:
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.unmapped.remove(src)
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # Releasing cached memory ------------------------------------------------------------
    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): returns every fully free segment (unmaps free pages)."""
        self._release_cached_blocks()

    def _release_cached_blocks(self) -> None:
        self.num_sync_all_streams += 1
        for pool in (self.large, self.small):
            to_unmap = []
            for key in list(pool.keys):
                block = pool.blocks.get(key)
                if block is None:
                    continue
                if block.segment is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)

    def _release_block(self, block: Block) -> None:
        pool = block.pool
        self.num_device_free += 1
        self._trace("segment_free", block.ptr, block.size, block.stream)
        self.total_allocated -= block.size
        self._dec("segment", pool, 1)
        self._dec("reserved_bytes", pool, block.size)
        if block.size >= self.max_split:
            self.oversize_segments.decrease(1)
        pool.remove(block)

    def _release_available_cached_blocks(self, pool: Pool, size: int, stream: int) -> bool:
        """With max_split_size set: free one cached oversize block big enough, or several
        oversize blocks, largest first, until enough is freed."""
        if self.max_split == SIZE_MAX:
            return False
        key_size = max(size, self.max_split)
        index = pool.lower_bound(stream, key_size)
        if index < len(pool.keys) and pool.keys[index][0] == stream:
            self._release_block(pool.blocks[pool.keys[index]])
            return True
        released = 0
        index -= 1
        while index >= 0 and released < key_size:
            key = pool.keys[index]
            if key[1] < self.max_split or key[0] != stream:
                break
            released += key[1]
            self._release_block(pool.blocks[key])
            index -= 1
        return released >= key_size

    def _garbage_collect(self) -> None:
        """Reclaim unsplit large cached blocks older than the average, until under the threshold."""
        threshold = int(self.config.garbage_collection_threshold * self.allowed_maximum)
        if self.total_allocated <= threshold:
            return
        target = self.total_allocated - threshold
        pool = self.large
        candidates = [pool.blocks[k] for k in pool.keys if not pool.blocks[k].is_split]
        total_age = sum(pool.free_calls - b.gc_base for b in candidates)
        count = len(candidates)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            threshold_age = total_age / count
            freed = False
            for key in list(pool.keys):
                block = pool.blocks.get(key)
                if block is None or block.is_split or block.segment is not None:
                    continue
                age = pool.free_calls - block.gc_base
                if age >= threshold_age:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    def set_memory_fraction(self, fraction: float) -> None:
        """torch.cuda.set_per_process_memory_fraction: a fraction of the device's total memory."""
        total = self.device_total or self.capacity
        self.allowed_maximum = int(fraction * total)
        self.set_fraction = True

    # Expandable segments ----------------------------------------------------------------
    def _page(self, pool: Pool) -> int:
        return SMALL_BUFFER if pool.small else self.config.large_segment_bytes

    def _allocate_expandable(self, pool: Pool, size: int, stream: int) -> Block | None:
        candidate = self._find_expandable_block(pool, size, stream)
        if candidate is None:
            return None
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next
            if following is None or not self._map_block(following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        pool.remove(candidate)
        return candidate

    def _expandable_span(self, pool: Pool, size: int) -> int:
        """The address space of a new expandable segment. torch reserves 1.125 x the device's total
        memory (ExpandableSegment: `numSegments(prop.totalGlobalMem + prop.totalGlobalMem / 8)` pages);
        with no device total known, a range no card fills, and never less than the request."""
        page = self._page(pool)
        if self.device_total:
            return -(-(self.device_total + self.device_total // 8) // page) * page
        return max(UNKNOWN_DEVICE_SPAN, -(-size // page) * page)

    def _find_expandable_block(self, pool: Pool, size: int, stream: int) -> Block | None:
        def allocatable(b: Block | None) -> bool:
            return b is not None and not b.allocated

        def room(b: Block | None) -> bool:
            total = 0
            while total < size and allocatable(b):
                total += b.size
                b = b.next
            return total >= size

        for block in sorted((b for b in pool.unmapped if b.stream == stream), key=lambda b: b.ptr):
            start = block.prev if (allocatable(block.prev) and block.prev.mapped) else block
            if room(start):
                return start
        span = self._expandable_span(pool, size)
        if size > span:
            # More than the whole range: torch's map() runs out of physical pages first and the
            # allocation ends in the usual out-of-memory error.
            return None
        segment = ExpandableSegment(self.next_address, span, self._page(pool))
        self.next_address += span + SMALL_BUFFER
        self.expandable.append(segment)
        block = Block(segment.base, span, pool, stream, segment)
        block.mapped = False
        pool.unmapped.append(block)
        return block

    def _map_block(self, block: Block, size: int) -> bool:
        segment, pool = block.segment, block.pool
        page = segment.page
        end = segment.base + -(-(block.ptr + size - segment.base) // page) * page
        mapped = min(end, block.ptr + block.size) - block.ptr
        if self.total_allocated + mapped > self.capacity:
            return False
        pool.unmapped.remove(block)
        block.mapped = True
        if mapped < block.size:
            rest = Block(block.ptr + mapped, block.size - mapped, pool, block.stream, segment)
            rest.mapped = False
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            pool.unmapped.append(rest)
            block.size = mapped
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.insert(block)
        self.total_allocated += mapped
        self._inc("reserved_bytes", pool, mapped)
        self.num_device_alloc += 1
        self._trace("segment_map", block.ptr, mapped, block.stream)
        return True

    def _unmap_block(self, block: Block) -> None:
        segment, pool = block.segment, block.pool
        page = segment.page
        offset = block.ptr - segment.base
        begin = segment.base + -(-offset // page) * page
        end = segment.base + (offset + block.size) // page * page
        if end <= begin:
            return
        pool.remove(block)
        before, after = begin - block.ptr, block.ptr + block.size - end
        if before:
            head = Block(block.ptr, before, pool, block.stream, segment)
            head.prev, head.next = block.prev, block
            if block.prev is not None:
                block.prev.next = head
            block.prev = head
            pool.insert(head)
        if after:
            tail = Block(end, after, pool, block.stream, segment)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            pool.insert(tail)
        block.ptr, block.size, block.mapped = begin, end - begin, False
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.unmapped.append(block)
        self.total_allocated -= end - begin
        self._dec("reserved_bytes", pool, end - begin)
        self.num_device_free += 1
        self._trace("segment_unmap", begin, end - begin, block.stream)
        if block.prev is None and block.next is None:
            pool.unmapped.remove(block)
            self.expandable.remove(segment)

    # OOM --------------------------------------------------------------------------------
    def _raise_oom(self, size: int, alloc_size: int, stream: int) -> None:
        free = max(0, self.capacity - self.total_allocated) if self.capacity != SIZE_MAX else 0
        total = self.device_total or self.capacity
        self.num_ooms += 1
        self._trace("oom", free, size, stream, device_free=free)
        allocated, reserved = self.allocated_bytes, self.reserved_bytes
        in_use = reserved + max(0, total - self.capacity) if self.capacity != SIZE_MAX else reserved
        allowed = f"{format_size(self.allowed_maximum)} allowed; " if self.set_fraction else ""
        message = (
            f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU 0 has a total capacity of "
            f"{format_size(total)} of which {format_size(free)} is free. {allowed}"
            f"Including non-PyTorch memory, this process has {format_size(in_use)} memory in use. "
            f"Of the allocated memory {format_size(allocated)} is allocated by PyTorch, and "
            f"{format_size(reserved - allocated)} is reserved by PyTorch but unallocated. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
        raise SimulatedOOM(message, size, alloc_size)

    # Introspection ----------------------------------------------------------------------
    def memory_stats(self) -> dict[str, int]:
        """The keys of torch.cuda.memory_stats() this simulator knows, same names."""
        out: dict[str, int] = {}
        for name, per_pool in self.stats.items():
            for pool_name, stat in zip(POOL_TYPES, per_pool):
                for field in ("current", "peak", "allocated", "freed"):
                    out[f"{name}.{pool_name}.{field}"] = getattr(stat, field)
        for name, stat in (("oversize_allocations", self.oversize_allocations),
                           ("oversize_segments", self.oversize_segments)):
            for field in ("current", "peak", "allocated", "freed"):
                out[f"{name}.{field}"] = getattr(stat, field)
        out.update(num_alloc_retries=self.num_alloc_retries, num_ooms=self.num_ooms,
                   num_device_alloc=self.num_device_alloc, num_device_free=self.num_device_free,
                   num_sync_all_streams=self.num_sync_all_streams,
                   max_split_size=-1 if self.max_split == SIZE_MAX else self.max_split)
        return out

    def free_blocks(self) -> list[Block]:
        return [b for pool in (self.small, self.large) for b in pool.blocks.values()]

    def largest_free_block(self) -> int:
        return max((b.size for b in self.free_blocks()), default=0)

    def segment_heads(self) -> list[Block]:
        """First block of every live segment (expandable: of every mapped run)."""
        heads = []
        for block in list(self.active) + self.free_blocks():
            if block.prev is None or (block.segment is not None and not block.prev.mapped):
                heads.append(block)
        return sorted(heads, key=lambda b: b.ptr)


class LeanAllocatorSim(CachingAllocatorSim):
    """The same allocator without its statistics or trace: for the many replays that only ask
    whether a schedule runs on a card and how much it reserves (`total_allocated` is all they read),
    about a third faster. Every allocation decision is the parent's."""

    def _inc(self, name: str, pool: Pool, amount: int) -> None:
        pass

    def _dec(self, name: str, pool: Pool, amount: int) -> None:
        pass

    def _trace(self, action: str, addr: int, size: int, stream: int, **extra) -> None:
        pass

