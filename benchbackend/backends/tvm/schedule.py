"""TVM ``default`` mode's CPU schedule: a fixed rule, no search, for every fused kernel.

TVM's CPU pipeline lowers each operator to plain scalar loops on one thread (its GPU pipelines
schedule with dlight; its CPU one schedules nothing): ResNet-50 ran at 8.5 s per image on two cores,
so a 64-image inference cell took hours. This rule gives each loop nest what any hand-written CPU
kernel has, the same way for every operator:

- the spatial loops outside, the outer ones fused and run on the thread pool;
- the innermost spatial loop (NHWC: the channels) vectorized at the target's vector width;
- in a reduction (convolution, dense, pooling, mean), the reduction loops moved inside the spatial
  ones, with a tile of the next spatial loop (the output column) unrolled around the vector, so
  that tile x vector accumulators stay in registers across the reduction.

It is what ``default`` means here: TVM with a sensible untuned schedule. ``tuned`` replaces it with
MetaSchedule's search. It reorders loops only: each output element still sums its reduction in the
same order, so results are bit for bit those of the unscheduled loops (``tests/test_tvm.py``).
"""
from __future__ import annotations

from typing import Any, Optional

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

#: Output-column tiles tried, largest first: 8 x a 16-lane vector is 8 of AVX-512's 32 registers.
TILES = (8, 7, 6, 5, 4, 3, 2)


def _extent(sch: s_tir.Schedule, loop: Any) -> Optional[int]:
    extent = sch.get(loop).extent
    return extent.value if isinstance(extent, tirx.IntImm) else None


def vector_lanes(target: tvm.target.Target, dtype_bits: int = 32) -> int:
    """float32 lanes of the target's widest vector register (LLVM's view of the CPU); 4 if unknown."""
    try:
        bits = int(tvm.target.codegen.llvm_get_vector_width(target))
    except Exception:  # noqa: BLE001 - not an llvm target, or a build without the query
        bits = 128
    return max(1, bits // dtype_bits) if bits > 0 else 4


class CPUDefault(CPUScheduleRule):
    """The rule above, for ``dlight.ApplyDefaultSchedule``: a schedule for every loop nest it can
    read, the function unchanged (plain loops, still correct) for any it cannot."""

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, _tunable: bool) -> Optional[s_tir.Schedule]:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        return sch if schedule_loops(sch, target) else None


def schedule_loops(sch: s_tir.Schedule, target: tvm.target.Target, tunable: bool = False) -> bool:
    """The rule on ``sch`` (its ``main``), in place; False where it reads no loop nest.

    ``tunable``: the register tile's sizes are MetaSchedule decisions instead of the fixed choice
    (``tuning.rule_space``): the output-column tile (up to 16) and a tile of whole vectors of the
    channels (up to 4), each a ``sample_perfect_tile`` that the search's tile-size mutator varies.
    """
    infos = normalize_prim_func(sch)
    if infos is None:
        return False
    lanes = vector_lanes(target)
    reductions = []
    for info in infos:
        block = info.block_rv
        loops = sch.get_loops(block)
        kinds = info.dom_kind()
        if not loops or "O" in kinds or "S" not in kinds or len(kinds) != len(loops):
            continue
        spatial = [loop for loop, kind in zip(loops, kinds) if kind == "S"]
        reduce = [loop for loop, kind in zip(loops, kinds) if kind == "R"]
        sch.reorder(*spatial, *reduce)
        spatial, vec = _split_vector(sch, spatial, lanes)
        tiles = []
        if reduce and vec is not None and len(spatial) >= 2:
            spatial, tiles = _sample_tiles(sch, spatial) if tunable else _split_tile(sch, spatial)
        if reduce and vec is not None:
            sch.reorder(*spatial, *reduce, *tiles, vec)
        if spatial:
            sch.parallel(sch.fuse(*spatial[:-1]) if len(spatial) > 2 else spatial[0])
        for tile in tiles:
            sch.unroll(tile)
        if vec is not None:
            sch.vectorize(vec)
        if reduce:
            reductions.append((block, reduce[0]))
    for block, loop in reductions:
        sch.decompose_reduction(block, loop)
    return True


def _sample_tiles(sch: s_tir.Schedule, spatial: list) -> tuple[list, list]:
    """``_split_tile``'s column tile and a tile of the channels' vectors, as sampled decisions."""
    column, channels = spatial[-2], spatial[-1]
    col_outer, col_inner = sch.split(column, factors=sch.sample_perfect_tile(column, n=2, max_innermost_factor=16))
    ch_outer, ch_inner = sch.split(channels, factors=sch.sample_perfect_tile(channels, n=2, max_innermost_factor=4))
    return [*spatial[:-2], col_outer, ch_outer], [col_inner, ch_inner]


def _split_vector(sch: s_tir.Schedule, spatial: list, lanes: int) -> tuple[list, Any]:
    """The innermost spatial loop split into (rest, vector): a whole vector width, or the widest of
    its halves that divides the extent; a short loop is all vector. ``None``: no vector."""
    extent = _extent(sch, spatial[-1])
    if extent is None or extent <= 1:
        return spatial, None
    width = min(extent, lanes)
    while width > 1 and extent % width:
        width //= 2
    if width <= 1:
        return spatial, None
    outer, inner = sch.split(spatial[-1], factors=[None, width])
    return [*spatial[:-1], outer], inner


def _split_tile(sch: s_tir.Schedule, spatial: list) -> tuple[list, list]:
    """The spatial loop next to the vector's split by the largest tile in TILES that divides it; when
    none does (a ViT's 197 tokens), the loops outside the vector's fused into one first (batch x tokens),
    which one may: without a tile, each output row reloads the whole kernel from memory."""
    extent = _extent(sch, spatial[-2])
    size = next((t for t in TILES if extent is not None and extent % t == 0), None)
    if size is None and len(spatial) > 2:
        spatial = [sch.fuse(*spatial[:-1]), spatial[-1]]
        extent = _extent(sch, spatial[-2])
        size = next((t for t in TILES if extent is not None and extent % t == 0), None)
    if size is None:
        return spatial, []
    outer, inner = sch.split(spatial[-2], factors=[None, size])
    return [*spatial[:-2], outer, spatial[-1]], [inner]


def schedule_pass() -> tvm.transform.Pass:
    """The pass that schedules every not-yet-scheduled kernel of a legalized, fused module."""
    return dlight.ApplyDefaultSchedule(CPUDefault())


def default_pipeline(target: tvm.target.Target, database: Optional[Any] = None) -> tvm.transform.Pass:
    """TVM's CPU pipeline with the rule between fusion and lowering (where its GPU pipelines apply
    dlight's rules). With a MetaSchedule ``database`` (``tuned``), each kernel it holds a record for
    takes the searched schedule, and the rule schedules the rest: TVM's ``compile_relax`` would
    leave those as scalar loops, so a small budget that misses a kernel made ``tuned`` slower than
    ``default``."""
    # The CPU backend's own pass lists (``relax.pipeline``'s dispatchers miss two of them in 0.27).
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    from tvm.relax.transform import MetaScheduleApplyDatabase

    @tvm.transform.module_pass(opt_level=0)
    def pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            searched = [] if database is None else [MetaScheduleApplyDatabase()]
            return tvm.transform.Sequential([
                *cpu.library_dispatch_passes(target), *cpu.legalize_passes(target),
                *searched, schedule_pass(),
                *cpu.dataflow_lower_passes(target), *cpu.finalize_passes(target),
            ])(mod)

    return pipeline


def compile_module(mod: tvm.IRModule, target: tvm.target.Target, database: Optional[Any] = None) -> Any:
    """The VM executable of ``mod``: ``default_pipeline``, under the database when one is given (the
    context MetaScheduleApplyDatabase reads it from, at opt_level 3 as TVM's ``compile_relax``)."""
    with target:
        if database is None:
            return tvm.compile(mod, target, relax_pipeline=default_pipeline(target))
        with database, tvm.transform.PassContext(opt_level=3):
            return tvm.compile(mod, target, relax_pipeline=default_pipeline(target, database))
