"""Quiz keys computed from the learner's own measurements (notebook 06 §13).

The bank ``quizzes/06_sharding.toml`` names these as ``key = "labkit.sharding.keys:<fn>"``
with ``inputs`` = the notebook variables they read, so a question about "your run" is scored
against that run, whatever this machine measured. Each key checks its input and says which
cell to run when it is missing or of the wrong kind.
"""
from __future__ import annotations

__all__ = ["ddp_bytes_per_param", "zero3_traffic_ratio", "zero1_state_fraction"]


def _rank0_setups(runs, name: str, needs: tuple[str, ...]) -> dict[str, dict]:
    if not isinstance(runs, (list, tuple)) or not runs or not isinstance(runs[0], (list, tuple)):
        raise ValueError(f"{name} should be lk.run(lk.sharding.run_setups, ...).values (a list "
                         f"per rank of setup results); run the cell that measures it first.")
    by_setup = {r.get("setup"): r for r in runs[0] if isinstance(r, dict)}
    missing = [s for s in needs if s not in by_setup]
    if missing:
        raise ValueError(f"{name} has no {', '.join(missing)} run: measure "
                         f"{', '.join(needs)} in the same job.")
    return by_setup


def ddp_bytes_per_param(ddp_mem) -> float:
    """Bytes per parameter rank 0 held under DDP + Adam: measured total / Ψ."""
    if not isinstance(ddp_mem, (list, tuple)) or not ddp_mem or "measured" not in ddp_mem[0]:
        raise ValueError("ddp_mem should be lk.run(lk.sharding.ddp_memory, ...).values; run the "
                         "cell of §1 that measures it first.")
    first = ddp_mem[0]
    return first["measured"]["total"] / first["psi"]


def zero3_traffic_ratio(zero2) -> float:
    """Bytes ZeRO-3 sent per step divided by what DDP sent, both counted in the learner's run."""
    s = _rank0_setups(zero2, "zero2", ("DDP", "ZeRO-3"))
    return s["ZeRO-3"]["ring_sent"] / s["DDP"]["ring_sent"]


def zero1_state_fraction(zero4) -> float:
    """Optimizer-state bytes of a ZeRO-1 rank over a DDP rank's, in the learner's 4-rank run."""
    s = _rank0_setups(zero4, "zero4", ("DDP", "ZeRO-1"))
    return s["ZeRO-1"]["memory"]["optimizer"] / s["DDP"]["memory"]["optimizer"]
