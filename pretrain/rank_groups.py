"""megatron-core's process groups of a layout computed without creating any: `rank_groups` enumerates
them with megatron's own RankGenerator, `groups_of` computes one rank's in constant time (the dry run's
plan and step-time model; tests compare the two)."""

from __future__ import annotations


def rank_groups(tp: int, pp: int, dp: int, cp: int = 1) -> dict[str, list[list[int]]]:
    """megatron-core's groups for (tp, pp, dp, cp) without creating any (its RankGenerator); "dp" is the
    data axis (ranks that read different samples), "replica" the dp x cp ranks that hold the same weights."""
    from .mcore import parallel_state

    gen = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    groups = {name: gen.get_ranks(token) for name, token in
              (("tp", "tp"), ("cp", "cp"), ("pp", "pp"), ("dp", "dp"), ("replica", "dp-cp"), ("mp", "tp-pp"))}
    groups["embedding"] = [[g[0], g[-1]] for g in groups["pp"]] if pp > 1 else []
    return groups


def groups_of(rank: int, tp: int, pp: int, dp: int, cp: int = 1) -> dict[str, range]:
    """The TP, CP, DP (data axis), replica (dp x cp) and PP groups of `rank` in megatron-core's order
    tp-cp-ep-dp-pp (rank = t + tp * (c + cp * (d + dp * s))), computed, not enumerated: the dry run's
    time does not grow with the world size (tests compare it with `rank_groups`)."""
    t, c, d, s = rank % tp, rank // tp % cp, rank // (tp * cp) % dp, rank // (tp * cp * dp)
    block = tp * cp * dp  # the ranks of one pipeline stage
    first_dp = t + tp * c + block * s
    return {"tp": range(rank - t, rank - t + tp), "cp": range(rank - tp * c, rank - tp * c + tp * cp, tp),
            "dp": range(first_dp, first_dp + block, tp * cp), "replica": range(t + block * s, t + block * (s + 1), tp),
            "pp": range(t + tp * c + tp * cp * d, block * pp, block)}
